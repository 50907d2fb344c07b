"""DFlash 2's training step, made cheaper without changing its results: the in-block convolution gives the
zero-padded formulation's bits forward and backward, the two-stage top-k gives torch.topk's candidates,
and the factored first layer gives the unfactored loss and gradients (to float rounding)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from model_testlib import MASK_ID, VOCAB, randomize, target_features
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_flow.model.blockplan import PrefixPrior
from dflash_flow.model.dflash2 import DFlash2Drafter, block_causal_conv, make_dflash2_config, top_candidates
from dflash_flow.model.objective import dflash_loss


def zero_padded_conv(x, dynamic, base, group_size, block):
    """The previous formulation (z-lab's): zeros, then per tap a zero-padded shift, base, correction."""
    b, t, h = x.shape
    groups, taps = h // group_size, base.shape[0]
    xs = x.view(b, t // block, block, groups, group_size)
    dyn = dynamic.reshape(b, t // block, block, taps, groups, 1)
    out = torch.zeros_like(xs)
    for o in range(min(taps, block)):
        shifted = xs if o == 0 else F.pad(xs[:, :, :-o], (0, 0, 0, 0, o, 0))
        out = torch.addcmul(out + base[o].view(groups, group_size).to(x.dtype) * shifted, dyn[:, :, :, o], shifted)
    return out.view(b, t, h)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _case(b, n, block, hidden, taps, group, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n * block, hidden, generator=g).to(dtype).requires_grad_()
    # The layer's layout: both halves' corrections come from one projection; this conv reads the first.
    proj = torch.randn(b, n * block, 2 * taps * (hidden // group), generator=g).to(dtype).requires_grad_()
    kernel = torch.randn(2, taps, hidden, generator=g).requires_grad_()
    grad = torch.randn(b, n * block, hidden, generator=g).to(dtype)
    return x, proj, kernel, grad


@pytest.mark.parametrize(
    "b,n,block,hidden,taps,group,dtype",
    [
        (4, 16, 8, 128, 2, 16, torch.float32),  # the embedded default's shapes
        (2, 3, 5, 16, 3, 4, torch.float32),  # three taps: the input's gradient sums four terms
        (2, 3, 2, 16, 3, 4, torch.float32),  # more taps than slots
        (1, 1, 1, 16, 2, 8, torch.float32),  # a one-slot block (a shortened inference block)
        (2, 4, 8, 64, 2, 16, torch.bfloat16),
    ],
)
def test_conv_gives_the_zero_padded_formulations_bits_and_gradients(b, n, block, hidden, taps, group, dtype):
    x, proj, kernel, grad = _case(b, n, block, hidden, taps, group, dtype)
    results = []
    for conv in (block_causal_conv, zero_padded_conv):
        dyn = proj.view(b, n * block, 2, taps, hidden // group)[..., 0, :, :]
        y = conv(x, dyn, kernel[0], group, block)
        results.append((y, *torch.autograd.grad(y, (x, proj, kernel), grad)))
    for ours, reference in zip(*results, strict=True):
        assert torch.equal(ours, reference)


def test_conv_allocates_no_zeros_and_pads_nothing():
    x, proj, kernel, _grad = _case(2, 4, 8, 64, 2, 16, torch.float32)
    dyn = proj.view(2, 32, 2, 2, 4)[..., 0, :, :]
    with torch.no_grad(), _Ops() as ops:
        block_causal_conv(x, dyn, kernel[0], 16, 8)
    assert not {"zeros_like", "fill_", "zero_", "constant_pad_nd"} & {name.split(".")[0] for name in ops.names}
    assert sum(name.split(".")[0] in {"mul", "add", "add_", "addcmul", "addcmul_"} for name in ops.names) == 5


@pytest.mark.parametrize("rows,vocab,k", [(300, 768, 16), (40, 96, 6), (40, 100, 6), (20, 64, 8)])
def test_top_candidates_are_torch_topk(rows, vocab, k):
    # 96 and 768 take the two-stage path; 100 (not a multiple of 8) and 64 (8k too close to V) fall back.
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=g).requires_grad_()
    weights = torch.randn(rows, k, generator=g)
    values, indices = top_candidates(logits, k)
    (grad,) = torch.autograd.grad((values * weights).sum(), logits)
    ref_values, ref_indices = torch.topk(logits, k, dim=-1)
    (ref_grad,) = torch.autograd.grad((ref_values * weights).sum(), logits)
    assert torch.equal(values, ref_values) and torch.equal(indices, ref_indices) and torch.equal(grad, ref_grad)


def _dflash2(target, kernel_size=2):
    torch.manual_seed(3)
    drafter = DFlash2Drafter(
        make_dflash2_config(
            target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID, conv_kernel_size=kernel_size,
            selector_rank=8, selector_top_k=6,
        )
    )
    randomize(drafter, 7)
    g = torch.Generator().manual_seed(8)
    with torch.no_grad():  # convolutions near the identity, a selector away from its zero start
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel[:, 0] += 1.0
                conv.kernel_projection.weight.copy_(0.2 * torch.randn(conv.kernel_projection.weight.shape, generator=g))
        drafter.candidate_selector.successor_codebook.copy_(torch.randn(VOCAB, 8, generator=g))
    return drafter


@pytest.mark.parametrize("kernel_size", [2, 3])
def test_factored_first_layer_gives_the_unfactored_loss_and_gradients(target, kernel_size):
    drafter = _dflash2(target, kernel_size)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(1, VOCAB - 1, (2, 48), generator=g)
    lm = torch.ones_like(ids)
    lm[:, :8] = 0
    kw = dict(
        embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head, input_ids=ids, loss_mask=lm,
        hidden_states=target_features(target, ids, drafter.target_layer_ids), num_anchors=10,
    )
    rows = []
    hook = drafter.layers[0].self_attn.q_proj.register_forward_hook(lambda m, args, out: rows.append(args[0].shape))
    results = []
    # A variable prefix of length 1 is the DFlash plan (same anchors, same labels), never factored.
    for prior in (None, PrefixPrior(min_length=1, max_length=1)):
        rows.clear()
        drafter.zero_grad()
        out = dflash_loss(drafter, generator=torch.Generator().manual_seed(5), prefix_prior=prior, **kw)
        out.loss.backward()
        results.append((out.loss.detach(), out.metrics(), [p.grad.clone() for p in drafter.parameters()], list(rows)))
    hook.remove()
    (loss, metrics, grads, factored_rows), (ref_loss, ref_metrics, ref_grads, full_rows) = results
    blocks = full_rows[0][1] // 8
    # The first layer projects K rows per block and the one shared row, not all 8 slots.
    assert sorted(tuple(r) for r in factored_rows) == [(2, blocks, kernel_size, 64), (64,)]
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    for name in ("dflash_loss", "selector_loss", "accuracy", "selector_accuracy", "acceptance_length"):
        assert metrics[name] == pytest.approx(ref_metrics[name], rel=1e-6, abs=1e-6), name
    # The first layer's gradients sum the shared row's in another order: equal to float rounding.
    for ours, ref in zip(grads, ref_grads, strict=True):
        assert (ours - ref).abs().max() <= 1e-5 * ref.abs().max()
