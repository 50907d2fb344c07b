"""The DFlash training objective (SpecForge ``OnlineDFlashModel``, loss "dflash").

Per row, up to ``num_anchors`` anchors are drawn among positions ``i`` with ``loss_mask[i]`` and
``loss_mask[i+1]``. Each anchor opens a block ``[input_ids[a], MASK x (B-1)]`` at positions ``a..a+B-1``.
A block sees the target features of positions strictly before its anchor (the anchor's own feature is
not available at inference: it is the bonus token being verified) and the keys of its own block
(all of them in full-attention layers, offsets <= j in sliding layers). Slot k is supervised with the
token at ``a+k`` (same-position labels, slot 0 excluded), weighted by ``exp(-(k-1)/gamma)``.

The variable-prefix objective (D2SD VP-Drafter, ``PrefixPrior``; docs/objectives.md) changes only the
block plan: block n draws a visible prefix length ``l`` (``1 <= l <= B-1``), slots ``0..l-1`` hold the
real tokens ``a..a+l-1``, and only slots ``k >= l`` are supervised, weighted ``exp(-(k-l)/gamma)``.

A DFlash 2 drafter (``dflash2.DFlash2Drafter``) trains with NeMo AutoModel's DFlash 2 rule:
``loss = dflash + selector_loss_weight * selector``, the selector term a cross-entropy over each
supervised slot's top-k candidates scored after the true previous token (teacher forcing), target the
true token's index, DFlash's decay weights, normalised by its own weight sum, slots whose true token
is not a candidate left out (``dflash2.selector_terms``). Why that rule: it trains the selector on
exactly the candidate sets it reranks at decoding (speculators' alternative injects a missing target
into the set, a set decoding never sees), and along an accepted run the true and the walked
predecessors coincide, so its teacher-forced hits give the walk's acceptance. Its statistics
(``selector_accuracy``, ``candidate_recall``, ``selector_accept_len``, both loss terms) travel in
``DFlashLossOutput.extra``. Its in-block convolutions mix slots, so the two shortcuts below that assume
independent slots (factored first-layer rows, no slot-0 queries in the last layer) are off for it.

How it is computed (``dflash_loss``), each step the work a block actually needs and nothing else:

* the fused context and its keys/values are computed once per layer (``DFlashDrafter.context_kv``);
* blocks never see each other, so they run in chunks (``chunk_blocks``, or from a memory budget,
  ``activation_budget_mb``); a chunk runs drafter + LM head + cross-entropy, under activation
  checkpointing only when there is more than one chunk (then only one chunk's activations and logits
  exist at a time);
* inside a chunk, blocks are grouped by anchor (``group_spans``, ``auto_group_blocks``): a group's
  queries attend to the context slice their anchors can see plus their own block (``BlockLayout``),
  not to the whole row and every block as a dense ``[N*B, S + N*B]`` mask would
  (``block_attention_mask``, kept as the reference layout);
* the first layer projects N + 1 distinct rows per sequence (slots 1..B-1 all hold the mask token;
  not under the variable-prefix objective, whose visible prefixes put real tokens there),
  the last layer computes no slot-0 queries and the head no slot-0 logits (slot 0 is never supervised);
* one device->host read per step (block count and anchor bounds, which set the shapes), in
  ``dflash_loss``; ``DFlashLossOutput.metrics`` is the only other.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_flow.model.drafter import FULL_ATTENTION, SLIDING_ATTENTION, BlockLayout, SlotRows


@attrs.define(eq=False)
class BlockPlan:
    """Anchors of a batch and everything derived from them that does not depend on the drafter."""

    anchors: torch.Tensor  # [b, N] long, ascending among kept blocks; 0 for padding blocks
    keep: torch.Tensor  # [b, N] bool, False for padding blocks
    block_ids: torch.Tensor  # [b, N, B] long: noise tokens (anchor token, then MASK)
    block_positions: torch.Tensor  # [b, N, B] long: a + k
    labels: torch.Tensor  # [b, N, B] long: input_ids[a + k] (same position), clamped inside the row
    supervised: torch.Tensor  # [b, N, B] bool: keep & a+k<S & k>=1 & loss_mask[a+k]
    weights: torch.Tensor  # [b, N, B] float: supervised * exp(-(k-1)/gamma)
    context_valid: torch.Tensor  # [b, S] bool: positions that may serve as context (not padding)
    # [b, N] long, variable-prefix objective only: slots < l hold real tokens, slots >= l are supervised
    prefix_lengths: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    @property
    def block_size(self) -> int:
        return self.block_ids.shape[2]


@attrs.define(eq=False)
class DFlashLossOutput:
    """Loss (with graph) and detached statistics; properties sync per access, ``metrics()`` syncs once."""

    loss: torch.Tensor
    weight_sum: torch.Tensor  # sum of loss weights (the loss denominator)
    correct_per_position: torch.Tensor  # [B] correct argmax on supervised slots, per slot k
    supervised_per_position: torch.Tensor  # [B] supervised slots per k
    acceptance_sum: torch.Tensor  # sum over kept blocks of the simulated acceptance length
    kept_blocks: torch.Tensor  # number of kept (non-padding) blocks
    # Scalar statistics of a variant or objective (DFlash 2's selector, the variable prefix), as
    # (numerator, denominator): metrics() reports numerator / denominator (0 when the denominator is 0).
    extra: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.supervised_per_position.sum().item())

    @property
    def accuracy(self) -> float:
        n = self.supervised_per_position.sum().item()
        return float(self.correct_per_position.sum().item() / n) if n else 0.0

    @property
    def position_accuracy(self) -> list[float]:
        """Accuracy of slots k = 1..B-1 (0.0 where a slot had no supervised token)."""
        c = self.correct_per_position[1:].tolist()
        s = self.supervised_per_position[1:].tolist()
        return [ci / si if si else 0.0 for ci, si in zip(c, s, strict=True)]

    @property
    def acceptance_length(self) -> float:
        """Mean over kept blocks of ``1 + sum_k prod_{j<=k} [argmax_j == t_j]`` (the bonus token counts);
        under the variable-prefix objective the products start at the block's first masked slot ``l``."""
        n = self.kept_blocks.item()
        return float(self.acceptance_sum.item() / n) if n else 0.0

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """All statistics as floats, fetched from the device in one transfer."""
        names = list(self.extra)
        flat = torch.cat(
            [
                self.loss.detach().float().reshape(1),
                self.acceptance_sum.float().reshape(1),
                self.kept_blocks.float().reshape(1),
                self.correct_per_position.float(),
                self.supervised_per_position.float(),
                *(t.detach().float().reshape(1) for name in names for t in self.extra[name]),
            ]
        ).tolist()
        loss, accept, blocks = flat[:3]
        block = self.correct_per_position.numel()
        correct, supervised = flat[3 : 3 + block], flat[3 + block : 3 + 2 * block]
        ratios = flat[3 + 2 * block :]
        total = sum(supervised)
        out = {
            f"{prefix}loss": loss,
            f"{prefix}accuracy": sum(correct) / total if total else 0.0,
            f"{prefix}acceptance_length": accept / blocks if blocks else 0.0,
            f"{prefix}num_tokens": total,
            f"{prefix}num_blocks": blocks,
        }
        for k in range(1, block):
            out[f"{prefix}accuracy_pos{k}"] = correct[k] / supervised[k] if supervised[k] else 0.0
        for i, name in enumerate(names):
            num, den = ratios[2 * i], ratios[2 * i + 1]
            out[f"{prefix}{name}"] = num / den if den else 0.0
        return out


def valid_anchor_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, S]`` bool: i is a valid anchor iff positions i and i+1 are both supervised (and not padding)."""
    lm = loss_mask.bool()
    if attention_mask is not None:
        lm = lm & attention_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return valid


def _anchor_candidates(
    loss_mask: torch.Tensor,
    width: int,
    *,
    attention_mask: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``width`` sorted anchors per row, padding last, and the valid counts; no device->host read.

    A uniformly random subset = the smallest of i.i.d. uniform keys; invalid positions get key 2 so they
    are only picked when a row runs out of valid ones (and then become padding). Any prefix of the
    result is what a smaller ``width`` would draw from the same generator state.
    """
    valid = valid_anchor_mask(loss_mask, attention_mask)
    b, s = valid.shape
    device = valid.device
    draw_on = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(b, s, generator=generator, device=draw_on).to(device)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))
    picked = torch.topk(keys, width, dim=1, largest=False).indices
    keep = valid.gather(1, picked)
    # Sort kept anchors ascending and push padding to the end.
    order = torch.where(keep, picked, picked + s).argsort(dim=1)
    anchors = picked.gather(1, order)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    return anchors, keep, valid.sum(dim=1)


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    *,
    attention_mask: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``W = min(num_anchors, max #valid)`` anchors per row, uniformly without replacement, sorted.

    Random keys are drawn on ``generator``'s device (CPU without one). A CPU generator gives the same
    anchors for a seed whatever device the batch is on; a CUDA generator works but draws differently.
    Returns ``(anchors [b, W] long, keep [b, W] bool)``; rows with fewer valid positions are padded at
    the end with anchor 0 and keep False.
    """
    b, s = loss_mask.shape
    width = min(int(num_anchors), s)
    if b == 0 or width <= 0:
        empty = torch.zeros(b, 0, dtype=torch.long, device=loss_mask.device)
        return empty, empty.bool()
    anchors, keep, counts = _anchor_candidates(
        loss_mask, width, attention_mask=attention_mask, generator=generator
    )
    w = min(width, int(counts.max().item()))  # the block count sets every shape after it
    return anchors[:, :w], keep[:, :w]


def decay_weights(
    block_size: int, gamma: float | None, *, device: torch.device | None = None
) -> torch.Tensor:
    """Per-slot loss weights ``[B]``: slot 0 is never supervised (0), then ``exp(-(k-1)/gamma)``, k >= 1.

    ``gamma`` None or <= 0 means no decay (1 on every slot k >= 1).
    """
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if gamma is None or gamma <= 0:
        w = torch.ones(block_size, device=device)
    else:
        w = torch.exp(-(k - 1.0).clamp(min=0.0) / float(gamma))
    return torch.where(k >= 1, w, torch.zeros_like(w))


@attrs.frozen(kw_only=True)
class PrefixPrior:
    """The variable-prefix objective's prior over a block's visible prefix length ``l`` (D2SD VP-Drafter,
    arXiv 2606.04446, as NeMo AutoModel's ``loss_type: variable_prefix`` defines it): a truncated
    geometric law ``Pr(l) ~ weight_base ** l`` on ``min_length..max_length``.

    ``l`` counts the anchor slot: slots ``0..l-1`` hold the real tokens ``input_ids[a..a+l-1]``, slots
    ``l..B-1`` the mask token, and only those are supervised; ``l = 1`` is DFlash's block. ``max_length``
    None means ``B - 1`` (at least one masked slot). NeMo fixes the range to ``min(2, B-1)..B-1``; our
    default starts at 1 because inference (z-lab's decoding) drafts every block with ``l = 1``.
    Errors name the config fields (``prefix_weight_base``, ``prefix_min_length``, ``prefix_max_length``).
    """

    weight_base: float = 0.9
    min_length: int = 1
    max_length: int | None = None

    def bounds(self, block_size: int) -> tuple[int, int]:
        """``(lo, hi)``: the support of the prior for blocks of ``block_size``; raises on a bad setting."""
        base = self.weight_base
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
            raise ValueError(f"prefix_weight_base must be a finite number > 0, got {base!r}")
        hi = block_size - 1 if self.max_length is None else self.max_length
        if not 1 <= self.min_length <= block_size - 1:
            raise ValueError(
                f"prefix_min_length must be in [1, block_size - 1] = [1, {block_size - 1}], got {self.min_length}"
            )
        if not self.min_length <= hi <= block_size - 1:
            raise ValueError(
                f"prefix_max_length must be in [prefix_min_length, block_size - 1] = "
                f"[{self.min_length}, {block_size - 1}], got {hi}"
            )
        return int(self.min_length), int(hi)

    def probabilities(self, block_size: int) -> torch.Tensor:
        """``[hi - lo + 1]`` float64 on the CPU: ``Pr(l)`` for ``l = lo..hi``."""
        lo, hi = self.bounds(block_size)
        # Relative to the first term, so large bases or long blocks cannot overflow.
        w = torch.tensor([float(self.weight_base) ** (n - lo) for n in range(lo, hi + 1)], dtype=torch.float64)
        return w / w.sum()


def sample_prefix_lengths(
    shape: tuple[int, int] | torch.Size,
    prior: PrefixPrior,
    *,
    block_size: int,
    device: torch.device | str | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Visible prefix lengths ``[b, N]`` long, i.i.d. from ``prior``, by inverse CDF of one uniform each.

    Drawn on ``generator``'s device (CPU without one) like the anchor keys, then moved to ``device``:
    one vectorised draw, no Python loop over blocks, no device->host read; the same generator state gives
    the same lengths.
    """
    lo, hi = prior.bounds(block_size)
    draw_on = generator.device if generator is not None else torch.device("cpu")
    cdf = prior.probabilities(block_size).cumsum(0).to(draw_on)
    u = torch.rand(tuple(shape), generator=generator, device=draw_on, dtype=torch.float64)
    idx = torch.searchsorted(cdf, u, right=True).clamp(max=hi - lo)
    return (idx + lo).to(device if device is not None else draw_on)


def prefix_decay_weights(prefix_lengths: torch.Tensor, block_size: int, gamma: float | None) -> torch.Tensor:
    """``[b, N, B]`` weights of the variable-prefix objective: 0 on the visible slots ``k < l``, then
    ``exp(-(k-l)/gamma)`` (the decay re-anchored at the prefix boundary); ``l = 1`` gives exactly
    ``decay_weights`` (the same arithmetic)."""
    k = torch.arange(block_size, device=prefix_lengths.device, dtype=torch.float32)
    shift = k - prefix_lengths[..., None].to(torch.float32)
    if gamma is None or gamma <= 0:
        w = torch.ones_like(shift)
    else:
        w = torch.exp(-shift.clamp(min=0.0) / float(gamma))
    return torch.where(shift >= 0, w, torch.zeros_like(w))


def plan_blocks(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    keep: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float | None = 7.0,
    attention_mask: torch.Tensor | None = None,
    prefix_lengths: torch.Tensor | None = None,
) -> BlockPlan:
    """Block inputs, positions, same-position labels and loss weights for given anchors.

    ``prefix_lengths`` ``[b, N]`` (the variable-prefix objective): block n shows the real tokens at
    ``a..a+l-1`` (the mask token where that position is padding or past the row), and only slots
    ``k >= l`` are supervised, weighted ``exp(-(k-l)/gamma)``. None: DFlash's block (``l = 1``)."""
    b, s = input_ids.shape
    device = input_ids.device
    k = torch.arange(block_size, device=device)
    pos = anchors[:, :, None] + k  # [b, N, B]
    in_row = pos < s
    idx = pos.clamp(max=s - 1)
    labels = input_ids.gather(1, idx.flatten(1)).view_as(idx)
    lm = loss_mask.bool()
    if attention_mask is not None:
        lm = lm & attention_mask.bool()
    context_valid = (
        attention_mask.bool()
        if attention_mask is not None
        else torch.ones(b, s, dtype=torch.bool, device=device)
    )
    if prefix_lengths is None:
        sup = keep[:, :, None] & in_row & (k >= 1) & lm.gather(1, idx.flatten(1)).view_as(idx)
        weights = sup.float() * decay_weights(block_size, gamma, device=device)
        block_ids = torch.full_like(pos, int(mask_token_id))
        first = input_ids.gather(1, anchors)
        block_ids[:, :, 0] = torch.where(keep, first, torch.full_like(first, int(mask_token_id)))
    else:
        prefix_lengths = prefix_lengths.to(device=device, dtype=torch.long)
        if prefix_lengths.shape != anchors.shape:
            raise ValueError(f"prefix_lengths {tuple(prefix_lengths.shape)} must match anchors {tuple(anchors.shape)}")
        shown = k < prefix_lengths[:, :, None]  # [b, N, B]
        real = keep[:, :, None] & in_row & context_valid.gather(1, idx.flatten(1)).view_as(idx)
        block_ids = torch.where(shown & real, labels, torch.full_like(labels, int(mask_token_id)))
        sup = keep[:, :, None] & in_row & ~shown & lm.gather(1, idx.flatten(1)).view_as(idx)
        weights = sup.float() * prefix_decay_weights(prefix_lengths, block_size, gamma)
    return BlockPlan(
        anchors=anchors,
        keep=keep,
        block_ids=block_ids,
        block_positions=pos,
        labels=labels,
        supervised=sup,
        weights=weights,
        context_valid=context_valid,
        prefix_lengths=prefix_lengths,
    )


# ------------------------------------------------------------------------------------------ masks


def _context_visibility(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_valid: torch.Tensor,
    *,
    block_size: int,
    first_slot: int,
    layer_type: str,
    sliding_window: int | None,
) -> torch.Tensor:
    """Which context positions the queries of blocks at ``anchors`` see: bool ``[b, N, 1, S]`` for
    full layers (every slot of a block sees the same context), ``[b, N, B - first_slot, S]`` (slots
    ``first_slot..B-1``) for sliding layers.

    Context visibility is decided by the anchor's *position* (``c < a``), never by block index: blocks
    overlap in position, and index-based rules leak future context. Padding blocks see no context.
    """
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


def block_attention_mask(
    anchors: torch.Tensor,
    keep: torch.Tensor,
    context_valid: torch.Tensor,
    *,
    block_size: int,
    layer_type: str = FULL_ATTENTION,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense bool mask ``[b, 1, N*B, S + N*B]`` for blocks at ``anchors`` over context + the blocks.

    The layout of ``DFlashDrafter.forward`` (and SpecForge's sdpa path); training uses the grouped
    layout (``block_layouts``) with the same rules. Padding blocks see only their own block (no
    context), so no row is fully masked (sdpa would return NaN) and nothing else sees them.
    """
    b, n = anchors.shape
    ctx = _context_visibility(
        anchors,
        keep,
        context_valid,
        block_size=block_size,
        first_slot=0,
        layer_type=layer_type,
        sliding_window=sliding_window,
    )
    ctx = ctx.expand(b, n, block_size, ctx.shape[-1]).reshape(b, n * block_size, -1)
    within = _within_block(block_size, layer_type, sliding_window, anchors.device)
    blk = torch.arange(n, device=anchors.device)
    same_block = blk[:, None, None, None] == blk[None, None, :, None]  # [N, 1, N, 1]
    own = (same_block & within[None, :, None, :]).reshape(n * block_size, n * block_size)
    return torch.cat([ctx, own.expand(b, -1, -1)], dim=-1)[:, None]


# ------------------------------------------------------------------------------------------ grouping


@attrs.frozen
class ColumnBounds:
    """Host copy of what the grouped attention needs from the anchors, read in one transfer.

    Per block column n (over the batch rows, kept blocks only): ``hi[n]`` the largest anchor (-1 if no
    row keeps block n), ``lo[n]`` the smallest (``seq_len`` if none).
    """

    hi: list[int]
    lo: list[int]
    seq_len: int


def _read_bounds(
    anchors: torch.Tensor, keep: torch.Tensor, seq_len: int, counts: torch.Tensor | None = None
) -> tuple[ColumnBounds, int | None]:
    hi = torch.where(keep, anchors, torch.full_like(anchors, -1)).amax(dim=0)
    lo = torch.where(keep, anchors, torch.full_like(anchors, seq_len)).amin(dim=0)
    parts = [hi, lo] + ([counts.max().reshape(1)] if counts is not None else [])
    flat = torch.cat(parts).tolist()  # the step's only device->host read before the backward
    n = anchors.shape[1]
    count = int(flat[2 * n]) if counts is not None else None
    return ColumnBounds(hi=flat[:n], lo=flat[n : 2 * n], seq_len=seq_len), count


def group_spans(
    bounds: ColumnBounds,
    start: int,
    stop: int,
    *,
    group_blocks: int,
    layer_type: str,
    sliding_window: int | None,
) -> list[tuple[int, int, int, int]]:
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


# Measured on the project's 2-core CPU (torch 2.13, fp32, 2 threads): the flash kernel's forward +
# backward costs ~7 ns per query-key pair per row and head at head_dim 64; one group's fixed cost (its
# kernel calls, views, own-key writes and gradient adds, per layer) ~250 us. In units of
# (query-key pair x row x head x head_dim):
GROUP_FIXED_COST = 250e-6 / (7e-9 / 64)


def auto_group_blocks(bounds: ColumnBounds, start: int, stop: int, *, block_size: int, pair_cost: int) -> int:
    """Blocks per attention group for blocks ``start..stop-1``: the power of two with the least estimated
    time, ``pair_cost`` (rows x heads x head_dim) per visible-range query-key pair plus a fixed cost per
    group. Small groups skip more hidden context; each group costs a few kernel calls."""
    n = stop - start
    # Per group of `size` blocks: its context end (the largest anchor), by pairwise maxima as size doubles.
    ends = [max(0, min(h, bounds.seq_len)) for h in bounds.hi[start:stop]]
    best, best_cost, size = 1, None, 1
    while True:
        # Each query scores its group's context slice and its group's own keys (size * B).
        pairs = sum(
            min(size, n - i * size) * block_size * (end + min(size, n - i * size) * block_size)
            for i, end in enumerate(ends)
        )
        cost = pairs * pair_cost + len(ends) * GROUP_FIXED_COST
        if best_cost is None or cost < best_cost:
            best, best_cost = size, cost
        if size >= n:
            return min(best, n)
        ends = [max(ends[i : i + 2]) for i in range(0, len(ends), 2)]
        size *= 2


def block_layouts(
    plan: BlockPlan,
    spans: dict[str, list[tuple[int, int, int, int]]],
    start: int,
    stop: int,
    *,
    layer_types: list[str],
    sliding_window: int | None,
    dtype: torch.dtype,
    last_drops_first_slot: bool = False,
) -> list[BlockLayout]:
    """One ``BlockLayout`` per layer for blocks ``start..stop-1`` grouped by ``spans`` (``group_spans``,
    per layer type). Layers of a type share one layout (one mask per type and chunk).

    ``last_drops_first_slot``: the last layer computes no slot-0 queries (the loss never reads them).
    """
    bsz = plan.block_size
    b, n = plan.anchors.shape[0], stop - start
    seq = plan.context_valid.shape[1]
    made: dict[tuple[str, bool], BlockLayout] = {}
    last = len(layer_types) - 1
    for i, layer_type in enumerate(layer_types):
        drop = last_drops_first_slot and i == last
        if (layer_type, drop) in made:
            continue
        first = 1 if drop else 0
        per_block = bsz - first
        vis = _context_visibility(
            plan.anchors[:, start:stop],
            plan.keep[:, start:stop],
            plan.context_valid,
            block_size=bsz,
            first_slot=first,
            layer_type=layer_type,
            sliding_window=sliding_window,
        )
        scratch = max(n1 - n0 for n0, n1, _lo, _hi in spans[layer_type]) * bsz
        # Additive (sdpa would convert a bool mask in every call, forward and backward), in the key
        # layout [scratch | context]; each group's rows get its own-block pattern next to its slice.
        mask = torch.full((b, 1, n * per_block, scratch + seq), float("-inf"), dtype=dtype, device=vis.device)
        zero = torch.zeros((), dtype=dtype, device=vis.device)
        mask[:, 0, :, scratch:].view(b, n, per_block, seq).copy_(torch.where(vis, zero, float("-inf")))
        within = _within_block(bsz, layer_type, sliding_window, vis.device)[first:]
        own_patterns: dict[int, torch.Tensor] = {}
        groups, views = [], []
        for n0, n1, lo, hi in spans[layer_type]:
            q0, q1 = (n0 - start) * per_block, (n1 - start) * per_block
            m = n1 - n0
            if m not in own_patterns:  # block-diagonal: each block sees only itself
                own = torch.block_diag(*[within.to(dtype)] * m) > 0
                own_patterns[m] = torch.where(own, zero, float("-inf"))
            first_key = scratch + lo - m * bsz
            mask[:, 0, q0:q1, first_key : scratch + lo] = own_patterns[m]
            groups.append((q0, q1, lo, hi))
            views.append(mask.narrow(2, q0, q1 - q0).narrow(3, first_key, m * bsz + hi - lo))
        made[(layer_type, drop)] = BlockLayout(bsz, per_block, groups, scratch, mask, views)
    return [made[(t, last_drops_first_slot and i == last)] for i, t in enumerate(layer_types)]


# ------------------------------------------------------------------------------------------ forward


def _layer_spans(drafter, bounds, start, stop, group_blocks, rows):
    window = getattr(drafter.config, "sliding_window", None)
    attn = drafter.layers[0].self_attn
    g = group_blocks or auto_group_blocks(
        bounds, start, stop, block_size=drafter.block_size, pair_cost=rows * attn.num_heads * attn.head_dim
    )
    return {
        t: group_spans(bounds, start, stop, group_blocks=g, layer_type=t, sliding_window=window)
        for t in sorted(set(drafter.layer_types))
    }


def _decode_span(drafter, plan, embed_tokens, context_kv, start, stop, spans, dtype, drop_first_slot=False):
    """Normed drafter hidden states ``[b, n*B, H]`` of blocks ``start..stop-1`` (``[b, n*(B-1), H]``,
    slots 1..B-1, with ``drop_first_slot``)."""
    b = plan.anchors.shape[0]
    ids = plan.block_ids[:, start:stop]
    scale = float(getattr(drafter, "input_embedding_scale", 1.0))

    def embed(t):
        e = embed_tokens(t)
        return (e * scale if scale != 1.0 else e).to(dtype)

    noise = embed(ids.reshape(b, -1))
    # Slots 1..B-1 all hold the mask token (plan_blocks): the first layer works on N + 1 rows per row.
    # Not under the variable-prefix objective: its slots 1..l-1 hold real tokens.
    # Nor for a drafter whose slots interact outside attention (DFlash 2's in-block convolutions).
    rows = None
    if plan.prefix_lengths is None and getattr(drafter, "independent_slots", True):
        rows = SlotRows(embed(ids[:, :, 0]), embed(ids[:1, :1, 1]).reshape(-1))
    layouts = block_layouts(
        plan,
        spans,
        start,
        stop,
        layer_types=drafter.layer_types,
        sliding_window=getattr(drafter.config, "sliding_window", None),
        dtype=dtype,
        last_drops_first_slot=drop_first_slot,
    )
    positions = plan.block_positions[:, start:stop].reshape(b, -1)
    return drafter.decode_blocks(noise, context_kv, positions, layouts, rows)


def draft_block_hidden(
    drafter: nn.Module,
    plan: BlockPlan,
    *,
    embed_tokens: nn.Module,
    hidden_states: torch.Tensor,
    context: torch.Tensor | None = None,
    blocks: slice | None = None,
    group_blocks: int | None = None,
) -> torch.Tensor:
    """Training-path drafter hidden states ``[b, n*B, H]`` for the blocks in ``blocks`` (default all).

    ``group_blocks``: blocks per attention group (None: chosen from the anchors, ``auto_group_blocks``);
    any value gives the same result.
    """
    blocks = blocks or slice(0, plan.num_blocks)
    start, stop, _ = blocks.indices(plan.num_blocks)
    if context is None:
        context = drafter.fuse_context(hidden_states.to(drafter.dtype))
    bounds, _ = _read_bounds(plan.anchors, plan.keep, context.shape[1])
    spans = _layer_spans(drafter, bounds, start, stop, group_blocks, plan.anchors.shape[0])
    return _decode_span(
        drafter, plan, embed_tokens, drafter.context_kv(context), start, stop, spans, context.dtype
    )


def _chunk_terms(drafter, lm_head, embed_tokens, plan, start, stop, spans, *context_kv):
    """Weighted CE sum and argmax ``[b, n, B-1]`` of blocks ``start..stop-1``. Slot 0 is never
    supervised: the last layer computes no slot-0 queries and the head gets no slot-0 rows.

    A DFlash 2 drafter (``independent_slots`` False: its convolutions read neighbouring slots) computes
    every slot and drops slot 0 before the head; its selector adds ``dflash2.selector_terms`` (the
    weighted sum and weight of its loss, and ``[b, n, B-1]`` masks of selector hits and of true tokens
    among the candidates), teacher-forced with the true previous tokens."""
    kv = list(zip(context_kv[::2], context_kv[1::2], strict=True))
    independent = getattr(drafter, "independent_slots", True)
    h = _decode_span(
        drafter, plan, embed_tokens, kv, start, stop, spans, context_kv[0].dtype, drop_first_slot=independent
    )
    b, n, bsz = plan.anchors.shape[0], stop - start, plan.block_size
    if not independent:
        h = h.view(b, n, bsz, -1)[:, :, 1:]
    h = h.reshape(b * n * (bsz - 1), -1)
    logits = drafter.compute_logits(h, lm_head).float()
    labels = plan.labels[:, start:stop, 1:].reshape(-1)
    weights = plan.weights[:, start:stop, 1:].reshape(-1)
    ce = F.cross_entropy(logits, labels, reduction="none")
    terms = ((ce * weights).sum(), logits.argmax(dim=-1).view(b, n, bsz - 1))
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None:
        return terms
    from dflash_flow.model.dflash2 import selector_terms

    sel_sum, sel_weight, hits, present = selector_terms(
        selector,
        h,
        logits,
        labels,
        plan.labels[:, start:stop, :-1].reshape(-1),  # the true previous token of each slot
        weights,
        plan.supervised[:, start:stop, 1:].reshape(-1),
    )
    return (*terms, sel_sum, sel_weight, hits.view(b, n, bsz - 1), present.view(b, n, bsz - 1))


def _selector_extra(plan, parts, loss_sum, weight_sum, selector_sum, selector_weight):
    """DFlash 2's statistics as ``DFlashLossOutput.extra`` ratios: the two loss terms, the teacher-forced
    selector's accuracy, the share of supervised slots whose true token is a candidate (the ceiling of
    that accuracy), and the simulated acceptance of the selector's greedy walk (the run of its correct
    picks: along it the walk's predecessors are the true ones)."""
    hits = torch.cat([part[2] for part in parts], dim=1)  # [b, N, B-1]
    present = torch.cat([part[3] for part in parts], dim=1)
    supervised = plan.supervised[:, :, 1:].sum().float()
    if plan.prefix_lengths is None:
        run = hits.long().cumprod(dim=-1).sum(dim=-1)
    else:  # drafted from the first masked slot, as the DFlash acceptance above
        k = torch.arange(1, plan.block_size, device=hits.device)
        shown = k < plan.prefix_lengths[:, :, None]
        run = ((hits | shown).long().cumprod(dim=-1) * ~shown).sum(dim=-1)
    kept = plan.keep
    return {
        "dflash_loss": (loss_sum.detach(), weight_sum.detach()),
        "selector_loss": (selector_sum.detach(), selector_weight.detach()),
        "selector_accuracy": (hits.sum().float(), supervised),
        "candidate_recall": (present.sum().float(), supervised),
        "selector_accept_len": (((1 + run).float() * kept).sum(), kept.sum().float()),
    }


SELECTOR_EXTRAS = ("dflash_loss", "selector_loss", "selector_accuracy", "candidate_recall", "selector_accept_len")


def _check_block_settings(
    drafter: nn.Module, block_size: int | None, mask_token_id: int | None
) -> tuple[int, int]:
    cfg_block = getattr(drafter, "block_size", None)
    cfg_mask = getattr(drafter, "mask_token_id", None)
    if block_size is None:
        block_size = cfg_block
    elif cfg_block is not None and int(block_size) != int(cfg_block):
        raise ValueError(f"block_size {block_size} differs from the drafter config's {cfg_block}")
    if mask_token_id is None:
        mask_token_id = cfg_mask
    elif cfg_mask is not None and int(mask_token_id) != int(cfg_mask):
        raise ValueError(f"mask_token_id {mask_token_id} differs from the drafter config's {cfg_mask}")
    if block_size is None or mask_token_id is None:
        raise ValueError("block_size and mask_token_id are needed (none in the drafter config)")
    return int(block_size), int(mask_token_id)


def activation_bytes_per_block(drafter: nn.Module, *, vocab_size: int, context_len: int) -> int:
    """Estimated bytes one block of one row keeps for the backward when its chunk is not checkpointed.

    Per block token: each layer's saved activations (norm outputs, q/k/v, attention output, residuals,
    the MLP's gate/up/product), its attention mask row, and the fp32 logits with their log-softmax.
    An estimate for choosing chunks, within a factor ~2 of what the allocator sees.
    """
    cfg = drafter.config
    elem = torch.finfo(drafter.dtype).bits // 8
    h = int(cfg.hidden_size)
    heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    d = int(getattr(cfg, "head_dim", None) or h // heads)
    per_layer = elem * (6 * h + 2 * heads * d + 2 * kv * d + 4 * int(cfg.intermediate_size))
    # two context masks (all slots; the last layer without slot 0) and fp32 logits, log-softmax, grad
    per_token = len(drafter.layers) * per_layer + 2 * elem * context_len + 3 * 4 * int(vocab_size)
    selector = getattr(drafter, "candidate_selector", None)
    if selector is not None:  # DFlash 2: four convolutions per layer (in, out, taps), the candidates' codes
        per_token += len(drafter.layers) * elem * 16 * h + 4 * 3 * selector.top_k * selector.successor_codebook.shape[1]
    return per_token * drafter.block_size


def auto_chunk_blocks(
    drafter: nn.Module, *, batch: int, num_blocks: int, context_len: int, vocab_size: int, budget_mb: float
) -> int | None:
    """Blocks per checkpointed chunk under an activation budget; None when all blocks fit in one pass
    (no recomputation at all)."""
    per_block = batch * activation_bytes_per_block(drafter, vocab_size=vocab_size, context_len=context_len)
    fit = int(budget_mb * 2**20 // max(per_block, 1))
    return None if fit >= num_blocks else max(1, fit)


def dflash_loss(
    drafter: nn.Module,
    *,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    num_anchors: int = 512,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    gamma: float | None = 7.0,
    generator: torch.Generator | None = None,
    chunk_blocks: int | None = 128,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    activation_budget_mb: float | None = None,
    group_blocks: int | None = None,
    prefix_prior: PrefixPrior | None = None,
    prefix_lengths: torch.Tensor | None = None,
    selector_loss_weight: float = 1.0,
) -> DFlashLossOutput:
    """Token-weighted DFlash loss for one micro-batch.

    ``hidden_states`` ``[b, S, n*H]`` are the target features aligned 1:1 with ``input_ids`` (no shift).
    ``embed_tokens``/``lm_head`` are the target's frozen modules (the caller sets requires_grad=False);
    ``embed_tokens`` must be a plain lookup (z-lab uses ``F.embedding`` on the raw weight), any
    Gemma-style scaling comes from ``input_embedding_scale`` in the drafter config.
    ``chunk_blocks``: blocks per checkpointed chunk; None or 0 runs everything in one pass without
    checkpointing (more memory: activations and logits of all blocks are kept for the backward).
    ``activation_budget_mb``: when set, replaces ``chunk_blocks``: one pass if the estimated activations
    (``activation_bytes_per_block``) fit the budget, else the largest chunks that do.
    ``group_blocks``: blocks per attention group (None: from the anchors); only speed depends on it.
    ``anchors``: optional precomputed ``(anchors, keep)``, bypassing sampling (tests, evaluation).
    ``prefix_prior``: the variable-prefix objective (``PrefixPrior``): each block's visible prefix length
    is drawn from ``generator`` after the anchors; ``prefix_lengths`` ``[b, N]`` gives them instead
    (tests). Neither: the DFlash objective. Under it the simulated acceptance counts, per block, the bonus
    token and the run of correct drafts from the first masked slot ``l``; the extras ``prefix_length``
    (mean ``l`` of kept blocks) and ``sim_accept_len_prefix1`` (the acceptance of the blocks drawn with
    ``l = 1``, the inference regime) are reported beside it.
    ``selector_loss_weight``: a DFlash 2 drafter's loss is the DFlash loss plus this times its selector's
    (``dflash2`` module docstring); its statistics come in ``extra`` (``SELECTOR_EXTRAS``).
    ``block_size``/``mask_token_id`` default to the drafter config's; passing different values raises,
    because the exported config is what inference will use (pitfall 8).

    One device->host read per call before the backward (the block count and the anchors' column
    bounds, which set the attention shapes); ``DFlashLossOutput.metrics`` is the second.
    """
    block_size, mask_token_id = _check_block_settings(drafter, block_size, mask_token_id)
    if input_ids.shape != loss_mask.shape or hidden_states.shape[:2] != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)}, loss_mask {tuple(loss_mask.shape)} and hidden_states "
            f"{tuple(hidden_states.shape)} must share [batch, seq]"
        )
    n_feat = drafter.fc.in_features
    if hidden_states.shape[-1] != n_feat:
        raise ValueError(
            f"hidden_states carry {hidden_states.shape[-1]} features; the drafter expects {n_feat} "
            f"({len(drafter.target_layer_ids)} target layers {drafter.target_layer_ids} x hidden size)"
        )
    b, s = input_ids.shape
    device = input_ids.device
    if prefix_prior is not None:
        prefix_prior.bounds(block_size)  # a bad setting fails before anything is drawn
    if anchors is not None:
        anchors_t, keep = anchors
        bounds, _ = _read_bounds(anchors_t, keep, s)
    elif b and min(int(num_anchors), s) > 0:
        width = min(int(num_anchors), s)
        anchors_t, keep, counts = _anchor_candidates(
            loss_mask, width, attention_mask=attention_mask, generator=generator
        )
        bounds, count = _read_bounds(anchors_t, keep, s, counts)
        w = min(width, count)
        anchors_t, keep = anchors_t[:, :w], keep[:, :w]
        bounds = ColumnBounds(hi=bounds.hi[:w], lo=bounds.lo[:w], seq_len=s)
    else:
        anchors_t = torch.zeros(b, 0, dtype=torch.long, device=device)
        keep = anchors_t.bool()
        bounds = ColumnBounds(hi=[], lo=[], seq_len=s)
    if prefix_lengths is None and prefix_prior is not None:
        prefix_lengths = sample_prefix_lengths(
            keep.shape, prefix_prior, block_size=block_size, device=device, generator=generator
        )
    plan = plan_blocks(
        input_ids,
        loss_mask,
        anchors_t,
        keep,
        block_size=block_size,
        mask_token_id=mask_token_id,
        gamma=gamma,
        attention_mask=attention_mask,
        prefix_lengths=prefix_lengths,
    )
    n = plan.num_blocks
    if n == 0:
        # No supervised pair anywhere: a zero loss that still reaches every parameter, so a backward
        # (and data-parallel gradient reduction) works the same as for any other batch.
        zero = sum(p.sum() * 0.0 for p in drafter.parameters() if p.requires_grad)
        z = torch.zeros(block_size, device=device)
        extra = {}
        if plan.prefix_lengths is not None:
            extra = {name: (z.sum(), z.sum()) for name in ("prefix_length", "sim_accept_len_prefix1")}
        if getattr(drafter, "candidate_selector", None) is not None:
            extra.update({name: (z.sum(), z.sum()) for name in SELECTOR_EXTRAS})
        return DFlashLossOutput(zero, z.sum(), z, z.clone(), z.sum(), z.sum(), extra=extra)

    if activation_budget_mb is not None:
        chunk_blocks = auto_chunk_blocks(
            drafter,
            batch=b,
            num_blocks=n,
            context_len=s,
            vocab_size=int(getattr(lm_head, "out_features", None) or drafter.config.vocab_size),
            budget_mb=activation_budget_mb,
        )
    context = drafter.fuse_context(hidden_states.to(drafter.fc.weight.dtype))
    # Context keys/values once per layer: every chunk reads slices of them (checkpointing recomputes
    # the blocks only).
    context_kv = [t for kv in drafter.context_kv(context) for t in kv]
    grad = torch.is_grad_enabled()
    step = n if not chunk_blocks or chunk_blocks >= n else int(chunk_blocks)
    loss_sum = torch.zeros((), device=device)
    preds, selector_parts = [], []
    for start in range(0, n, step):
        stop = min(start + step, n)
        spans = _layer_spans(drafter, bounds, start, stop, group_blocks, plan.anchors.shape[0])
        args = (drafter, lm_head, embed_tokens, plan, start, stop, spans, *context_kv)
        if step < n and grad:
            part, pred, *selector = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            part, pred, *selector = _chunk_terms(*args)
        loss_sum = loss_sum + part
        preds.append(pred)
        if selector:  # DFlash 2: (loss sum, weight sum, hits, true token among the candidates)
            selector_parts.append(selector)
    pred = torch.cat(preds, dim=1) if len(preds) > 1 else preds[0]  # [b, N, B-1]

    weight_sum = plan.weights.sum()
    loss = loss_sum / weight_sum.clamp(min=1e-6)
    if selector_parts:
        # Summed over chunks, divided once: chunked and one-pass give the same loss and gradients.
        selector_sum = sum(part[0] for part in selector_parts)
        selector_weight = sum(part[1] for part in selector_parts)
        loss = loss + float(selector_loss_weight) * selector_sum / selector_weight.clamp(min=1e-6)
    with torch.no_grad():
        sup = plan.supervised
        hits = (pred == plan.labels[:, :, 1:]) & sup[:, :, 1:]
        correct = torch.cat([torch.zeros_like(hits[:, :, :1]), hits], dim=-1)
        correct_per_pos = correct.sum(dim=(0, 1)).float()
        sup_per_pos = sup.sum(dim=(0, 1)).float()
        # Acceptance: the run of consecutive correct slots from k=1; an unsupervised slot ends the run.
        # Variable prefix: from the first masked slot l (slots 1..l-1 are given, not drafted).
        extra = {}
        kept = plan.keep
        if plan.prefix_lengths is None:
            run = hits.long().cumprod(dim=-1).sum(dim=-1)
        else:
            lengths = plan.prefix_lengths
            shown = torch.arange(1, block_size, device=device) < lengths[:, :, None]
            run = ((hits | shown).long().cumprod(dim=-1) * ~shown).sum(dim=-1)
            first = kept & (lengths == 1)
            extra = {
                "prefix_length": ((lengths * kept).sum().float(), kept.sum().float()),
                "sim_accept_len_prefix1": (((1 + run).float() * first).sum(), first.sum().float()),
            }
        acceptance_sum = ((1 + run).float() * kept).sum()
        kept_blocks = kept.sum().float()
        if selector_parts:
            extra.update(_selector_extra(plan, selector_parts, loss_sum, weight_sum, selector_sum, selector_weight))
    return DFlashLossOutput(
        loss=loss,
        weight_sum=weight_sum.detach(),
        correct_per_position=correct_per_pos,
        supervised_per_position=sup_per_pos,
        acceptance_sum=acceptance_sum,
        kept_blocks=kept_blocks,
        extra=extra,
    )


__all__ = [
    "BlockPlan",
    "ColumnBounds",
    "DFlashLossOutput",
    "PrefixPrior",
    "activation_bytes_per_block",
    "auto_chunk_blocks",
    "auto_group_blocks",
    "block_attention_mask",
    "decay_weights",
    "dflash_loss",
    "draft_block_hidden",
    "group_spans",
    "plan_blocks",
    "prefix_decay_weights",
    "sample_anchors",
    "sample_prefix_lengths",
    "valid_anchor_mask",
]
