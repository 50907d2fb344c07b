"""The DFlash training objective (SpecForge ``OnlineDFlashModel``, loss "dflash").

Per row, up to ``num_anchors`` anchors are drawn among positions ``i`` with ``loss_mask[i]`` and
``loss_mask[i+1]``. Each anchor opens a block ``[input_ids[a], MASK x (B-1)]`` at positions ``a..a+B-1``.
A block sees the target features of positions strictly before its anchor (the anchor's own feature is
not available at inference: it is the bonus token being verified) and the keys of its own block
(all of them in full-attention layers, offsets <= j in sliding layers). Slot k is supervised with the
token at ``a+k`` (same-position labels, slot 0 excluded), weighted by ``exp(-(k-1)/gamma)``.

Blocks never see each other, so the batch of blocks can be cut into chunks that run independently:
each chunk runs drafter + LM head + cross-entropy under activation checkpointing, so the logits of
only one chunk exist at a time, in the forward and in the backward.
"""

from __future__ import annotations

import math

import attrs
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_flow.model.drafter import FULL_ATTENTION, SLIDING_ATTENTION


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
        """Mean over kept blocks of ``1 + sum_k prod_{j<=k} [argmax_j == t_j]`` (the bonus token counts)."""
        n = self.kept_blocks.item()
        return float(self.acceptance_sum.item() / n) if n else 0.0

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """All statistics as floats, fetched from the device in one transfer."""
        flat = torch.cat(
            [
                self.loss.detach().float().reshape(1),
                self.acceptance_sum.float().reshape(1),
                self.kept_blocks.float().reshape(1),
                self.correct_per_position.float(),
                self.supervised_per_position.float(),
            ]
        ).tolist()
        loss, accept, blocks = flat[:3]
        block = self.correct_per_position.numel()
        correct, supervised = flat[3 : 3 + block], flat[3 + block :]
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
        return out


def valid_anchor_mask(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[b, S]`` bool: i is a valid anchor iff positions i and i+1 are both supervised (and not padding)."""
    lm = loss_mask.bool()
    if attention_mask is not None:
        lm = lm & attention_mask.bool()
    valid = torch.zeros_like(lm)
    valid[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return valid


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
    valid = valid_anchor_mask(loss_mask, attention_mask)
    b, s = valid.shape
    device = valid.device
    counts = valid.sum(dim=1)
    w = min(int(num_anchors), int(counts.max().item()) if b else 0)
    if w <= 0:
        empty = torch.zeros(b, 0, dtype=torch.long, device=device)
        return empty, empty.bool()
    # A uniformly random subset = the w smallest of i.i.d. uniform keys; invalid positions get key 2 so
    # they are only picked when a row runs out of valid ones.
    draw_on = generator.device if generator is not None else torch.device("cpu")
    keys = torch.rand(b, s, generator=generator, device=draw_on).to(device)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))
    picked = torch.topk(keys, w, dim=1, largest=False).indices
    keep = valid.gather(1, picked)
    # Sort kept anchors ascending and push padding to the end.
    order_key = torch.where(keep, picked, picked + s)
    order = order_key.argsort(dim=1)
    anchors = picked.gather(1, order)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, anchors, torch.zeros_like(anchors))
    return anchors, keep


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
) -> BlockPlan:
    """Block inputs, positions, same-position labels and loss weights for given anchors."""
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
    sup = keep[:, :, None] & in_row & (k >= 1) & lm.gather(1, idx.flatten(1)).view_as(idx)
    if gamma is None or gamma <= 0:
        decay = torch.ones(block_size, device=device)
    else:
        decay = torch.exp(-(k.float() - 1.0).clamp(min=0.0) / float(gamma))
    weights = sup.float() * decay
    block_ids = torch.full_like(pos, int(mask_token_id))
    first = input_ids.gather(1, anchors)
    block_ids[:, :, 0] = torch.where(keep, first, torch.full_like(first, int(mask_token_id)))
    context_valid = (
        attention_mask.bool()
        if attention_mask is not None
        else torch.ones(b, s, dtype=torch.bool, device=device)
    )
    return BlockPlan(
        anchors=anchors,
        keep=keep,
        block_ids=block_ids,
        block_positions=pos,
        labels=labels,
        supervised=sup,
        weights=weights,
        context_valid=context_valid,
    )


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

    Context visibility is decided by the anchor's *position* (``c < a``), never by block index: blocks
    overlap in position, and index-based rules leak future context. Padding blocks see only their own
    block (no context), so no row is fully masked (sdpa would return NaN) and nothing else sees them.
    """
    b, n = anchors.shape
    s = context_valid.shape[1]
    device = anchors.device
    j = torch.arange(block_size, device=device)
    c = torch.arange(s, device=device)
    a = anchors[:, :, None, None]  # [b, N, 1, 1]
    ctx = (c < a) & keep[:, :, None, None] & context_valid[:, None, None, :]  # [b, N, 1, S]
    ctx = ctx.expand(b, n, block_size, s)
    if layer_type == SLIDING_ATTENTION:
        if sliding_window is None:
            raise ValueError("sliding_attention needs sliding_window")
        # Query at a+j sees positions p with a+j-p < W (inference applies the window by key position).
        ctx = ctx & (c >= a + j[:, None] - (sliding_window - 1))
        within = (j[None, :] <= j[:, None]) & (j[:, None] - j[None, :] < sliding_window)  # [q_j, k_j]
    elif layer_type == FULL_ATTENTION:
        within = torch.ones(block_size, block_size, dtype=torch.bool, device=device)
    else:
        raise ValueError(f"unknown layer type {layer_type!r}")
    blk = torch.arange(n, device=device)
    same_block = blk[:, None, None, None] == blk[None, None, :, None]  # [N, 1, N, 1]
    own = same_block & within[None, :, None, :]  # [N, B, N, B]
    own = own.reshape(n * block_size, n * block_size)
    mask = torch.cat([ctx.reshape(b, n * block_size, s), own.expand(b, -1, -1)], dim=-1)
    return mask[:, None]


def _layer_masks(drafter: nn.Module, anchors, keep, context_valid, block_size) -> dict[str, torch.Tensor]:
    types = sorted(set(drafter.layer_types))
    window = getattr(drafter.config, "sliding_window", None)
    return {
        t: block_attention_mask(
            anchors, keep, context_valid, block_size=block_size, layer_type=t, sliding_window=window
        )
        for t in types
    }


def draft_block_hidden(
    drafter: nn.Module,
    plan: BlockPlan,
    *,
    embed_tokens: nn.Module,
    hidden_states: torch.Tensor,
    context: torch.Tensor | None = None,
    blocks: slice | None = None,
) -> torch.Tensor:
    """Training-path drafter hidden states ``[b, n*B, H]`` for the blocks in ``blocks`` (default all)."""
    blocks = blocks or slice(0, plan.num_blocks)
    if context is None:
        context = drafter.fuse_context(hidden_states)
    b, s = context.shape[:2]
    bsz = plan.block_size
    anchors, keep = plan.anchors[:, blocks], plan.keep[:, blocks]
    ids = plan.block_ids[:, blocks].reshape(b, -1)
    noise = embed_tokens(ids)
    scale = float(getattr(drafter, "input_embedding_scale", 1.0))
    if scale != 1.0:
        noise = noise * scale
    noise = noise.to(context.dtype)
    ctx_pos = torch.arange(s, device=context.device).expand(b, s)
    positions = torch.cat([ctx_pos, plan.block_positions[:, blocks].reshape(b, -1)], dim=1)
    masks = _layer_masks(drafter, anchors, keep, plan.context_valid, bsz)
    return drafter.decode(noise, context, positions, masks)


def _chunk_loss(drafter, lm_head, embed_tokens, plan, hidden_states, context, blocks):
    h = draft_block_hidden(
        drafter, plan, embed_tokens=embed_tokens, hidden_states=hidden_states, context=context, blocks=blocks
    )
    logits = drafter.compute_logits(h, lm_head).float()
    labels = plan.labels[:, blocks].reshape(-1)
    weights = plan.weights[:, blocks].reshape(-1)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels, reduction="none")
    pred = logits.argmax(dim=-1)
    return (ce * weights).sum(), pred


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
) -> DFlashLossOutput:
    """Token-weighted DFlash loss for one micro-batch.

    ``hidden_states`` ``[b, S, n*H]`` are the target features aligned 1:1 with ``input_ids`` (no shift).
    ``embed_tokens``/``lm_head`` are the target's frozen modules (the caller sets requires_grad=False);
    ``embed_tokens`` must be a plain lookup (z-lab uses ``F.embedding`` on the raw weight), any
    Gemma-style scaling comes from ``input_embedding_scale`` in the drafter config.
    ``chunk_blocks``: blocks per checkpointed chunk; None or 0 runs everything in one pass without
    checkpointing (more memory: logits of all blocks are kept for the backward).
    ``anchors``: optional precomputed ``(anchors, keep)``, bypassing sampling (tests, evaluation).
    ``block_size``/``mask_token_id`` default to the drafter config's; passing different values raises,
    because the exported config is what inference will use (pitfall 8).
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
    if anchors is None:
        anchors_t, keep = sample_anchors(
            loss_mask, num_anchors, attention_mask=attention_mask, generator=generator
        )
    else:
        anchors_t, keep = anchors
    plan = plan_blocks(
        input_ids,
        loss_mask,
        anchors_t,
        keep,
        block_size=block_size,
        mask_token_id=mask_token_id,
        gamma=gamma,
        attention_mask=attention_mask,
    )
    device = input_ids.device
    n = plan.num_blocks
    if n == 0:
        # No supervised pair anywhere: a zero loss that still reaches every parameter, so a backward
        # (and data-parallel gradient reduction) works the same as for any other batch.
        zero = sum(p.sum() * 0.0 for p in drafter.parameters() if p.requires_grad)
        z = torch.zeros(block_size, device=device)
        return DFlashLossOutput(zero, z.sum(), z, z.clone(), z.sum(), z.sum())

    context = drafter.fuse_context(hidden_states.to(drafter.fc.weight.dtype))
    grad = torch.is_grad_enabled()
    step = n if not chunk_blocks or chunk_blocks >= n else int(chunk_blocks)
    loss_sum = torch.zeros((), device=device)
    preds = []
    for start in range(0, n, step):
        blocks = slice(start, min(start + step, n))
        if step < n and grad:
            part, pred = checkpoint(
                _chunk_loss,
                drafter,
                lm_head,
                embed_tokens,
                plan,
                hidden_states,
                context,
                blocks,
                use_reentrant=False,
            )
        else:
            part, pred = _chunk_loss(drafter, lm_head, embed_tokens, plan, hidden_states, context, blocks)
        loss_sum = loss_sum + part
        preds.append(pred.view(input_ids.shape[0], -1, block_size))
    pred = torch.cat(preds, dim=1)

    weight_sum = plan.weights.sum()
    loss = loss_sum / weight_sum.clamp(min=1e-6)
    with torch.no_grad():
        sup = plan.supervised
        correct = (pred == plan.labels) & sup
        correct_per_pos = correct.sum(dim=(0, 1)).float()
        sup_per_pos = sup.sum(dim=(0, 1)).float()
        # Acceptance: the run of consecutive correct slots from k=1; an unsupervised slot ends the run.
        run = correct[:, :, 1:].long().cumprod(dim=-1).sum(dim=-1)
        kept = plan.keep
        acceptance_sum = ((1 + run).float() * kept).sum()
        kept_blocks = kept.sum().float()
    return DFlashLossOutput(
        loss=loss,
        weight_sum=weight_sum.detach(),
        correct_per_position=correct_per_pos,
        supervised_per_position=sup_per_pos,
        acceptance_sum=acceptance_sum,
        kept_blocks=kept_blocks,
    )


def decay_weights(block_size: int, gamma: float | None) -> list[float]:
    """Per-slot loss weights (slot 0 is never supervised): ``[0, 1, e^{-1/g}, ...]``."""
    if gamma is None or gamma <= 0:
        return [0.0] + [1.0] * (block_size - 1)
    return [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, block_size)]


__all__ = [
    "BlockPlan",
    "DFlashLossOutput",
    "block_attention_mask",
    "decay_weights",
    "dflash_loss",
    "draft_block_hidden",
    "plan_blocks",
    "sample_anchors",
    "valid_anchor_mask",
]
