"""Loss masks on real chat templates: ChatML, Qwen3 (thinking on/off, rewritten history), Llama 3."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_flow.data.chat import ChatTemplateError, encode_chat, probe_template, token_mask


def supervised_runs(tok, enc) -> list[str]:
    """Decoded text of each maximal run of supervised tokens."""
    runs, i, m = [], 0, enc.loss_mask
    while i < m.size:
        if m[i]:
            j = i
            while j < m.size and m[j]:
                j += 1
            runs.append(tok.decode(enc.input_ids[i:j].tolist()))
            i = j
        else:
            i += 1
    return runs


MULTI = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hello world"},
    {"role": "assistant", "content": "Hi! How are you?"},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
]


def test_probe_chatml(chatml_tokenizer):
    info = probe_template(chatml_tokenizer)
    assert info.generation_prompt == "<|im_start|>assistant\n"
    assert info.end_of_turn == "<|im_end|>\n"


def test_chatml_multi_turn_with_system(chatml_tokenizer):
    enc = encode_chat(chatml_tokenizer, MULTI)
    assert supervised_runs(chatml_tokenizer, enc) == [
        "Hi! How are you?<|im_end|>\n",
        "It is four.<|im_end|>\n",
    ]
    # Everything else (system prompt, user turns, assistant headers) is unsupervised.
    unsup = chatml_tokenizer.decode(enc.input_ids[enc.loss_mask == 0].tolist())
    assert unsup.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHello world")
    assert unsup.count("<|im_start|>assistant\n") == 2
    # Tokenizing the rendered text as a whole gives the same ids as the template's own tokenization.
    ref = chatml_tokenizer.apply_chat_template(MULTI, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert enc.input_ids.tolist() == list(ref)


def test_qwen3_thinking_off_excludes_prompted_empty_think(qwen3_tokenizer):
    kw = {"enable_thinking": False}
    info = probe_template(qwen3_tokenizer, template_kwargs=kw)
    assert info.generation_prompt == "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    enc = encode_chat(qwen3_tokenizer, MULTI, template_kwargs=kw)
    # The last turn is rendered with an empty think block that serving puts into the prompt: not supervised.
    assert "<think>\n\n</think>\n\nIt is four." in enc.text
    assert supervised_runs(qwen3_tokenizer, enc) == [
        "Hi! How are you?<|im_end|>\n",
        "It is four.<|im_end|>\n",
    ]


def test_qwen3_thinking_on_supervises_reasoning_of_last_turn_only(qwen3_tokenizer):
    msgs = [
        {"role": "user", "content": "Hello world"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nHi!"},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four.", "reasoning_content": "two and two"},
    ]
    enc = encode_chat(qwen3_tokenizer, msgs)
    # Qwen3 drops reasoning of turns before the last user query (history rewrite).
    assert "old reasoning" not in enc.text
    assert supervised_runs(qwen3_tokenizer, enc) == [
        "Hi!<|im_end|>\n",
        "<think>\ntwo and two\n</think>\n\nIt is four.<|im_end|>\n",
    ]


def test_llama3_style_eot_without_newline_and_bos(llama3_tokenizer):
    enc = encode_chat(llama3_tokenizer, MULTI)
    assert enc.text.startswith("<|begin_of_text|>")
    assert supervised_runs(llama3_tokenizer, enc) == ["Hi! How are you?<|eot_id|>", "It is four.<|eot_id|>"]


def test_assistant_content_repeating_the_user_text(chatml_tokenizer):
    # The assistant repeats the user's words: the span must be found after the header, not in the user turn.
    msgs = [{"role": "user", "content": "echo"}, {"role": "assistant", "content": "echo"}]
    enc = encode_chat(chatml_tokenizer, msgs)
    assert supervised_runs(chatml_tokenizer, enc) == ["echo<|im_end|>\n"]


def test_untrimmed_offsets_give_same_mask(make_tokenizer):
    a = make_tokenizer(trim_offsets=True)
    b = make_tokenizer(trim_offsets=False)
    msgs = [{"role": "user", "content": "a  b"}, {"role": "assistant", "content": "  spaced   out  "}]
    ea, eb = encode_chat(a, msgs), encode_chat(b, msgs)
    assert ea.input_ids.tolist() == eb.input_ids.tolist()
    assert ea.loss_mask.tolist() == eb.loss_mask.tolist()


def test_token_mask_zero_width_tokens_stay_on_their_side():
    # (3, 3) is a whitespace token trimmed to zero width: its character is 2, outside a span starting at 3.
    offsets = np.array([[0, 2], [3, 3], [3, 5], [5, 6]])
    assert token_mask(offsets, [(3, 6)]).tolist() == [0, 0, 1, 1]


def test_content_not_rendered_verbatim_is_an_error(chatml_tokenizer):
    upper = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | upper }}<|im_end|>\n{% endfor %}"
    with pytest.raises(ChatTemplateError, match="verbatim"):
        encode_chat(chatml_tokenizer, MULTI, chat_template=upper)


def test_slow_tokenizer_rejected():
    from transformers import ByT5Tokenizer

    with pytest.raises(ChatTemplateError, match="fast tokenizer"):
        encode_chat(ByT5Tokenizer(), MULTI, chat_template="x")


@pytest.mark.parametrize("template", ["chatml", "qwen3", "llama3"])
def test_answer_equal_to_header_words(template, chatml_tokenizer, qwen3_tokenizer, llama3_tokenizer):
    tok = {"chatml": chatml_tokenizer, "qwen3": qwen3_tokenizer, "llama3": llama3_tokenizer}[template]
    eot = probe_template(tok).end_of_turn
    msgs = [
        {"role": "user", "content": "user"},
        {"role": "assistant", "content": "assistant"},
        {"role": "user", "content": "assistant"},
        {"role": "assistant", "content": "user"},
    ]
    enc = encode_chat(tok, msgs)
    runs = supervised_runs(tok, enc)
    if template == "qwen3":  # the last turn carries the template's (empty) think block
        assert runs == ["assistant" + eot, "<think>\n\n</think>\n\nuser" + eot]
    else:
        assert runs == ["assistant" + eot, "user" + eot]


_text = st.text(alphabet=st.sampled_from(list("abcxyz ,.?!\n0123é中")), min_size=1, max_size=30).filter(
    lambda t: not t[0].isspace() and t.strip() == t.rstrip()
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(st.tuples(_text, _text), min_size=1, max_size=4),
    system=st.one_of(st.none(), _text),
)
def test_chatml_mask_is_exactly_the_assistant_turns(chatml_tokenizer, turns, system):
    msgs = [{"role": "system", "content": system}] if system else []
    for q, a in turns:
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    enc = encode_chat(chatml_tokenizer, msgs)
    # Runs of consecutive supervised tokens decode to each answer plus its end-of-turn; nothing else.
    assert supervised_runs(chatml_tokenizer, enc) == [a + "<|im_end|>\n" for _, a in turns]
