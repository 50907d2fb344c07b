"""DFlash 2's in-block convolution (``dflash2`` module docstring): ``block_causal_conv`` and the
``GroupedDynamicConv`` module around each sublayer."""

from __future__ import annotations

import torch
from torch import nn


class _BlockCausalConv(torch.autograd.Function):
    """``block_causal_conv`` on ``xs`` ``[b, N, B, G, gs]``, ``dyn`` ``[b, N, B, K, G, 1]``, ``w`` ``[K, G, gs]``.

    Forward: tap 0 is ``addcmul(w[0] * x, dyn[0], x)``; tap ``o`` adds ``w[o] * x[t - o]`` and then
    ``dyn[o] * x[t - o]`` to slots ``t >= o`` in place (slots before ``o`` read the block's zeros, which add
    exactly nothing): the same roundings as z-lab's zero-initialised, zero-padded sum, without the zeros,
    the padding and the autograd bookkeeping of the in-place writes. Backward: the gradients autograd gives
    that formulation, bit for bit (``tests/model/test_dflash2_step.py``): each ``grad * x`` product once for
    both its reductions (the kernel's over the zero-padded slots, the correction's over the group), and the
    input's gradient summed in autograd's order (the shifted taps, then the correction, then the base).
    """

    @staticmethod
    def forward(ctx, xs, dyn, w):
        out = (w[0] * xs).addcmul_(dyn[:, :, :, 0], xs)
        for o in range(1, min(w.shape[0], xs.shape[2])):
            prev = xs[:, :, :-o]
            out[:, :, o:].add_(w[o] * prev).addcmul_(dyn[:, :, o:, o], prev)
        ctx.save_for_backward(xs, dyn, w)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # Written into few buffers (each fresh one costs its page faults): ``scratch`` holds one product
        # at a time.
        xs, dyn, w = ctx.saved_tensors
        grad_dyn, grad_w = torch.empty_like(dyn, memory_format=torch.contiguous_format), torch.empty_like(w)
        scratch = grad * xs
        grad_dyn[:, :, :, 0] = scratch.sum(-1, keepdim=True)
        grad_w[0] = scratch.sum((0, 1, 2))
        grad_x = None
        for o in range(1, w.shape[0]):
            if o >= xs.shape[2]:  # the tap never reaches into the block
                grad_dyn[:, :, :, o] = 0
                grad_w[o] = 0
                continue
            prev, tail = xs[:, :, :-o], grad[:, :, o:]
            scratch[:, :, :o] = 0  # the kernel's gradient sums over the padded slots, as autograd's does
            torch.mul(tail, prev, out=scratch[:, :, o:])
            grad_w[o] = scratch.sum((0, 1, 2))
            grad_dyn[:, :, :o, o] = 0
            grad_dyn[:, :, o:, o] = scratch[:, :, o:].sum(-1, keepdim=True)
            shifted = torch.empty_like(xs)
            shifted[:, :, -o:] = 0
            torch.mul(tail, dyn[:, :, o:, o], out=shifted[:, :, :-o]).add_(torch.mul(tail, w[o], out=scratch[:, :, o:]))
            grad_x = shifted if grad_x is None else grad_x.add_(shifted)
        if grad_x is None:
            return torch.mul(grad, dyn[:, :, :, 0]).add_(torch.mul(grad, w[0], out=scratch)), grad_dyn, grad_w
        grad_x.add_(torch.mul(grad, dyn[:, :, :, 0], out=scratch))
        return grad_x.add_(torch.mul(grad, w[0], out=scratch)), grad_dyn, grad_w


def block_causal_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block: int
) -> torch.Tensor:
    """``y[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o]`` along each block's slots.

    ``x`` ``[b, T, H]`` holds ``T / block`` blocks end to end; tap ``o`` reads slot ``t - o`` of the
    same block (zero before the block's first slot), so blocks laid side by side (training) give what
    each block alone gives (inference). ``dynamic`` ``[b, T, K, G]`` is shared by the ``group_size``
    channels of a group; ``base`` ``[K, H]``. Accumulated tap by tap, base then correction (a multiply
    and an add each): z-lab's rounding, so our drafter's outputs are bit-equal to its reference model's
    (one product of the summed kernel is not); ``_BlockCausalConv`` computes it.
    """
    b, t, h = x.shape
    groups = h // group_size
    taps = base.shape[0]
    xs = x.view(b, t // block, block, groups, group_size)
    dyn = dynamic.reshape(b, t // block, block, taps, groups, 1)
    w = base.view(taps, groups, group_size).to(x.dtype)
    return _BlockCausalConv.apply(xs, dyn, w).view(b, t, h)


class GroupedDynamicConv(nn.Module):
    """The convolution around one sublayer: ``prepare`` before it, ``finish`` after it. Both halves'
    corrections are predicted once, from the sublayer's (normed) input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide the hidden size {hidden_size}")
        self.kernel_size = int(kernel_size)
        self.group_size = int(group_size)
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: unit self-tap, no correction (a fresh DFlash 2 layer is a DFlash layer)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return block_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block), dynamic[
            ..., 1, :, :
        ]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
        return block_causal_conv(x, dynamic, self.base_kernel[1], self.group_size, block)
