"""Which blocks a step trains: anchors drawn per row, the block plan (tokens, positions, labels, supervised
slots, decay weights), and the variable-prefix objective's prior over visible prefix lengths. Pure functions
of the batch and a generator; nothing here knows the drafter (``model.objective`` runs it)."""

from __future__ import annotations

import attrs
import torch

from dflash_flow.model.strategies import VariablePrefix


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


def valid_anchor_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, S]`` bool: i is a valid anchor iff positions i and i+1 are both supervised (and not padding)."""
    lm = loss_mask.bool()
    if attention_mask is not None:
        lm = lm & attention_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return valid


def anchor_candidates(loss_mask: torch.Tensor, width: int, *, attention_mask: torch.Tensor | None,
                      generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``width`` sorted anchors per row, padding last, and the valid counts; no device->host read. A uniform
    random subset is the smallest of i.i.d. uniform keys (invalid positions get key 2: padding, picked only
    when a row runs out of valid ones); any prefix is what a smaller ``width`` draws from the same state."""
    valid = valid_anchor_mask(loss_mask, attention_mask)
    b, s = valid.shape
    device = valid.device
    draw_on = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(b, s, generator=generator, device=draw_on).to(device)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))
    picked = torch.topk(keys, width, dim=1, largest=False).indices
    keep = valid.gather(1, picked)
    order = torch.where(keep, picked, picked + s).argsort(dim=1)
    anchors = picked.gather(1, order)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    return anchors, keep, valid.sum(dim=1)


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, *, attention_mask: torch.Tensor | None = None,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(anchors [b, W] long, keep [b, W] bool)``: ``W = min(num_anchors, max #valid)`` anchors per row,
    uniformly without replacement, sorted; rows with fewer valid positions padded at the end (anchor 0, keep
    False). Keys are drawn on ``generator``'s device (CPU without one: the same anchors on any device)."""
    b, s = loss_mask.shape
    width = min(int(num_anchors), s)
    if b == 0 or width <= 0:
        empty = torch.zeros(b, 0, dtype=torch.long, device=loss_mask.device)
        return empty, empty.bool()
    anchors, keep, counts = anchor_candidates(loss_mask, width, attention_mask=attention_mask, generator=generator)
    w = min(width, int(counts.max().item()))  # the block count sets every shape after it
    return anchors[:, :w], keep[:, :w]


def decay_weights(block_size: int, gamma: float | None, *, device: torch.device | None = None) -> torch.Tensor:
    """Per-slot loss weights ``[B]``: :func:`prefix_decay_weights` at ``l = 1`` (0 on slot 0, never supervised)."""
    return prefix_decay_weights(torch.ones(1, dtype=torch.long, device=device), block_size, gamma)[0]


@attrs.frozen(kw_only=True)
class PrefixPrior:
    """The variable-prefix objective's prior over a block's visible prefix length ``l`` (D2SD VP-Drafter, as
    NeMo AutoModel's ``loss_type: variable_prefix``): ``Pr(l) ~ weight_base ** l`` on ``min_length..max_length``.
    Slots ``0..l-1`` hold real tokens, the masked rest is supervised; ``l = 1`` is DFlash's block.
    ``max_length`` None: ``B - 1``. The default starts at 1 (not NeMo's 2): inference drafts with ``l = 1``."""

    weight_base: float = 0.9
    min_length: int = 1
    max_length: int | None = None

    def bounds(self, block_size: int) -> tuple[int, int]:
        """``(lo, hi)``: the support of the prior for blocks of ``block_size``; raises on a bad setting
        (the objective's own check, ``strategies.VariablePrefix.block_problems``)."""
        return VariablePrefix(prefix_weight_base=self.weight_base, prefix_min_length=self.min_length,
                              prefix_max_length=self.max_length).bounds(block_size)

    def probabilities(self, block_size: int) -> torch.Tensor:
        """``[hi - lo + 1]`` float64 on the CPU: ``Pr(l)`` for ``l = lo..hi`` (relative to the first term, so
        large bases or long blocks cannot overflow)."""
        lo, hi = self.bounds(block_size)
        w = torch.tensor([float(self.weight_base) ** (n - lo) for n in range(lo, hi + 1)], dtype=torch.float64)
        return w / w.sum()


def sample_prefix_lengths(shape: tuple[int, int] | torch.Size, prior: PrefixPrior, *, block_size: int,
                          device: torch.device | str | None = None,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """Visible prefix lengths ``[b, N]`` long, i.i.d. from ``prior`` by inverse CDF of one uniform each, drawn
    on ``generator``'s device (CPU without one) like the anchor keys, then moved to ``device``."""
    lo, hi = prior.bounds(block_size)
    draw_on = generator.device if generator is not None else torch.device("cpu")
    cdf = prior.probabilities(block_size).cumsum(0).to(draw_on)
    u = torch.rand(tuple(shape), generator=generator, device=draw_on, dtype=torch.float64)
    idx = torch.searchsorted(cdf, u, right=True).clamp(max=hi - lo)
    return (idx + lo).to(device if device is not None else draw_on)


def prefix_decay_weights(prefix_lengths: torch.Tensor, block_size: int, gamma: float | None) -> torch.Tensor:
    """``[b, N, B]`` weights of the variable-prefix objective: 0 on the visible slots ``k < l``, then
    ``exp(-(k-l)/gamma)`` (the decay re-anchored at the prefix boundary; ``gamma`` None or <= 0: no decay, 1)."""
    k = torch.arange(block_size, device=prefix_lengths.device, dtype=torch.float32)
    shift = k - prefix_lengths[..., None].to(torch.float32)
    if gamma is None or gamma <= 0:
        w = torch.ones_like(shift)
    else:
        w = torch.exp(-shift.clamp(min=0.0) / float(gamma))
    return torch.where(shift >= 0, w, torch.zeros_like(w))


def plan_blocks(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, keep: torch.Tensor,
                *, block_size: int, mask_token_id: int, gamma: float | None = 7.0,
                attention_mask: torch.Tensor | None = None,
                prefix_lengths: torch.Tensor | None = None) -> BlockPlan:
    """Block inputs, positions, same-position labels and loss weights for given anchors. ``prefix_lengths``
    ``[b, N]`` (variable prefix): block n shows the real tokens at ``a..a+l-1`` (the mask token past the row or on
    padding) and supervises slots ``k >= l``, weighted ``exp(-(k-l)/gamma)``; None: ``l = 1``."""
    b, s = input_ids.shape
    device = input_ids.device
    k = torch.arange(block_size, device=device)
    pos = anchors[:, :, None] + k  # [b, N, B]
    in_row = pos < s
    idx = pos.clamp(max=s - 1)
    labels = input_ids.gather(1, idx.flatten(1)).view_as(idx)
    context_valid = attention_mask.bool() if attention_mask is not None else torch.ones(b, s, dtype=torch.bool,
                                                                                          device=device)
    lm = loss_mask.bool() & context_valid
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
    return BlockPlan(anchors=anchors, keep=keep, block_ids=block_ids, block_positions=pos, labels=labels,
                     supervised=sup, weights=weights, context_valid=context_valid, prefix_lengths=prefix_lengths)
