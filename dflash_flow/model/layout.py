"""How a chunk of blocks attends: the dense reference mask (``block_attention_mask``), the column bounds each
block may see, blocks grouped by anchor (``group_spans``, ``auto_group_blocks``) and their compact layouts
(``block_layouts``). Pure shape arithmetic over a ``BlockPlan``."""

from __future__ import annotations

import attrs
import torch
from torch import nn

from dflash_flow.model.blockplan import BlockPlan
from dflash_flow.model.drafter_config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_flow.model.drafter_layers import BlockLayout


def _context_visibility(anchors: torch.Tensor, keep: torch.Tensor, context_valid: torch.Tensor, *,
                        block_size: int, first_slot: int, layer_type: str,
                        sliding_window: int | None) -> torch.Tensor:
    """Which context positions the queries of blocks at ``anchors`` see: bool ``[b, N, 1, S]`` for full layers,
    ``[b, N, B - first_slot, S]`` for sliding ones. Decided by the anchor's *position* (``c < a``), never by
    block index (blocks overlap in position: index rules leak future context); padding blocks see none."""
    device = anchors.device
    c = torch.arange(context_valid.shape[1], device=device)
    a = anchors[:, :, None, None]  # [b, N, 1, 1]
    ctx = (c < a) & keep[:, :, None, None] & context_valid[:, None, None, :]  # [b, N, 1, S]
    if layer_type == SLIDING_ATTENTION:
        if sliding_window is None:
            raise ValueError("sliding_attention needs sliding_window")
        j = torch.arange(first_slot, block_size, device=device)
        # Query at a+j sees positions p with a+j-p < W (inference applies the window by key position).
        ctx = ctx & (c >= a + j[:, None] - (sliding_window - 1))
    elif layer_type != FULL_ATTENTION:
        raise ValueError(f"unknown layer type {layer_type!r}")
    return ctx


def _within_block(block_size: int, layer_type: str, sliding_window: int | None, device) -> torch.Tensor:
    """``[B, B]`` bool (query slot, key slot) inside a block: all for full layers (bidirectional),
    causal and windowed for sliding layers."""
    j = torch.arange(block_size, device=device)
    if layer_type == SLIDING_ATTENTION:
        return (j[None, :] <= j[:, None]) & (j[:, None] - j[None, :] < sliding_window)
    return torch.ones(block_size, block_size, dtype=torch.bool, device=device)


def block_attention_mask(anchors: torch.Tensor, keep: torch.Tensor, context_valid: torch.Tensor, *,
                         block_size: int, layer_type: str = FULL_ATTENTION,
                         sliding_window: int | None = None) -> torch.Tensor:
    """Dense bool mask ``[b, 1, N*B, S + N*B]`` for blocks at ``anchors`` over context + the blocks (the reference
    the grouped training layout follows). Padding blocks see only their own block: no row is fully masked."""
    b, n = anchors.shape
    ctx = _context_visibility(anchors, keep, context_valid, block_size=block_size, first_slot=0,
                              layer_type=layer_type, sliding_window=sliding_window)
    ctx = ctx.expand(b, n, block_size, ctx.shape[-1]).reshape(b, n * block_size, -1)
    within = _within_block(block_size, layer_type, sliding_window, anchors.device)
    blk = torch.arange(n, device=anchors.device)
    same_block = blk[:, None, None, None] == blk[None, None, :, None]  # [N, 1, N, 1]
    own = (same_block & within[None, :, None, :]).reshape(n * block_size, n * block_size)
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)[:, None]


@attrs.frozen
class ColumnBounds:
    """Host copy of the anchors' bounds per block column n (over the rows' kept blocks): ``hi[n]`` the largest
    anchor (-1 if no row keeps block n), ``lo[n]`` the smallest (``seq_len`` if none)."""

    hi: list[int]
    lo: list[int]
    seq_len: int


def read_bounds(
    anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, counts: torch.Tensor | None = None
) -> tuple[ColumnBounds, int | None]:
    hi = torch.where(keep, anchors, torch.full_like(anchors, -1)).amax(dim=0)
    lo = torch.where(keep, anchors, torch.full_like(anchors, seq_len)).amin(dim=0)
    parts = [hi, lo] + ([counts.max().reshape(1)] if counts is not None else [])
    flat = torch.cat(parts).tolist()  # the step's only device->host read before the backward
    n = anchors.shape[1]
    count = int(flat[2 * n]) if counts is not None else None
    return ColumnBounds(hi=flat[:n], lo=flat[n : 2 * n], seq_len=seq_len), count


def group_spans(bounds: ColumnBounds, start: int, stop: int, *, group_blocks: int, layer_type: str,
                sliding_window: int | None) -> list[tuple[int, int, int, int]]:
    """Groups ``(n0, n1, lo, hi)`` of ``group_blocks`` consecutive blocks in ``[start, stop)`` and the
    context slice ``[lo, hi)`` that holds every position their queries can see (``c < anchor``, and for
    sliding layers ``c > anchor - W``)."""
    spans = []
    for n0 in range(start, stop, group_blocks):
        n1 = min(n0 + group_blocks, stop)
        hi = max(bounds.hi[n0:n1])
        if hi <= 0:  # only padding blocks, or anchors at 0: no context at all
            spans.append((n0, n1, 0, 0))
            continue
        hi = min(hi, bounds.seq_len)
        lo = 0
        if layer_type == SLIDING_ATTENTION and sliding_window is not None:
            lo = min(max(0, min(bounds.lo[n0:n1]) - (sliding_window - 1)), hi)
        spans.append((n0, n1, lo, hi))
    return spans


# CPU: the flash kernel's forward + backward costs ~7 ns per query-key pair per row and head at head_dim 64,
# one group's fixed cost ~250 us per layer. In units of (query-key pair x row x head x head_dim):
GROUP_FIXED_COST = 250e-6 / (7e-9 / 64)


# The grouped SDPA path (``DrafterAttention.grouped_attention``: CUDA, and the CPU under attention dropout) makes
# one SDPA call per group after copying its own keys and context slice into one key tensor: taken as ~1 ms per
# group and layer (launches included; not measured on a GPU yet) against ~14 FLOP per unit above at ~2e14 FLOP/s.
SDPA_GROUP_FIXED_COST = 1e-3 * 2e14 / 14
# Each group's key copies stay saved for the backward (``chunk_activation_bytes`` counts this many per chunk).
SDPA_MAX_GROUPS = 16
# Columns of an SDPA path group mask are padded to this multiple: CUDA's memory-efficient kernel needs the
# mask's pointer and row stride aligned.
MASK_ALIGN = 16


def uses_sdpa(drafter: nn.Module) -> bool:
    """Whether the drafter's training attention takes the grouped SDPA path on its device (CUDA; the CPU under
    attention dropout) rather than the CPU kernels (``DrafterAttention.splits_on``)."""
    device = drafter.fc.weight.device
    return not all(layer.self_attn.splits_on(device) for layer in drafter.layers)


# The split attention (``block_attention._SplitAttention``) scores no own keys in its per-group kernel calls,
# but each group's backward writes a gradient for every context key of its slice: per context position of a
# group, about the time of this many query-key pairs per (row x KV head x head_dim) (fitted on whole steps).
SPLIT_KEY_COST = 16


def auto_group_blocks(bounds: ColumnBounds, start: int, stop: int, *, block_size: int, pair_cost: int,
                      key_cost: int | None = None, fixed_cost: float = GROUP_FIXED_COST,
                      max_groups: int | None = None) -> int:
    """Blocks per attention group for blocks ``start..stop-1``: the power of two with the least estimated
    time, ``pair_cost`` (rows x heads x head_dim) per visible-range query-key pair plus ``fixed_cost`` per
    group. ``key_cost``: the split attention's grouping (no own keys scored; this much per context key of a
    group's slice). ``max_groups``: no size that makes more groups is chosen (the grouped SDPA path)."""
    n = stop - start
    # Per group of `size` blocks: its context end (the largest anchor), by pairwise maxima as size doubles.
    ends = [max(0, min(h, bounds.seq_len)) for h in bounds.hi[start:stop]]
    best, best_cost, size = 1, None, 1
    while True:
        if key_cost is None:  # each query scores its group's context slice and its group's own keys
            pairs = sum(
                min(size, n - i * size) * block_size * (end + min(size, n - i * size) * block_size)
                for i, end in enumerate(ends)
            )
            cost = pairs * pair_cost + len(ends) * fixed_cost
        else:  # context only, and every group's slice once more for its keys' gradients
            pairs = sum(min(size, n - i * size) * block_size * end for i, end in enumerate(ends))
            cost = pairs * pair_cost + len(ends) * fixed_cost + sum(ends) * key_cost
        allowed = max_groups is None or len(ends) <= max_groups or size >= n
        if allowed and (best_cost is None or cost < best_cost):
            best, best_cost = size, cost
        if size >= n:
            return min(best, n)
        ends = [max(ends[i : i + 2]) for i in range(0, len(ends), 2)]
        size *= 2


# The split attention pays when the groups' context slices are long against their own keys (context / own
# keys ~6: faster; ~2.5: slower, the joining passes cost more than the own keys it stops scoring).
SPLIT_CONTEXT_RATIO = 4.0


@attrs.frozen
class Grouping:
    """The attention groups of a chunk of blocks per layer type (``group_spans``), and the layer types whose
    layouts take the split attention (``block_layouts``' ``split``)."""

    spans: dict[str, list[tuple[int, int, int, int]]]
    split: frozenset[str] = frozenset()
    sdpa: bool = False  # the layers take the grouped SDPA path (``uses_sdpa``): one aligned mask per group


def split_pays(spans: list[tuple[int, int, int, int]], block_size: int) -> bool:
    """Whether groups ``spans`` (``group_spans``) see at least ``SPLIT_CONTEXT_RATIO`` context keys per own key."""
    context = sum(hi - lo for _n0, _n1, lo, hi in spans)
    own = sum((n1 - n0) * block_size for n0, n1, _lo, _hi in spans)
    return context >= SPLIT_CONTEXT_RATIO * own


def block_layouts(plan: BlockPlan, spans: dict[str, list[tuple[int, int, int, int]]], start: int, stop: int,
                  *, layer_types: list[str], sliding_window: int | None, dtype: torch.dtype,
                  last_drops_first_slot: bool = False, split: bool | None | frozenset[str] = False,
                  sdpa: bool = False) -> list[BlockLayout]:
    """One ``BlockLayout`` per layer for blocks ``start..stop-1`` grouped by ``spans`` (per layer type); layers
    of a type share one layout. ``last_drops_first_slot``: the last layer computes no slot-0 queries.
    ``split``: True: layouts for the split attention, with no ``[scratch | context]`` mask (each group's context
    mask is made when its kernel call needs it); None: split where it pays (``split_pays``); a set of layer
    types: those types' layouts split; else layouts for ``_BlockAttention``. ``sdpa``: the grouped SDPA path's
    layouts: one mask per group in a buffer padded to ``MASK_ALIGN`` columns, no ``mask``.
    """
    made: dict[tuple[str, bool], BlockLayout] = {}
    last = len(layer_types) - 1
    for i, layer_type in enumerate(layer_types):
        drop = last_drops_first_slot and i == last
        if (layer_type, drop) not in made:
            made[(layer_type, drop)] = _type_layout(plan, spans[layer_type], start, stop, layer_type,
                                                    first=1 if drop else 0, sliding_window=sliding_window,
                                                    dtype=dtype, split=split, sdpa=sdpa)
    return [made[(t, last_drops_first_slot and i == last)] for i, t in enumerate(layer_types)]


def _type_layout(plan: BlockPlan, spans: list[tuple[int, int, int, int]], start: int, stop: int, layer_type: str, *,
                 first: int, sliding_window: int | None, dtype: torch.dtype, split: bool | None | frozenset[str],
                 sdpa: bool) -> BlockLayout:
    """The layout of one layer type's layers (queries from slot ``first`` on), as :func:`block_layouts` says."""
    bsz = plan.block_size
    b, n = plan.anchors.shape[0], stop - start
    per_block = bsz - first
    vis = _context_visibility(plan.anchors[:, start:stop], plan.keep[:, start:stop], plan.context_valid,
                              block_size=bsz, first_slot=first, layer_type=layer_type, sliding_window=sliding_window)
    scratch = max(n1 - n0 for n0, n1, _lo, _hi in spans) * bsz
    zero = torch.zeros((), dtype=dtype, device=vis.device)
    within = _within_block(bsz, layer_type, sliding_window, vis.device)[first:]
    groups = [((n0 - start) * per_block, (n1 - start) * per_block, lo, hi) for n0, n1, lo, hi in spans]
    own_mask = torch.where(within, zero, float("-inf"))[None, None] if layer_type == SLIDING_ATTENTION else None
    has_context = vis.any(dim=-1).expand(b, n, per_block).reshape(b, 1, n * per_block)
    if isinstance(split, frozenset):
        takes_split = layer_type in split
    else:
        takes_split = bool(split) or (split is None and split_pays(spans, bsz))
    if takes_split:
        # Each group's context mask is made when its kernel call needs it (BlockLayout.context_mask).
        return BlockLayout(bsz, per_block, groups, scratch, None, None, vis, own_mask, has_context, dtype, True, {})
    if sdpa:
        return BlockLayout(
            bsz, per_block, groups, scratch, None, _group_masks(vis, within, groups, per_block, bsz, zero),
            None, own_mask, has_context, dtype,
        )
    mask, views = _additive_mask(vis, within, groups, scratch, per_block, bsz, zero, dtype)
    return BlockLayout(bsz, per_block, groups, scratch, mask, views, None, own_mask, has_context, dtype)


def _additive_mask(vis, within, groups, scratch: int, per_block: int, bsz: int, zero,
                   dtype: torch.dtype) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The one additive mask in the key layout [scratch | context], and each group's view of it (its rows get
    its own-block pattern next to its slice)."""
    b, n, _, seq = vis.shape  # seq: the context's length
    mask = torch.empty((b, 1, n * per_block, scratch + seq), dtype=dtype, device=vis.device)
    mask[..., :scratch] = float("-inf")
    mask[:, 0, :, scratch:].view(b, n, per_block, seq).copy_(torch.where(vis, zero, float("-inf")))
    own_patterns: dict[int, torch.Tensor] = {}
    views = []
    for q0, q1, lo, hi in groups:
        m = (q1 - q0) // per_block
        if m not in own_patterns:  # block-diagonal: each block sees only itself
            own = torch.block_diag(*[within.to(dtype)] * m) > 0
            own_patterns[m] = torch.where(own, zero, float("-inf"))
        first_key = scratch + lo - m * bsz
        # (BlockLayout.context_mask reads the columns from scratch + lo on: none of these writes)
        mask[:, 0, q0:q1, first_key : scratch + lo] = own_patterns[m]
        views.append(mask.narrow(2, q0, q1 - q0).narrow(3, first_key, m * bsz + hi - lo))
    return mask, views


def _group_masks(vis, within, groups, per_block: int, bsz: int, zero) -> list[torch.Tensor]:
    """The grouped SDPA path's additive mask of each group, ``[b, 1, q1 - q0, own + hi - lo]`` (its own blocks'
    keys, block-diagonal, then its context slice), a view into a buffer with rows padded to ``MASK_ALIGN``."""
    b = vis.shape[0]
    out = []
    for q0, q1, lo, hi in groups:
        m = (q1 - q0) // per_block
        own, cols = m * bsz, m * bsz + hi - lo
        buf = torch.full((b, 1, q1 - q0, -(-cols // MASK_ALIGN) * MASK_ALIGN), float("-inf"), dtype=zero.dtype,
                         device=vis.device)
        block = torch.block_diag(*[within.to(zero.dtype)] * m) > 0
        buf[:, 0, :, :own] = torch.where(block, zero, float("-inf"))
        n0, n1 = q0 // per_block, q1 // per_block
        if hi > lo:
            ctx = torch.where(vis[:, n0:n1, :, lo:hi], zero, float("-inf"))  # [b, m, 1 or per_block, hi - lo]
            buf[:, 0, :, own:cols].view(b, m, per_block, hi - lo).copy_(ctx.expand(b, m, per_block, hi - lo))
        out.append(buf.narrow(3, 0, cols))
    return out


def activation_bytes_per_block(drafter: nn.Module, *, vocab_size: int, context_len: int) -> int:
    """Estimated bytes (within ~2x) one block of one row keeps for the backward when its chunk is not
    checkpointed: per token, each layer's saved activations, its mask row, the fp32 logits and log-softmax."""
    cfg = drafter.config
    elem = torch.finfo(drafter.dtype).bits // 8
    h = int(cfg.hidden_size)
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    d = int(getattr(cfg, "head_dim", None) or h // heads)
    per_layer = elem * (6 * h + 2 * heads * d + 2 * kv * d + 4 * int(cfg.intermediate_size))
    # two context masks (all slots; the last layer without slot 0) and fp32 logits, log-softmax, grad
    per_token = len(drafter.layers) * per_layer + 2 * elem * context_len + 3 * 4 * int(vocab_size)
    from dflash_flow.model.dflash2 import drafter_variant
    from dflash_flow.model.lossstats import terms_for

    per_token += terms_for(drafter_variant(drafter.config)).activation_bytes_per_token(drafter, elem)  # DFlash 2's
    return per_token * drafter.block_size


def chunk_activation_bytes(drafter: nn.Module, *, batch: int, blocks: int, context_len: int, vocab_size: int) -> int:
    """Estimated bytes a chunk of ``blocks`` blocks of ``batch`` rows keeps for its backward: ``blocks`` x
    ``activation_bytes_per_block``, plus on the grouped SDPA path what each SDPA call saves (its group's key and
    value copies, at most ``SDPA_MAX_GROUPS`` per chunk and layer, its output and log-sum-exp, the masks)."""
    per_block = activation_bytes_per_block(drafter, vocab_size=vocab_size, context_len=context_len)
    if not uses_sdpa(drafter):
        return batch * blocks * per_block
    cfg = drafter.config
    elem = torch.finfo(drafter.dtype).bits // 8
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    d = int(getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads)
    bsz, layers = drafter.block_size, len(drafter.layers)
    # per token and layer: the SDPA output beside o_proj's copy of it, the log-sum-exp (fp32), the own keys and
    # values in the group's key copies; per token, the two layouts' masks over the own keys (the estimate per
    # block counts their context columns)
    extra = layers * (heads * d * elem + 4 * heads + 2 * kv * d * elem) + 2 * elem * (blocks * bsz + MASK_ALIGN)
    context_copies = layers * min(SDPA_MAX_GROUPS, blocks) * 2 * kv * d * elem * context_len
    return batch * (blocks * (per_block + bsz * extra) + context_copies)


def auto_chunk_blocks(
    drafter: nn.Module, *, batch: int, num_blocks: int, context_len: int, vocab_size: int, budget_mb: float
) -> int | None:
    """Blocks per checkpointed chunk under an activation budget (``chunk_activation_bytes``); None when all blocks
    fit in one pass (no recomputation at all)."""
    budget = budget_mb * 2**20
    if not uses_sdpa(drafter):
        per_block = batch * activation_bytes_per_block(drafter, vocab_size=vocab_size, context_len=context_len)
        fit = int(budget // max(per_block, 1))
        return None if fit >= num_blocks else max(1, fit)

    def size(n: int) -> int:
        return chunk_activation_bytes(drafter, batch=batch, blocks=n, context_len=context_len, vocab_size=vocab_size)

    if size(num_blocks) <= budget:
        return None
    lo, hi = 1, num_blocks  # the largest n with size(n) <= budget (at least 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if size(mid) <= budget else (lo, mid)
    return lo
