"""Batched in-process regeneration (issue 39.1): replies decoded together are the replies decoded one at a
time, byte for byte, on the shipped target and on tiny presets; every assistant turn in order; resume."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_flow.data.chat import stop_token_ids
from dflash_flow.embedded.corpus import make_split
from dflash_flow.embedded.regenerate import regenerate
from dflash_flow.model.generation import greedy_continuations
from dflash_flow.model.slot_decoder import BLOCK, SlotDecoder, _block_attention


def greedy_batched(model, prompts, *, max_new_tokens: int, stop_ids=None, slots: int = 16) -> list[tuple[list[int], str]]:
    """``greedy_continuations``' result for ``prompts`` through ``SlotDecoder`` (``slots`` rows at once, continuous)."""
    dec = SlotDecoder(model, slots=slots, max_new_tokens=max_new_tokens, stop_ids=stop_ids or ())
    out: dict[int, tuple[list[int], str]] = {}
    todo = list(enumerate(prompts))[::-1]
    while todo or dec.busy:
        while todo and dec.free:
            i, ids = todo.pop()
            dec.add(i, ids)
        for i, tokens, reason in dec.step():
            out[i] = (tokens, reason)
    return [out[i] for i in range(len(prompts))]


def _prompt_ids(tok, n: int, seed: int) -> list[list[int]]:
    _, evals = make_split(0, n, seed=seed)
    texts = [tok.apply_chat_template(ex.conversations(with_answer=False), tokenize=False, add_generation_prompt=True)
             for ex in evals]
    return tok(texts, add_special_tokens=False)["input_ids"]


def test_block_attention_rows_are_their_own_whatever_the_neighbours():
    """The kernel itself: a row alone (its keys only) and the same row beside longer rows (more blocks,
    masked keys past its own) give the same bits; and it is attention (close to SDPA)."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, d = 4, 2, 32
    lengths = [1, 5, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 7, 7 * BLOCK + 2]
    blocks = -(-max(lengths) // BLOCK)
    q = torch.randn(len(lengths), heads, 1, d, generator=g)
    k = torch.randn(len(lengths), kv_heads, blocks, BLOCK, d, generator=g)
    v = torch.randn(len(lengths), kv_heads, blocks, BLOCK, d, generator=g)
    n = torch.tensor(lengths)
    keep = (torch.arange(blocks * BLOCK)[None] < n[:, None]).view(len(lengths), 1, blocks, 1, BLOCK)
    together = _block_attention(q, k, v, keep, d**-0.5)
    for r, length in enumerate(lengths):
        own = -(-length // BLOCK)
        alone = _block_attention(q[r : r + 1], k[r : r + 1, :, :own], v[r : r + 1, :, :own], keep[r : r + 1, :, :own],
                                 d**-0.5)
        assert torch.equal(alone[0], together[r]), f"row of {length} keys changed by its neighbours"
        keys = k[r].reshape(kv_heads, -1, d)[:, :length].repeat_interleave(heads // kv_heads, 0)
        vals = v[r].reshape(kv_heads, -1, d)[:, :length].repeat_interleave(heads // kv_heads, 0)
        ref = torch.nn.functional.scaled_dot_product_attention(q[r], keys, vals)[:, 0]
        torch.testing.assert_close(together[r], ref, rtol=1e-5, atol=1e-5)


def _same_one_at_a_time_and_batched(model, prompts, stops, max_new, slot_counts):
    one = [greedy_batched(model, [p], max_new_tokens=max_new, stop_ids=stops, slots=1)[0] for p in prompts]
    for slots in slot_counts:
        assert greedy_batched(model, prompts, max_new_tokens=max_new, stop_ids=stops, slots=slots) == one, slots
    return one


def test_shipped_target_batched_equals_one_at_a_time(target):
    """Prompts of different lengths, replies ending on a stop token at different steps and at max_new_tokens:
    every slot count gives each prompt's one-at-a-time reply; which is also transformers' generate's here."""
    model, tok = target
    prompts = [_prompt_ids(tok, 16, seed=5)[i] for i in (0, 3, 8, 9, 15)]
    assert len({len(p) for p in prompts}) > 2
    stops = stop_token_ids(tok)
    one = _same_one_at_a_time_and_batched(model, prompts, stops, 60, (2, 5))
    reasons = [r for _, r in one]
    stop_steps = {len(t) for t, r in one if r == "stop"}
    assert "length" in reasons and len(stop_steps) >= 2, one  # EOS at different steps, and the length limit
    for p, got in list(zip(prompts, one, strict=True))[:2]:
        assert got == greedy_continuations(model, [p], max_new_tokens=60, stop_ids=stops)[0]


@pytest.mark.parametrize("preset", ["tiny-qwen3-8l", "tiny-llama-8l"])
def test_tiny_presets_batched_equal_one_at_a_time(preset):
    from dflash_flow.model.target import load_target

    torch.set_num_threads(1)
    model = load_target(preset, dtype=torch.float32)
    assert SlotDecoder.supports(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 500, (n,), generator=g).tolist() for n in (3, 9, 40, 17, 70, 1, 33)]
    free = [greedy_batched(model, [p], max_new_tokens=30, slots=1)[0][0] for p in prompts]
    # stop tokens the replies meet at different steps (a random model's favourite tokens)
    stops = sorted({free[0][4], free[2][12]})
    one = _same_one_at_a_time_and_batched(model, prompts, stops, 30, (2, 4, 7))
    assert {r for _, r in one} == {"stop", "length"} and len({len(t) for t, r in one if r == "stop"}) >= 2


def _records(tok) -> list[dict]:
    """Single-turn prompts of different lengths and multi-turn conversations (made-up replies to replace)."""
    _, evals = make_split(0, 8, seed=21)
    recs = [{"id": f"s{i}", "conversations": ex.conversations()} for i, ex in enumerate(evals[:4])]
    for i in range(2):
        a, b, c = evals[4 + 2 * i], evals[5 + 2 * i], evals[(6 + i) % 8]
        recs.insert(1 + 2 * i, {"id": f"m{i}", "conversations": [
            {"role": "user", "content": a.prompt}, {"role": "assistant", "content": "made up"},
            {"role": "user", "content": b.prompt}, {"role": "assistant", "content": "made up too"},
            {"role": "user", "content": c.prompt}]})
    return recs


def test_regenerate_file_is_the_same_for_every_batch_size_and_turns_follow_the_targets_replies(target, tmp_path):
    model, tok = target
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _records(tok)))
    files = {}
    MAX_NEW = 32  # noqa: N806
    for bs in (1, 3, 8):
        out = tmp_path / f"b{bs}.jsonl"
        stats = regenerate(src, None, out, batch_size=bs, max_new_tokens=MAX_NEW, model=model, tokenizer=tok)
        assert stats.generated == 6 and stats.replies == 4 + 2 * 3
        files[bs] = out.read_bytes()
    assert files[1] == files[3] == files[8]
    recs = [json.loads(x) for x in files[1].decode().splitlines()]
    multi = [r for r in recs if r["id"].startswith("m")]
    for r in multi:
        roles = [t["role"] for t in r["conversations"]]
        assert roles == ["user", "assistant"] * 3 and len(r["finish_reasons"]) == 3
        assert "made up" not in {t["content"] for t in r["conversations"]}
    # turn 2 was generated on the conversation with the target's own first reply: the same reply comes back
    # from a one-record file holding that conversation so far
    r = multi[0]
    part = tmp_path / "part.jsonl"
    part.write_text(json.dumps({"id": "p", "conversations": r["conversations"][:3]}) + "\n")
    regenerate(part, None, tmp_path / "part.out.jsonl", batch_size=1, max_new_tokens=MAX_NEW, model=model, tokenizer=tok)
    again = json.loads((tmp_path / "part.out.jsonl").read_text())
    assert again["conversations"][3] == r["conversations"][3]
    # resumed after the first batch of 3 (a kill after it was written): the same file
    resumed = tmp_path / "resumed.jsonl"
    resumed.write_bytes(b"".join(files[3].splitlines(keepends=True)[:3]))
    stats = regenerate(src, None, resumed, batch_size=4, max_new_tokens=MAX_NEW, model=model, tokenizer=tok)
    assert stats.skipped == 3 and stats.generated == 3 and resumed.read_bytes() == files[1]
