"""Hand-written backward passes for the training step's elementwise work (fp32 RMSNorm, RoPE, the SiLU gate,
the weighted cross-entropy): each one Function whose backward reads its inputs once or twice, where autograd
differentiates a graph of several ops. Forward values are bit-equal to the library's; backward values agree
to float rounding (the tests compare both against autograd).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_silu_backward = torch.ops.aten.silu_backward
_fused_rms_norm = torch.ops.aten._fused_rms_norm


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        # F.rms_norm's own fused kernel, which also returns 1 / rms per row (kept for the backward).
        y, rstd = _fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, weight, r = ctx.saved_tensors
        d = x.shape[-1]
        # y = x * r * w: dx = r * (g w) - x * r^3 * mean(g w x); dw = sum over rows of g * x * r.
        # Both row sums are matrix-vector products over gx = g * x (one pass each, no temporaries).
        gx = (grad * x).reshape(-1, d)
        coef = (gx @ weight).view(r.shape).mul_(r.pow(3)).div_(d)
        dx = (grad * weight).mul_(r).addcmul_(x, coef, value=-1.0)
        dw = gx.t() @ r.reshape(-1) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` over the last dim, with one hand-written backward."""
    return _RMSNorm.apply(x, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (sign 1), or its transpose applied to a gradient (sign -1:
    ``g * cos + rotate_half^T(g * sin)``), without building ``rotate_half(x)``."""
    half = x.shape[-1] // 2
    out = x * cos
    if sign > 0:  # rotate_half(x) = [-x2, x1]
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1.0)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
    else:  # rotate_half^T(y) = [y2, -y1] with y = g * sin
        out[..., :half].addcmul_(x[..., half:], sin[..., half:])
        out[..., half:].addcmul_(x[..., :half], sin[..., :half], value=-1.0)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0), None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (cos / sin broadcast to ``x``; no gradient to
    them: they are RoPE tables)."""
    return _Rope.apply(x, cos, sin)


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        # aten's fused silu_backward (autograd's own for F.silu, one pass); silu(gate) is recomputed, not
        # kept from the forward (keeping one [rows, intermediate] tensor more made the step slower).
        d_gate = _silu_backward(grad * up, gate)
        return d_gate, F.silu(gate).mul_(grad)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` (the Qwen3 MLP's gate), keeping only its two inputs for the backward."""
    return _SiluMul.apply(gate, up)


class _WeightedCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, weights, gather):
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, labels[:, None]).squeeze(-1)
        ctx.save_for_backward(logits, labels, weights, lse, gather)
        loss = ((lse - picked) * weights).sum()
        if gather is None:
            return loss
        return loss, logits.gather(-1, gather)

    @staticmethod
    def backward(ctx, grad, grad_gathered=None):
        logits, labels, weights, lse, gather = ctx.saved_tensors
        scale = weights * grad
        # d/dlogits of w * (lse - logit[label]) = w * (softmax - onehot)
        d = logits.sub(lse[:, None]).exp_().mul_(scale[:, None])
        d.scatter_add_(-1, labels[:, None], -scale[:, None])
        if grad_gathered is not None:  # the gathered logits' gradient, into the same tensor
            d.scatter_add_(-1, gather, grad_gathered)
        return d, None, None, None


def weighted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                           gather: torch.Tensor | None = None):
    """``(F.cross_entropy(logits, labels, reduction="none") * weights).sum()`` for fp32 ``logits`` ``[n, V]``:
    no log-softmax kept, the gradient written into one tensor. ``gather`` (indices ``[n, k]``): also returns
    ``logits.gather(-1, gather)`` (DFlash 2's candidates), whose gradient lands in the same tensor."""
    return _WeightedCE.apply(logits, labels, weights, gather)
