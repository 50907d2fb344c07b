"""The project's byte-level BPE: round trips, special tokens, ChatML template, offline save/load."""

from __future__ import annotations

import json

import pytest

from dflash_flow.data.chat import stop_token_ids
from dflash_flow.embedded.train_target import (
    ENDOFTEXT,
    IM_END,
    IM_START,
    PAD,
    build_default_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return build_default_tokenizer()


def test_training_is_deterministic(tok):
    again = build_default_tokenizer()
    assert json.loads(tok.backend_tokenizer.to_str()) == json.loads(again.backend_tokenizer.to_str())


def test_vocab_and_special_tokens(tok):
    assert 512 <= len(tok) <= 1024
    assert tok.convert_tokens_to_ids([PAD, ENDOFTEXT, IM_START, IM_END]) == [0, 1, 2, 3]
    assert tok.eos_token == IM_END and tok.pad_token == PAD
    assert tok.pad_token_id != tok.eos_token_id
    assert stop_token_ids(tok) == [1, 3]
    # special tokens are atomic in text
    assert tok(IM_START + "user\nhi" + IM_END, add_special_tokens=False)["input_ids"][0] == 2
    assert tok(IM_START + "user\nhi" + IM_END, add_special_tokens=False)["input_ids"][-1] == 3


@pytest.mark.parametrize("text", [
    "Count from 7 to 23 in steps of 2.",
    "  leading spaces, trailing spaces  \n\n\ttabs\r\nand CRLF",
    "unicode: héllo wörld, 日本語, emoji 🙂🚀, math ∑ x² ≤ 10",
    "code:\n```python\ndef f(x):\n    return x ** 2  # comment\n```",
    "numbers 0123456789 1000000 3.14159 -42",
    "",
])
def test_round_trip(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_digits_are_single_tokens(tok):
    ids = tok("12345", add_special_tokens=False)["input_ids"]
    assert [tok.decode([i]) for i in ids] == ["1", "2", "3", "4", "5"]


def test_chat_template_renders_chatml(tok):
    msgs = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Count from 1 to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
    ]
    full = tok.apply_chat_template(msgs, tokenize=False)
    assert full == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCount from 1 to 3.<|im_end|>\n"
        "<|im_start|>assistant\n1, 2, 3.<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nCount from 1 to 3.<|im_end|>\n<|im_start|>assistant\n"
    )
    # no system prompt is injected when the conversation has none
    assert tok.apply_chat_template(msgs[1:2], tokenize=False).startswith("<|im_start|>user\n")
    # the prompt renders as a token prefix of the full conversation (what regeneration relies on)
    p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    f_ids = tok(full, add_special_tokens=False)["input_ids"]
    assert f_ids[: len(p_ids)] == p_ids


def test_save_load_offline(tok, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    save_tokenizer(tok, tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok")
    msgs = [{"role": "user", "content": "Spell the word \"garden\" letter by letter."}]
    assert loaded.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    text = "Sort these numbers from smallest to largest: 34, 7, 91."
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.pad_token_id == tok.pad_token_id and loaded.eos_token_id == tok.eos_token_id
    assert loaded.padding_side == "left"


def test_shipped_tokenizer_matches_the_recipe(tok, target_dir):
    # The asset must be what the project's own script produces (no hand-edited or downloaded tokenizer).
    shipped = load_tokenizer(target_dir)
    assert shipped.get_vocab() == tok.get_vocab()
    assert shipped.chat_template == tok.chat_template


def test_small_custom_vocab():
    t = train_tokenizer(["abc abc abd " * 50, "hello world " * 50], vocab_size=300)
    assert len(t) <= 300
    assert t.decode(t("abc hello", add_special_tokens=False)["input_ids"]) == "abc hello"
