"""The DFlash loss's plan: which blocks a micro-batch trains, drawn before the drafter runs.

``host_plan`` draws the anchors (and the variable prefix's visible lengths) from the batch's host rows, so the
shapes they set are known without reading the device (the trainer's path); ``draw_plan`` draws them on the
batch's own device (or takes given ones) and builds the ``blockplan.BlockPlan`` with the column bounds that
set the attention shapes. The drafter's config fixes the block size and the mask token (``block_settings``).
"""

from __future__ import annotations

import attrs
import numpy as np
import torch
from torch import nn

from dflash_flow.model.blockplan import (
    BlockPlan,
    PrefixPrior,
    anchor_candidates,
    plan_blocks,
    sample_prefix_lengths,
)
from dflash_flow.model.layout import ColumnBounds, read_bounds

__all__ = ["HostPlan", "block_settings", "check_inputs", "draw_plan", "host_plan"]


@attrs.frozen
class HostPlan:
    """A micro-batch's anchors drawn on the host from its loss mask as the Padder left it (pinned CPU memory):
    the shapes they set (the block count, each column's bounds) are known without reading the device.
    ``dflash_loss(host_plan=...)`` copies them over without blocking; the same generator draws exactly what
    ``dflash_loss`` draws itself from a loss mask on the CPU."""

    anchors: torch.Tensor  # [b, W] long, CPU
    keep: torch.Tensor  # [b, W] bool, CPU
    bounds: ColumnBounds
    prefix_lengths: torch.Tensor | None = None  # [b, W] long, CPU (the variable-prefix objective)


def host_plan(
    loss_mask: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    num_anchors: int,
    block_size: int,
    generator: torch.Generator | None,
    prefix_prior: PrefixPrior | None = None,
) -> HostPlan:
    """The anchors (and visible prefix lengths) ``dflash_loss`` would draw from ``generator``, drawn here from CPU
    tensors; their bounds are read from host memory (numpy), never from a device."""
    if loss_mask.device.type != "cpu" or (attention_mask is not None and attention_mask.device.type != "cpu"):
        raise ValueError("host_plan draws from the batch's host rows: pass the CPU loss and attention masks")
    b, s = loss_mask.shape
    if prefix_prior is not None:
        prefix_prior.bounds(block_size)
    width = min(int(num_anchors), s)
    if b and width > 0:
        anchors, keep, counts = anchor_candidates(loss_mask, width, attention_mask=attention_mask, generator=generator)
        a, k = anchors.numpy(), keep.numpy()
        w = min(width, int(counts.numpy().max()))
        anchors, keep = anchors[:, :w], keep[:, :w]
        bounds = ColumnBounds(hi=np.where(k, a, -1).max(axis=0)[:w].tolist(),
                              lo=np.where(k, a, s).min(axis=0)[:w].tolist(), seq_len=s)
    else:
        anchors = torch.zeros(b, 0, dtype=torch.long)
        keep = anchors.bool()
        bounds = ColumnBounds(hi=[], lo=[], seq_len=s)
    lengths = None
    if prefix_prior is not None:
        lengths = sample_prefix_lengths(keep.shape, prefix_prior, block_size=block_size, device="cpu",
                                        generator=generator)
    return HostPlan(anchors, keep, bounds, lengths)


def _to_device(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A host tensor on ``device``: through pinned memory without blocking on CUDA (no stream sync)."""
    if t is None or t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)



def block_settings(drafter: nn.Module, block_size: int | None, mask_token_id: int | None) -> tuple[int, int]:
    """The block size and mask token: the drafter config's; a different value given raises, because the
    exported config is what inference will use (pitfall 8)."""
    cfg_block, cfg_mask = drafter.block_size, drafter.mask_token_id
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


def check_inputs(drafter: nn.Module, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                 hidden_states: torch.Tensor) -> None:
    """The batch's tensors share [batch, seq] and carry the features the drafter fuses."""
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


def _anchors(input_ids, loss_mask, attention_mask, num_anchors, generator, anchors, host):
    """(anchors, keep, bounds, prefix lengths or None) from a host plan, given anchors, or drawn here."""
    b, s = input_ids.shape
    device = input_ids.device
    if host is not None:
        bounds = host.bounds
        return (_to_device(host.anchors, device), _to_device(host.keep, device), bounds,
                _to_device(host.prefix_lengths, device))
    if anchors is not None:
        anchors_t, keep = anchors
        return anchors_t, keep, read_bounds(anchors_t, keep, s)[0], None
    width = min(int(num_anchors), s)
    if b and width > 0:
        anchors_t, keep, counts = anchor_candidates(loss_mask, width, attention_mask=attention_mask, generator=generator)
        bounds, count = read_bounds(anchors_t, keep, s, counts)
        w = min(width, count)
        return anchors_t[:, :w], keep[:, :w], ColumnBounds(hi=bounds.hi[:w], lo=bounds.lo[:w], seq_len=s), None
    anchors_t = torch.zeros(b, 0, dtype=torch.long, device=device)
    return anchors_t, anchors_t.bool(), ColumnBounds(hi=[], lo=[], seq_len=s), None


def draw_plan(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    block_size: int,
    mask_token_id: int,
    gamma: float | None,
    attention_mask: torch.Tensor | None = None,
    num_anchors: int = 512,
    generator: torch.Generator | None = None,
    prefix_prior: PrefixPrior | None = None,
    anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
    prefix_lengths: torch.Tensor | None = None,
    host: HostPlan | None = None,
) -> tuple[BlockPlan, ColumnBounds]:
    """The micro-batch's block plan and its anchors' column bounds. ``host``: drawn on the host already
    (``host_plan``; nothing is read from the device), replacing ``anchors``, ``generator``'s draws and
    ``prefix_lengths``; ``anchors``: given ``(anchors, keep)`` (tests, evaluation); else drawn from
    ``generator`` (one device->host read: the block count and the bounds). ``prefix_prior``: the variable
    prefix's visible lengths drawn after the anchors, unless ``prefix_lengths`` gives them."""
    if prefix_prior is not None:
        prefix_prior.bounds(block_size)  # a bad setting fails before anything is drawn
    anchors_t, keep, bounds, drawn = _anchors(input_ids, loss_mask, attention_mask, num_anchors, generator, anchors,
                                              host)
    if host is not None:
        prefix_lengths = drawn
    if prefix_lengths is None and prefix_prior is not None:
        prefix_lengths = sample_prefix_lengths(
            keep.shape, prefix_prior, block_size=block_size, device=input_ids.device, generator=generator
        )
    plan = plan_blocks(input_ids, loss_mask, anchors_t, keep, block_size=block_size, mask_token_id=mask_token_id,
                       gamma=gamma, attention_mask=attention_mask, prefix_lengths=prefix_lengths)
    return plan, bounds
