"""The hand-written backward passes (model.fused) against autograd through the library ops they replace,
and the RoPE table lookup against the rotary module's own forward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import rotate_half

from dflash_flow.model import fused
from dflash_flow.model.drafter_layers import RotaryEmbedding


def _grads(fn, *inputs):
    inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)) if out.dim() else torch.tensor(1.3)
    out.backward(g)
    return out.detach(), [t.grad for t in inputs if t.requires_grad]


def _same(ours, ref, atol=1e-6):
    out_a, grads_a = ours
    out_b, grads_b = ref
    torch.testing.assert_close(out_a, out_b, atol=atol, rtol=1e-5)
    assert len(grads_a) == len(grads_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("shape", [(3, 17, 128), (2, 9, 4, 32)])
def test_rms_norm_equals_autograd_through_f_rms_norm(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g, requires_grad=True)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).requires_grad_()
    ours = _grads(lambda a, b: fused.rms_norm(a, b, 1e-6), x, w)
    ref = _grads(lambda a, b: F.rms_norm(a, b.shape, b, 1e-6), x, w)
    assert torch.equal(ours[0], ref[0])  # the forward is the library kernel itself
    _same(ours, ref, atol=1e-5)  # the weight's gradient sums 51-153 rows


def test_rope_equals_transformers_arithmetic_and_its_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 11, 64, generator=g, requires_grad=True)
    angles = torch.rand(2, 1, 11, 32, generator=g) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    _same(_grads(lambda a: fused.rope(a, cos, sin), x), _grads(lambda a: a * cos + rotate_half(a) * sin, x))


def test_silu_mul_equals_autograd():
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(5, 7, 48, generator=g, requires_grad=True)
    up = torch.randn(5, 7, 48, generator=g, requires_grad=True)
    ours = _grads(fused.silu_mul, gate, up)
    ref = _grads(lambda a, b: F.silu(a) * b, gate, up)
    assert torch.equal(ours[0], ref[0])
    _same(ours, ref)


def test_weighted_cross_entropy_equals_f_cross_entropy():
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(40, 97, generator=g)).requires_grad_()
    labels = torch.randint(0, 97, (40,), generator=g)
    weights = torch.rand(40, generator=g) * (torch.rand(40, generator=g) > 0.3)
    ours = _grads(lambda a: fused.weighted_cross_entropy(a, labels, weights), logits)
    ref = _grads(lambda a: (F.cross_entropy(a, labels, reduction="none") * weights).sum(), logits)
    _same(ours, ref, atol=1e-5)


def test_weighted_cross_entropy_with_gather_equals_autograd_of_both():
    # DFlash 2's head: the loss and the candidates' logits from one Function, one gradient tensor.
    g = torch.Generator().manual_seed(4)
    logits = (3 * torch.randn(40, 96, generator=g)).requires_grad_()
    labels = torch.randint(0, 96, (40,), generator=g)
    weights = torch.rand(40, generator=g) * (torch.rand(40, generator=g) > 0.3)
    index = torch.argsort(torch.rand(40, 96, generator=g), dim=-1)[:, :6]
    mix = torch.randn(40, 6, generator=g)

    def ours(a):
        loss, gathered = fused.weighted_cross_entropy(a, labels, weights, gather=index)
        return loss + (gathered * mix).sum()

    def ref(a):
        return (F.cross_entropy(a, labels, reduction="none") * weights).sum() + (a.gather(-1, index) * mix).sum()

    _same(_grads(ours, logits), _grads(ref, logits), atol=1e-5)
    loss, gathered = fused.weighted_cross_entropy(logits, labels, weights, gather=index)
    assert torch.equal(gathered, logits.gather(-1, index))


def test_rope_table_lookup_is_bit_equal_to_forward_and_grows():
    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=8192)
    rope = RotaryEmbedding(config)
    like = torch.zeros(1)
    positions = torch.tensor([[0, 5, 1023, 1024, 3000], [7, 7, 2, 4095, 1]])
    cos, sin = rope.at(positions, like, limit=4096)  # past the first table: it grows
    want_cos, want_sin = rope(like, positions)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert rope.table(10, like)[0].shape[0] >= 4096
    rope.to(torch.float64)  # a move drops the tables (remade from the frequencies on the new device)
    assert rope._tables == {}
