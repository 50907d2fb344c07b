"""``walk.walk_inputs``: the batched walk's target forwards give each conversation's features bit for bit as
``walk.walk_input`` (its one-row call) does: rows of other lengths padded together, rows of 1-3 tokens, a stop
token inside a reply, the deepest feature layer the last one (the final norm's) or a middle one."""

from __future__ import annotations

import pytest
import torch
from model_testlib import TARGET_LAYERS, VOCAB, build_target

from dflash_flow.model.walk import WALK_INPUT_ROWS, walk_input, walk_inputs

pytestmark = pytest.mark.usefixtures("one_thread")

STOP = VOCAB - 2


def _conversations(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = [([5], [7]), ([3, 4], [9])]  # 1 and 2 tokens wide: the one-row call
    for _ in range(n):
        prompt = torch.randint(1, VOCAB - 3, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g)
        reply = torch.randint(1, VOCAB - 3, (int(torch.randint(1, 50, (1,), generator=g)),), generator=g)
        if int(torch.randint(0, 3, (1,), generator=g)) == 0:
            reply[len(reply) // 2] = STOP
        out.append((prompt.tolist(), reply.tolist()))
    return out


@pytest.mark.parametrize("layer_ids", [[1, 4], [0, TARGET_LAYERS - 1]])
def test_walk_inputs_equal_each_conversation_alone(layer_ids):
    target = build_target(seed=2)
    convs = _conversations(2 * WALK_INPUT_ROWS + 3, seed=len(layer_ids) + layer_ids[-1])
    together = walk_inputs(target, convs, longest=24, layer_ids=layer_ids, stop_token_ids=[STOP])
    assert len(together) == len(convs)
    for (prompt, reply), got in zip(convs, together, strict=True):
        alone = walk_input(target, prompt, reply, longest=24, layer_ids=layer_ids, stop_token_ids=[STOP])
        assert (got.n_in, got.reply_len, got.stopped) == (alone.n_in, alone.reply_len, alone.stopped)
        assert torch.equal(got.seq, alone.seq)
        assert got.feats.shape == alone.feats.shape
        assert torch.equal(got.feats, alone.feats), f"features differ for a conversation of {len(prompt)}+{len(reply)}"


def test_walk_inputs_need_a_prompt_and_a_reply():
    with pytest.raises(ValueError, match="non-empty prompt and reply"):
        walk_inputs(build_target(seed=2), [([1, 2], [3]), ([4], [])], longest=8, layer_ids=[1])


def test_a_target_that_does_not_batch_is_read_one_conversation_a_call():
    """Eager attention (not ``batched.batchable``): each conversation alone, still no deeper than needed, the same
    features as the full one-row call."""
    target = build_target(seed=4)
    target.config._attn_implementation = "eager"
    convs = _conversations(5, seed=9)
    together = walk_inputs(target, convs, longest=16, layer_ids=[2, 3], stop_token_ids=[STOP])
    for (prompt, reply), got in zip(convs, together, strict=True):
        alone = walk_input(target, prompt, reply, longest=16, layer_ids=[2, 3], stop_token_ids=[STOP])
        assert torch.equal(got.feats, alone.feats)
