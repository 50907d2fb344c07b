"""DFlash 2's in-block convolution: the fast formulation gives the previous one's bits, forward and backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_flow.model.dflash2 import block_causal_conv


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
