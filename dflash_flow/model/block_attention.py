"""The training layout's attention on CPU, in one of two forms (``block_layouts`` picks per layout:
``layout.split``). ``_SplitAttention``: each group's queries over its context slice, one flash kernel call
per group on a view of the context keys, and every block over its own keys by two batched matmuls, joined by
log-sum-exp. ``_BlockAttention``: one call per group over the group's own blocks and context slice in one
key buffer. ``BlockLayout`` (``drafter_layers``) says which queries form a group and which keys they see.
The split form pays where the context slices are long against the own keys (``layout.split_pays``).
"""

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
    flash kernel call per group on a view: the context keys sit once in a buffer with scratch slots before
    them (``_Keys``); each group writes its own keys next to its context slice, calls the kernel on that
    range, and puts the context back (the backward redoes the writes around the kernel's backward).
    Shapes: q [b, h, Q, d]; ctx_k, ctx_v [b, kv, S, d]; own_k, own_v [b, kv, N*B, d].
    """

    @staticmethod
    def _groups(layout, keys, values, own_k, own_v, kernel):
        """``kernel(group index, q, k, v)`` for each group, with its keys in place; yields its results."""
        for g, (q0, q1, lo, hi) in enumerate(layout.groups):
            k0, k1 = layout.own_keys(q0, q1)
            own = k1 - k0
            result = kernel(g, q0, q1, keys.group(own_k.narrow(2, k0, own), lo, hi),
                            values.group(own_v.narrow(2, k0, own), lo, hi))
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
        # The key buffers hold the context again: saved instead of ctx_k / ctx_v (no second copy).
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
            return _flash_cpu_backward(grad_out.narrow(2, q0, n), q.narrow(2, q0, n), k, v, out.narrow(2, q0, n),
                                       lse.narrow(2, q0, n), 0.0, False, attn_mask=layout.group_masks[g], scale=scale)

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


def _per_block(t: torch.Tensor, n: int) -> torch.Tensor:
    """``[b, heads, n*m, d]`` -> ``[b*n, m*heads, d]``, each block's tokens x heads as one matrix: a view
    when ``t``'s memory is ``[b, n*m, heads, d]``, as the projections and the kernel leave it."""
    b, heads, t_len, d = t.shape
    return t.transpose(1, 2).reshape(b * n, t_len // n * heads, d)


def _per_token(t: torch.Tensor, b: int, heads: int) -> torch.Tensor:
    """``_per_block``'s inverse: ``[b*n, m*heads, d]`` -> ``[b, heads, n*m, d]`` (a view)."""
    return t.view(b, -1, heads, t.shape[-1]).transpose(1, 2)


def _block_pairs(t: torch.Tensor, m: int, kv: int) -> torch.Tensor:
    """The head-matched entries of ``[b*n, m*h, B*kv]`` (every query head against every own key of every KV
    head) as a view ``[b*n, m, kv, g, B]``: query head ``j*g + i`` with KV head ``j`` (``repeat_interleave``'s
    pairing)."""
    bn, rows, cols = t.shape
    g, bsz = rows // (m * kv), cols // kv
    return t.view(bn, m, kv, g, bsz, kv).diagonal(dim1=2, dim2=5).movedim(-1, 2)


class _SplitAttention(torch.autograd.Function):
    """The same attention as ``_BlockAttention``, in two parts joined by log-sum-exp: each group's queries
    over its context slice (one CPU flash kernel call per group, no own keys in the call), and every block's
    queries over its own block's keys: one ``[m*h, B*kv]`` score matrix per block from a batched matmul, whose
    head-matched entries (``_block_pairs``) are softmaxed with the context part's log-sum-exp; a second matmul
    adds the own values into the context part's output in place. The backward hands the context kernel the
    final output and log-sum-exp (its exact share of the gradient) and differentiates the own part by hand.
    Queries that see no context (``layout.has_context``) get the own part alone. Shapes as ``_BlockAttention``.
    (The kernel for the own blocks too costs per (block, head) problem, not per score: slower at these sizes.)
    """

    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, own_k, own_v, layout, scale):
        b, h, nq, d = q.shape
        kv = own_k.shape[1]
        m = layout.queries_per_block
        n = nq // m
        outs, lses = [], []
        for g, (q0, q1, lo, hi) in enumerate(layout.groups):
            if hi > lo:
                o, lse = _flash_cpu(q.narrow(2, q0, q1 - q0), ctx_k.narrow(2, lo, hi - lo), ctx_v.narrow(2, lo, hi - lo),
                                    0.0, False, attn_mask=layout.context_mask(g), scale=scale)
            else:  # no query of the group sees any context
                o = q.new_zeros(b, q1 - q0, h, d).transpose(1, 2)
                lse = q.new_full((b, h, q1 - q0), float("-inf"))
            outs.append(o)
            lses.append(lse)
        # [b, Q, h, d] memory order (the kernel's), so o_proj reads the result without a copy.
        out = torch.cat([o.transpose(1, 2) for o in outs], dim=1) if len(outs) > 1 else outs[0].transpose(1, 2)
        out = out.contiguous()  # (a no-op unless one group's result came in another order)
        lse_ctx = torch.cat(lses, dim=2) if len(lses) > 1 else lses[0]
        if layout.has_context is not None:  # the kernel gives fully masked rows lse 0 (and output 0)
            lse_ctx = lse_ctx.masked_fill(~layout.has_context, float("-inf"))
        # Own blocks: one matrix per block, [m*h, B*kv] scores of every query head against every own key;
        # the head-matched ones (_block_pairs) are the own part's scores, softmaxed with the context part.
        rep = h // kv  # query heads per KV head
        qb, kb, vb = _per_block(q, n), _per_block(own_k, n), _per_block(own_v, n)
        pairs = torch.bmm(qb, kb.transpose(1, 2))
        scores = _block_pairs(pairs, m, kv).mul(scale)  # [b*n, m, kv, rep, B], contiguous
        if layout.own_mask is not None:  # sliding layers: causal inside the block
            scores.add_(layout.own_mask.view(m, 1, 1, -1))
        lse_ctx = lse_ctx.reshape(b, kv, rep, n, m).permute(0, 3, 4, 1, 2).reshape(b * n, m, kv, rep)
        top = torch.maximum(scores.amax(dim=-1), lse_ctx)  # finite: every query sees its own slot
        probs = scores.sub_(top[..., None]).exp_()
        share = lse_ctx.sub_(top).exp_()  # the context part's weight before normalising
        total = probs.sum(dim=-1).add_(share)
        probs.div_(total[..., None])
        share.div_(total)
        lse = top.add_(total.log_()).reshape(b, n, m, h).permute(0, 3, 1, 2).reshape(b, h, nq)
        weights = pairs.zero_()  # [b*n, m*h, B*kv]: the probabilities, zero off the matched heads
        _block_pairs(weights, m, kv).copy_(probs)
        tokens = out.view(b * n, m * h, d)  # [b, Q, h, d] memory, one matrix per block
        tokens.mul_(share.reshape(b * n, -1, 1)).baddbmm_(weights, vb)
        out = out.transpose(1, 2)
        ctx.save_for_backward(q, ctx_k, ctx_v, own_k, own_v, out, lse, weights)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, ctx_k, ctx_v, own_k, own_v, out, lse, weights = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale
        b, h, nq, d = q.shape
        kv = own_k.shape[1]
        m = layout.queries_per_block
        n = nq // m
        dq_parts = []
        dk_ctx = torch.zeros_like(ctx_k)
        dv_ctx = torch.zeros_like(ctx_v)
        for g, (q0, q1, lo, hi) in enumerate(layout.groups):
            rows = q1 - q0
            if hi <= lo:
                dq_parts.append(q.new_zeros(b, rows, h, d))
                continue
            gq, gk, gv = _flash_cpu_backward(
                grad_out.narrow(2, q0, rows), q.narrow(2, q0, rows), ctx_k.narrow(2, lo, hi - lo),
                ctx_v.narrow(2, lo, hi - lo), out.narrow(2, q0, rows), lse.narrow(2, q0, rows), 0.0, False,
                attn_mask=layout.context_mask(g), scale=scale)
            dq_parts.append(gq.transpose(1, 2))
            dk_ctx.narrow(2, lo, hi - lo).add_(gk)
            dv_ctx.narrow(2, lo, hi - lo).add_(gv)
        dq = torch.cat(dq_parts, dim=1) if len(dq_parts) > 1 else dq_parts[0].contiguous()  # [b, Q, h, d]

        # Own blocks, from the kept probabilities: dS = P * (dP - rowsum(dO * O)), in the same one matrix
        # per block as the forward (zero off the matched heads, so the products sum no other head).
        d_out, qb, kb, vb = (_per_block(t, n) for t in (grad_out, q, own_k, own_v))
        dot = (grad_out * out).sum(dim=-1).reshape(b, kv, h // kv, n, m)
        dot = dot.permute(0, 3, 4, 1, 2).reshape(b * n, m, kv, -1)  # rowsum(dO * O), as _block_pairs' rows
        d_pairs = torch.bmm(d_out, vb.transpose(1, 2))
        d_scores = _block_pairs(d_pairs, m, kv).sub(dot[..., None])
        d_weights = d_pairs.zero_()
        _block_pairs(d_weights, m, kv).copy_(d_scores.mul_(_block_pairs(weights, m, kv))).mul_(scale)
        dq.view(b * n, m * h, d).baddbmm_(d_weights, kb)  # dq: [b, Q, h, d] memory
        d_k = torch.bmm(d_weights.transpose(1, 2), qb)
        d_v = torch.bmm(weights.transpose(1, 2), d_out)
        d_own_k, d_own_v = _per_token(d_k, b, kv), _per_token(d_v, b, kv)
        return dq.transpose(1, 2), dk_ctx, dv_ctx, d_own_k, d_own_v, None, None


def split_block_attention(q, ctx_k, ctx_v, own_k, own_v, layout, scale):
    """``block_attention``'s values through ``_SplitAttention`` (needs ``layout.has_context``)."""
    return _SplitAttention.apply(q, ctx_k, ctx_v, own_k, own_v, layout, scale)
