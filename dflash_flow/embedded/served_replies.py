"""A served chat completion's two ends: the request's sampling fields (``sampling_params``) and the reply
read back (``parse_reply``: the assistant turn, its finish reason, its tokens; a reasoning block put back in
front of the answer). ``served`` sends the requests."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_flow.engine.http import RequestFailed

__all__ = ["parse_chat_completion", "parse_reply", "sampling_params"]


def sampling_params(sampling: str, target: str | Path | None = None) -> dict:
    """The request's sampling fields. ``"greedy"``: temperature 0 (every engine decodes greedily then).
    ``"target"``: the target's ``generation_config.json`` (temperature, top_p, top_k; ``do_sample: false`` is
    greedy) when ``target`` is a directory holding one; else nothing, and the server applies its own defaults
    (vLLM and SGLang use the served model's generation config)."""
    if sampling == "greedy":
        return {"temperature": 0.0}
    if sampling != "target":
        raise ValueError(f"--sampling {sampling!r}: use 'greedy' or 'target'")
    if target is None:
        return {}
    path = Path(target) / "generation_config.json"
    if not path.is_file():
        if Path(target).is_dir():
            return {}
        raise ValueError(f"--target {target}: not a model directory (its generation_config.json gives the "
                         "sampling settings of --sampling target)")
    try:
        gc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--sampling target: {path} cannot be read as JSON ({exc})") from None
    if not isinstance(gc, dict):
        raise ValueError(f"--sampling target: {path} holds a JSON {type(gc).__name__}, not the object of a generation "
                         "config; fix it, or use --sampling greedy")
    if gc.get("do_sample") is False:
        return {"temperature": 0.0}
    out = {}
    for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        if gc.get(key) is not None:
            out[key] = gc[key]
    return out


_STOP_REASONS = {"stop", "eos", "stop_sequence", "end_turn", "tool_calls"}


def parse_chat_completion(resp: dict, model: str | None = None) -> tuple[str, str, int]:
    """(reply text, finish_reason, completion tokens) of a chat completion (:func:`parse_reply`)."""
    turn, finish, tokens = parse_reply(resp, model)
    return turn["content"], finish, tokens


def parse_reply(resp: dict, model: str | None = None) -> tuple[dict, str, int]:
    """(assistant turn, finish_reason, completion tokens) of a chat completion: the turn's ``content`` and,
    when the reply calls tools, its ``tool_calls`` (then it is not empty); RequestFailed('malformed') when it is
    not one (or its text is not text: a lone surrogate), RequestFailed('server') when the server aborted the
    request or (``model`` given) the completion names another model than the one asked for (a server serving
    something else: its replies would teach the drafter another model)."""
    if isinstance(resp, dict) and "choices" not in resp and resp.get("error"):  # an error sent with status 200
        err = resp["error"]
        msg = err.get("message") if isinstance(err, dict) else err
        raise RequestFailed("server", f"the server answered with an error: {str(msg)[:300]}")
    answered = resp.get("model") if isinstance(resp, dict) else None
    if model is not None and answered is not None and answered != model:
        raise RequestFailed("server", f"the reply is from model {answered!r}, not {model!r} (this server serves "
                                      "another model)")
    try:
        choice = resp["choices"][0]
        msg = choice["message"]
        content = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        reason = choice.get("finish_reason")
        calls = msg.get("tool_calls")
        if not isinstance(content, str) or not isinstance(reasoning, str):
            raise TypeError("content is not text")
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise RequestFailed("malformed", f"not a chat completion ({type(e).__name__}: {e})") from None
    if reason == "length":
        finish = "length"
    elif reason in _STOP_REASONS:
        finish = "stop"
    else:
        raise RequestFailed("server", f"the server ended the request with finish_reason {reason!r}")
    if reasoning.strip():
        content = f"<think>\n{reasoning.strip()}\n</think>\n\n{content.lstrip()}"
    try:  # JSON may escape a lone surrogate ("\\ud800"): no text, and the output file could not hold it
        content.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestFailed("malformed", f"the reply is not valid text (a lone surrogate at character {e.start})"
                            ) from None
    usage = resp.get("usage") or {}
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    tokens = int(tokens) if isinstance(tokens, int | float) else 0
    if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
        raise RequestFailed("malformed", "tool_calls is not a list of objects")
    if not content.strip() and not calls:
        finish = "empty"
    turn = {"role": "assistant", "content": content}
    if calls:  # the target called tools (a server with a tool parser split them out): kept, rendered by the template
        turn["tool_calls"] = calls
    return turn, finish, tokens
