"""Render chat conversations with the tokenizer's chat template and mark the assistant tokens: the loss mask
is 1 on what the model generates at serving time (an assistant turn after the last generation prompt before
it, through the end-of-turn marker; both probed once per template); rendered and tokenized once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from os.path import commonprefix
from typing import Any

import attrs
import numpy as np

__all__ = ["ChatEncoding", "ChatTemplateError", "TemplateInfo", "encode_chat", "parse_conversation", "probe_template",
           "prompt_turns", "regeneration_plan", "render_chat", "stop_token_ids"]


class ChatTemplateError(ValueError):
    """A conversation (or template) that cannot be rendered into supervised spans."""


@attrs.define(frozen=True)
class TemplateInfo:
    """What the loss mask needs to know about a chat template."""

    generation_prompt: str  # appended by add_generation_prompt=True, e.g. "<|im_start|>assistant\n"
    end_of_turn: str  # closes an assistant turn, e.g. "<|im_end|>\n"; may be ""
    # The role header every assistant turn starts with (e.g. "<|im_start|>assistant\n"); content is
    # searched for after it, so an answer such as "assistant" is not found inside the header. May be "".
    assistant_header: str = ""


@attrs.define(eq=False)
class ChatEncoding:
    text: str
    input_ids: np.ndarray  # int64 [n]
    loss_mask: np.ndarray  # uint8 [n]
    spans: list[tuple[int, int]]  # supervised character spans of `text`


# Role names of ShareGPT-style turns ({"from", "value"}) and common aliases.
_ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                 "tool": "tool", "model": "assistant", "bot": "assistant"}


#: Content-part types that carry text (OpenAI chat ``{"type": "text", "text": ...}``; the Responses API's).
_TEXT_PARTS = ("text", "input_text", "output_text")


def _content_text(content: Any) -> tuple[str | None, str]:
    """The text of a message's content: a string, or OpenAI-style content parts whose text parts are joined
    with newlines (as vLLM renders them for templates that take a string); ``(None, why)`` otherwise."""
    if isinstance(content, str):
        return content, ""
    if not isinstance(content, list):
        return None, "no" if content is None else f"a non-string ({type(content).__name__})"
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, dict) and part.get("type") in _TEXT_PARTS and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            return None, f"a content part {j} of type {kind!r} (only text parts can be trained on) in its"
    return "\n".join(texts), ""


def parse_conversation(obj: dict) -> tuple[list[dict] | None, str, str]:
    """The messages of a chat record (``conversations`` or ``messages``; ``{role, content}`` or ShareGPT
    ``{from, value}`` turns; content a string or text parts) as ``(messages, "", "")``, or ``(None, error kind,
    reason)``. ``tool_calls`` (``content: null`` read as "") and ``tool`` turns are kept for the template."""
    if "conversations" in obj and "messages" in obj:
        return None, "conflicting_fields", ("the record has both 'conversations' and 'messages'; keep one (which "
                                            "turns to train on would be a guess)")
    key = "conversations" if "conversations" in obj else "messages" if "messages" in obj else None
    if key is None:
        return None, "missing_field", "missing field 'conversations' (a chat record holds its turns in 'conversations' or 'messages')"
    turns = obj[key]
    if not isinstance(turns, list) or not turns:
        return None, "missing_field", f"'{key}' must be a non-empty list"
    msgs = []
    for i, t in enumerate(turns):
        if not isinstance(t, dict):
            return None, "missing_field", f"{key}[{i}] is {type(t).__name__}, expected an object"
        if "role" in t or "content" in t:
            role, content = t.get("role"), t.get("content")
            rkey, ckey = "role", "content"
        else:
            role, content = _ROLE_ALIASES.get(t.get("from"), t.get("from")), t.get("value")
            rkey, ckey = "from", "value"
        if role is None:
            return None, "missing_field", f"{key}[{i}] has no '{rkey}'"
        calls = t.get("tool_calls")
        if calls is not None and (role != "assistant" or not isinstance(calls, list)
                                  or not all(isinstance(c, dict) for c in calls)):
            return None, "missing_field", f"{key}[{i}] has 'tool_calls' that are not a list of objects of an assistant turn"
        if content is None and calls:
            content = ""  # a turn that only calls tools: the template renders the calls
        text, why = _content_text(content)
        if text is None:
            return None, "missing_field", f"{key}[{i}] has {why} '{ckey}'"
        msg = {k: v for k, v in t.items() if k not in ("from", "value")}
        msg["role"], msg["content"] = role, text
        msgs.append(msg)
    return msgs, "", ""


def prompt_turns(record: dict, system_prompt: str | None = None) -> list[dict]:
    """The turns a model continues: everything up to and including the last user turn of a chat record,
    or ``{"prompt": text}`` as one user turn (optionally behind ``system_prompt``). Raises ValueError."""
    if "conversations" in record or "messages" in record:
        msgs, _, reason = parse_conversation(record)
        if msgs is None:
            raise ValueError(reason)
    elif "prompt" in record:
        msgs = [{"role": "user", "content": str(record["prompt"])}]
    else:
        raise ValueError(f"record has neither 'conversations' nor 'prompt': keys {sorted(record)}")
    last_user = max((i for i, t in enumerate(msgs) if t["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("conversation has no user turn")
    turns = [{"role": t["role"], "content": t["content"]} for t in msgs[: last_user + 1]]
    if system_prompt is not None and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system_prompt}] + turns
    return turns


def regeneration_plan(record: dict, system_prompt: str | None = None) -> list[dict | None]:
    """The conversation a regeneration writes, ``None`` where each reply of the target goes: the turns up to the
    last user turn, each run of assistant turns after a user turn replaced by one ``None``, and a ``None`` at the
    end (assistant turns before the first user turn are context). ValueError for no prompt, or tool calls."""
    msgs = parse_conversation(record)[0] if "conversations" in record or "messages" in record else None
    for i, m in enumerate(msgs or ()):
        if m.get("tool_calls") or m["role"] == "tool":
            raise ValueError(f"turn {i} {'calls tools' if m.get('tool_calls') else 'is a tool result'}: regeneration "
                             "cannot replay tool calls (the results would not answer the target's own calls); "
                             "leave such records out of the prompts")
    turns = prompt_turns(record, system_prompt)
    plan: list[dict | None] = []
    seen_user = False
    for t in turns:
        if t["role"] == "assistant" and seen_user:
            if plan[-1] is not None:
                plan.append(None)
            continue
        seen_user = seen_user or t["role"] == "user"
        plan.append(t)
    plan.append(None)
    return plan


_STOP_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|endoftext|>")


def stop_token_ids(tokenizer: Any) -> list[int]:
    """Ids that end an assistant turn: eos plus the chat template's end-of-turn tokens when present."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    for tok in _STOP_TOKENS:
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid >= 0 and tid != tokenizer.unk_token_id:
            ids.add(tid)
    return sorted(ids)


_PROBE_USER = ("zqxuserprobeone", "zqxuserprobetwo")
_PROBE_ASSISTANT = ("zqxassistantprobeone", "zqxassistantprobetwo")


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                add_generation_prompt: bool = False, template_kwargs: Mapping[str, Any] | None = None) -> str:
    try:
        text = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template, **dict(template_kwargs or {}))
    except Exception as exc:  # jinja raises many types (TemplateError, TypeError, our raise_exception)
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template rendered {type(text).__name__}, expected str")
    return text


def probe_template(tokenizer: Any, *, chat_template: str | None = None,
                   template_kwargs: Mapping[str, Any] | None = None) -> TemplateInfo:
    """Find the template's generation prompt and end-of-turn marker by rendering probe conversations."""
    u, a = _PROBE_USER, _PROBE_ASSISTANT
    convo = [{"role": "user", "content": u[0]}, {"role": "assistant", "content": a[0]},
             {"role": "user", "content": u[1]}, {"role": "assistant", "content": a[1]}]

    def render(msgs, gen=False):
        return render_chat(tokenizer, msgs, chat_template=chat_template, add_generation_prompt=gen,
                           template_kwargs=template_kwargs)

    try:
        text = render(convo)
    except ChatTemplateError:
        # Some templates insist on a leading system message.
        convo.insert(0, {"role": "system", "content": "zqxsystemprobe"})
        text = render(convo)
    try:
        a0 = text.index(a[0]) + len(a[0])
        u1 = text.index(u[1], a0)
        a1 = text.index(a[1], u1) + len(a[1])
    except ValueError as exc:
        raise ChatTemplateError("the chat template does not render message contents verbatim; loss masks need a "
                                "template that renders each assistant message's content as one contiguous piece") from exc
    after_mid, after_last = text[a0:u1], text[a1:]
    eot = commonprefix([after_mid, after_last])
    between = text[text.index(u[0]) + len(u[0]) : text.index(a[0])]
    # What follows a user message up to the assistant content: user end-of-turn, assistant header and,
    # for some turns, more (Qwen3's think block); the common part minus the end-of-turn is the header.
    lead = commonprefix([between, text[u1 + len(u[1]) : text.index(a[1], u1)]])
    if eot and lead.startswith(eot):
        lead = lead[len(eot) :]
    if not eot:
        eos = getattr(tokenizer, "eos_token", None)
        if isinstance(eos, str) and eos and after_mid.startswith(eos):
            eot = eos

    head = convo[: len(convo) - 1]  # ends with the second user message
    with_gen, without = render(head, gen=True), render(head, gen=False)
    if with_gen.startswith(without) and len(with_gen) > len(without):
        gen_prompt = with_gen[len(without) :]
    else:
        # No usable add_generation_prompt: take the header the template writes before an assistant
        # message, i.e. what separates the user content from the assistant content minus the end-of-turn.
        gen_prompt = between[len(eot) :] if eot and between.startswith(eot) else between
    if not gen_prompt:
        raise ChatTemplateError("could not determine the chat template's assistant header")
    return TemplateInfo(generation_prompt=gen_prompt, end_of_turn=eot, assistant_header=lead)


def _locate(text: str, content: str, cursor: int) -> tuple[int, int]:
    """Start and end of an assistant message's content in ``text`` at or after ``cursor``."""
    variants = [content, content.strip(), content.lstrip("\n"), content.rstrip()]
    if "</think>" in content:  # Qwen-style templates split reasoning out of the content
        variants.append(content.split("</think>")[-1].strip())
    for v in variants:
        if not v:
            continue
        pos = text.find(v, cursor)
        if pos >= 0:
            return pos, pos + len(v)
    return -1, -1


def _message_fields(i: int, msg: Any) -> tuple[str, Any]:
    if not isinstance(msg, Mapping):
        raise ChatTemplateError(f"message {i} is {type(msg).__name__}, expected an object with role and content")
    if "role" not in msg:
        raise ChatTemplateError(f"message {i} has no 'role'")
    return msg["role"], msg.get("content")


def supervised_spans(text: str, messages: Sequence[Mapping[str, Any]], info: TemplateInfo) -> list[tuple[int, int]]:
    """Character spans of ``text`` that the model generates (assistant turns after their header)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    gp, eot = info.generation_prompt, info.end_of_turn
    for i, msg in enumerate(messages):
        role, content = _message_fields(i, msg)
        if content is None and role == "assistant" and msg.get("tool_calls"):
            content = ""  # a turn that only calls tools
        if not isinstance(content, str):
            raise ChatTemplateError(f"message {i} ({role}): content must be a string, got {type(content).__name__}")
        if role != "assistant":
            start, end = _locate(text, content, cursor)
            if start >= 0:
                cursor = end
            continue
        if not content.strip():
            if msg.get("tool_calls"):  # the calls are what the model generates: its turn after the header
                span = _tool_call_span(text, i, cursor, info)
                spans.append(span)
                cursor = span[1]
            continue
        search_from = cursor
        if info.assistant_header:
            # The first header after the previous message is this turn's (earlier assistant turns end at
            # their end-of-turn, which the cursor has passed).
            h = text.find(info.assistant_header, cursor)
            if h >= 0:
                search_from = h + len(info.assistant_header)
        start, end = _locate(text, content, search_from)
        if start < 0:
            raise ChatTemplateError(
                f"message {i} (assistant): content not found verbatim in the rendered conversation; the template "
                "must render assistant content contiguously"
            )
        header = text.rfind(gp, cursor, start)
        mask_start = header + len(gp) if header >= 0 else start
        mask_end = end
        if eot:
            if text.startswith(eot, end):
                mask_end = end + len(eot)
            else:
                # Something the model also generates (tool calls) may sit between content and end-of-turn.
                nxt_content = _message_fields(i + 1, messages[i + 1])[1] if i + 1 < len(messages) else None
                p = text.find(nxt_content, end) if isinstance(nxt_content, str) and nxt_content else -1
                p = text.find(eot, end, p if p >= 0 else len(text))
                if p >= 0:
                    mask_end = p + len(eot)
        spans.append((mask_start, mask_end))
        cursor = mask_end
    return spans


def _tool_call_span(text: str, i: int, cursor: int, info: TemplateInfo) -> tuple[int, int]:
    """The supervised span of an assistant turn that only calls tools: from after the template's assistant
    header (what every assistant turn starts with) to its end-of-turn marker, both found after ``cursor``."""
    header, eot = info.assistant_header or info.generation_prompt, info.end_of_turn
    h = text.find(header, cursor)
    size = len(header)
    end = text.find(eot, h + size) if eot and h >= 0 else -1
    if h < 0 or end < 0:
        raise ChatTemplateError(f"message {i} (assistant): its tool calls are not found in the rendered conversation "
                                "(no assistant header and end of turn after the previous message)")
    return h + size, end + len(eot)


def token_mask(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for tokens whose first character lies in a span. ``offsets`` is [n, 2] character offsets."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    n = offsets.shape[0]
    if not spans or n == 0:
        return np.zeros(n, dtype=np.uint8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    # Byte-level BPE with trim_offsets shrinks a whitespace-only token to (end, end): its real first
    # character is before that, so use end - 1 to keep it on the correct side of a span boundary.
    key = np.where(ends > starts, starts, np.maximum(ends - 1, 0))
    s, e = np.asarray(spans, dtype=np.int64).reshape(-1, 2).T
    j = np.searchsorted(s, key, side="right") - 1
    inside = (j >= 0) & (key < e[np.clip(j, 0, None)])
    return inside.astype(np.uint8)


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], *, chat_template: str | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> ChatEncoding:
    """Render, tokenize and mask one conversation (no truncation; see `records` for that)."""
    if not getattr(tokenizer, "is_fast", False):
        raise ChatTemplateError("loss masks need a fast tokenizer (offset mapping); got a slow tokenizer")
    info = probe_template(tokenizer, chat_template=chat_template, template_kwargs=template_kwargs)
    text = render_chat(tokenizer, messages, chat_template=chat_template, template_kwargs=template_kwargs)
    spans = supervised_spans(text, messages, info)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(enc["input_ids"], dtype=np.int64)
    mask = token_mask(np.asarray(enc["offset_mapping"], dtype=np.int64), spans)
    return ChatEncoding(text=text, input_ids=ids, loss_mask=mask, spans=spans)
