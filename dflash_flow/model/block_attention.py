"""The training layout's attention on CPU: block queries over their group's own blocks and context slice,
one flash-kernel call per group on a view of one key buffer (``_BlockAttention``); ``BlockLayout``
(``drafter_layers``) says which queries form a group and which keys they see."""

from __future__ import annotations

import torch

_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Keys:
    """Keys or values in the ``BlockLayout`` key layout: [scratch | context], with one group's own
    keys written just before its context slice while that group is computed (then put back: the
    positions they covered are kept aside first). ``buf``: a buffer the forward filled (the backward
    reuses it rather than copying the context in again)."""

    def __init__(self, ctx: torch.Tensor | None, scratch: int, buf: torch.Tensor | None = None) -> None:
        self.scratch = scratch
        if buf is None:
            b, kv, s, d = ctx.shape
            buf = ctx.new_empty(b, scratch + s, kv, d).transpose(1, 2)  # memory as the projections'
            buf.narrow(2, scratch, s).copy_(ctx)
        self.buf = buf
        self._kept: tuple[int, torch.Tensor] | None = None

    @property
    def context(self) -> torch.Tensor:
        return self.buf.narrow(2, self.scratch, self.buf.shape[2] - self.scratch)

    def group(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        n = own.shape[2]
        start = self.scratch + lo - n
        if lo > 0:  # the own keys cover context positions [lo - n, lo): keep them to put back
            first = max(start, self.scratch)
            self._kept = (first, self.buf.narrow(2, first, self.scratch + lo - first).clone())
        self.buf.narrow(2, start, n).copy_(own)
        return self.buf.narrow(2, start, n + hi - lo)

    def restore(self) -> None:
        if self._kept is not None:
            first, kept = self._kept
            self.buf.narrow(2, first, kept.shape[2]).copy_(kept)
            self._kept = None


class _BlockAttention(torch.autograd.Function):
    """Attention of block queries over [their group's own blocks; their group's context slice], one CPU
    flash kernel call per group on a view: no key is copied per group, no hidden range is scored.

    Our own code: no library kernel attends to "a slice of one key tensor plus a block of another". The
    context keys sit once in a buffer with scratch slots before them (``_Keys``); each group writes its
    own blocks' keys next to its context slice, calls the kernel on that contiguous range, and puts the
    context back. The backward reuses the forward's buffers and redoes the writes around the kernel's backward.
    Shapes: q [b, h, Q, d]; ctx_k, ctx_v [b, kv, S, d]; own_k, own_v [b, kv, N*B, d].
    """

    @staticmethod
    def _groups(layout, keys, values, own_k, own_v, kernel):
        """``kernel(group index, q, k, v)`` for each group, with its keys in place; yields its results."""
        for g, (q0, q1, lo, hi) in enumerate(layout.groups):
            k0, k1 = layout.own_keys(q0, q1)
            own = k1 - k0
            result = kernel(
                g,
                q0,
                q1,
                keys.group(own_k.narrow(2, k0, own), lo, hi),
                values.group(own_v.narrow(2, k0, own), lo, hi),
            )
            keys.restore()
            values.restore()
            yield (own, lo, hi), result

    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, own_k, own_v, layout, scale):
        def kernel(g, q0, q1, k, v):
            qg = q.narrow(2, q0, q1 - q0)
            return _flash_cpu(qg, k, v, 0.0, False, attn_mask=layout.group_masks[g], scale=scale)

        keys, values = _Keys(ctx_k, layout.scratch), _Keys(ctx_v, layout.scratch)
        results = [r for _g, r in _BlockAttention._groups(layout, keys, values, own_k, own_v, kernel)]
        # Kept in the kernel's [b, Q, h, d] memory order, so o_proj reads the result without a copy.
        out = torch.cat([o.transpose(1, 2) for o, _lse in results], dim=1).transpose(1, 2)
        lse = torch.cat([lse for _o, lse in results], dim=2)
        # The key buffers hold the context again; saved instead of ctx_k / ctx_v (the backward reads them
        # as they are, no second copy of the context).
        ctx.save_for_backward(q, keys.buf, values.buf, own_k, own_v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, key_buf, value_buf, own_k, own_v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        keys, values = _Keys(None, layout.scratch, key_buf), _Keys(None, layout.scratch, value_buf)

        def kernel(g, q0, q1, k, v):
            n = q1 - q0
            return _flash_cpu_backward(
                grad_out.narrow(2, q0, n),
                q.narrow(2, q0, n),
                k,
                v,
                out.narrow(2, q0, n),
                lse.narrow(2, q0, n),
                0.0,
                False,
                attn_mask=layout.group_masks[g],
                scale=scale,
            )

        dq, dk_own, dv_own = [], [], []
        ctx_shape = keys.context.transpose(1, 2).shape  # [b, S, kv, d]
        dk_ctx = key_buf.new_zeros(ctx_shape).transpose(1, 2)
        dv_ctx = value_buf.new_zeros(ctx_shape).transpose(1, 2)
        for (own, lo, hi), (gq, gk, gv) in _BlockAttention._groups(layout, keys, values, own_k, own_v, kernel):
            dq.append(gq.transpose(1, 2))
            dk_own.append(gk.narrow(2, 0, own).transpose(1, 2))
            dv_own.append(gv.narrow(2, 0, own).transpose(1, 2))
            if hi > lo:
                dk_ctx.narrow(2, lo, hi - lo).add_(gk.narrow(2, own, hi - lo))
                dv_ctx.narrow(2, lo, hi - lo).add_(gv.narrow(2, own, hi - lo))

        def join(parts):
            return torch.cat(parts, dim=1).transpose(1, 2)

        return join(dq), dk_ctx, dv_ctx, join(dk_own), join(dv_own), None, None


def block_attention(q, ctx_k, ctx_v, own_k, own_v, layout, scale):
    return _BlockAttention.apply(q, ctx_k, ctx_v, own_k, own_v, layout, scale)
