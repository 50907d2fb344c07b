"""The roofline of ``bench/peer_step.py``: its analytic FLOP count of a DFlash step, checked by hand on one tiny
shape and against ``torch.utils.flop_counter.FlopCounterMode`` on a real drafter forward + backward."""

from __future__ import annotations

import pytest
import torch
from benchtools import load_bench
from torch.utils.flop_counter import FlopCounterMode

TINY = dict(hidden=4, heads=2, kv_heads=1, head_dim=2, intermediate=6, vocab=10, features=8, layers=1, block_size=2)


def test_step_flops_by_hand_on_a_tiny_shape():
    peer = load_bench("peer_step")
    # One block at anchor 2 (it sees context positions 0, 1 and its own 2 keys), 4 context tokens.
    f = peer.step_flops(TINY, [2], context_tokens=4)
    fc = 2 * 4 * 8 * 4  # context rows x features x hidden, 2 FLOPs per multiply-add
    context_kv = 2 * 4 * 4 * (2 * 1 * 2)  # keys and values: 1 KV head of 2
    qkv = 2 * 2 * 4 * (2 + 2) * 2  # 2 block tokens, 2 query heads + 1 key + 1 value head of 2
    o = 2 * 2 * (2 * 2) * 4
    mlp = 2 * 2 * 4 * 6 * 3  # gate, up, down
    attention = 2 * 2 * (2 * (2 + 2)) * 2 * 2  # (scores + values) x 2 queries x 4 keys x 2 heads x head_dim 2
    head = 2 * 1 * 4 * 10  # slot 1 only (slot 0 has no label)
    assert f["forward"] == fc + context_kv + qkv + o + mlp + attention + head == 1072
    assert f["backward"] == fc + head + 2 * (context_kv + qkv + o + mlp + attention) == 1808
    assert f["total"] == 2880
    assert f["forward_attention"] == 128 and f["forward_head"] == 80
    # Each term scales with what it should: a later anchor adds only attention.
    later = peer.step_flops(TINY, [3], context_tokens=4)
    assert later["total"] - f["total"] == 3 * (4 * 2 * 2 * 2 * 1)  # 2 queries x 1 more key, fwd + 2x bwd


def test_step_flops_equal_flop_counter_on_a_real_drafter_step():
    """A real drafter (transformers config, our layers) runs one block at anchor ``a`` in the inference layout
    (context = the ``a`` positions before it, sdpa over [context; block]), its LM head on slots 1..B-1, a loss
    and the backward; FlopCounterMode's count of what ran equals ``step_flops`` for that block."""
    peer = load_bench("peer_step")
    case = dict(peer.CASES["embedded_4x512"], batch=1, seq_len=64)
    c = peer.build_case(case, seed=3)
    model, _step = peer.make_ours(c)
    a, bsz = 21, peer.DRAFT["block_size"]
    feats = c["hidden_states"][:, :a]
    block = torch.full((1, bsz), c["mask_id"])
    block[0, 0] = c["input_ids"][0, a]
    noise = c["embed"](block)
    positions = torch.arange(a + bsz)[None]
    mapping = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: peer._flash_cpu_flop,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: peer._flash_cpu_backward_flop,
    }
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        hidden = model(positions, noise_embedding=noise, target_hidden=feats)
        logits = c["head"](hidden[:, 1:])
        forward = counter.get_total_flops()
        torch.nn.functional.cross_entropy(logits[0], c["input_ids"][0, a + 1 : a + bsz]).backward()
    total = counter.get_total_flops()
    expected = peer.step_flops(peer.case_shape(c), [a], context_tokens=a)
    assert forward == expected["forward"]
    assert total == expected["total"]
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("n", [64])
def test_matmul_peak_is_a_rate(n):
    peer = load_bench("peer_step")
    assert peer.matmul_peak(n, reps=2) > 1e6  # FLOP/s: 2 n^3 over seconds, whatever the machine
