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
* the anchors and the bounds that set the shapes are drawn from the batch's host rows (``host_plan``; the
  trainer's path): nothing is read from the device before the backward; ``DFlashLossOutput.stat_vector`` keeps
  the statistics on the device, so a trainer reads them once per optimizer step (otherwise ``dflash_loss``
  reads the block count and bounds once, and ``DFlashLossOutput.metrics`` once more).
"""


from __future__ import annotations

import attrs
import numpy as np
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_flow.model.blockplan import (
    BlockPlan,
    PrefixPrior,
    anchor_candidates,
    decay_weights,
    plan_blocks,
    prefix_decay_weights,
    sample_anchors,
    sample_prefix_lengths,
    valid_anchor_mask,
)
from dflash_flow.model.drafter_layers import SlotRows, maybe_compiled
from dflash_flow.model.fused import weighted_cross_entropy
from dflash_flow.model.layout import (  # noqa: F401 - re-exported
    SDPA_GROUP_FIXED_COST,
    SDPA_MAX_GROUPS,
    SPLIT_KEY_COST,
    ColumnBounds,
    Grouping,
    activation_bytes_per_block,
    auto_chunk_blocks,
    auto_group_blocks,
    block_attention_mask,
    block_layouts,
    group_spans,
    read_bounds,
    split_pays,
    uses_sdpa,
)
from dflash_flow.model.strategies import DFlash2, VariablePrefix

# The block plan and the layouts live in model.blockplan and model.layout; these names are re-exported for
# the callers of the objective.
__all__ = [
    "BlockPlan", "ColumnBounds", "DFlashLossOutput", "PrefixPrior", "activation_bytes_per_block", "auto_chunk_blocks",
    "auto_group_blocks", "block_attention_mask", "block_layouts", "decay_weights", "dflash_loss", "draft_block_hidden",
    "group_spans", "plan_blocks", "prefix_decay_weights", "sample_anchors", "sample_prefix_lengths",
    "valid_anchor_mask",
]


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
        """The scalar statistics (the per-slot accuracies are :meth:`values`' typed sequence), from :meth:`values`."""
        scalars, _positions = self.values()
        return {f"{prefix}{k}": v for k, v in scalars.items()}

    @property
    def stat_names(self) -> list[str]:
        """The names of :meth:`stat_vector`'s scalar entries, in order (the per-slot accuracies follow them)."""
        return ["loss", "accuracy", "acceptance_length", "num_tokens", "num_blocks", *self.extra]

    def stat_vector(self) -> torch.Tensor:
        """:meth:`values` as one tensor on the statistics' device, read nowhere: the scalars (``stat_names``) then
        the accuracy of slots k = 1..B-1, in float64 (float32 on MPS), with the arithmetic of :meth:`values`
        (each input rounded to float32 first, a ratio 0 where its denominator is 0), so a caller can sum the
        micro-batches of a step on the device and read them once."""
        wide = torch.float32 if self.loss.device.type == "mps" else torch.float64

        def f(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().to(wide).reshape(-1)

        def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
            return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))

        correct, supervised = f(self.correct_per_position), f(self.supervised_per_position)
        total, blocks = supervised.sum().reshape(1), f(self.kept_blocks)
        parts = [f(self.loss), ratio(correct.sum().reshape(1), total), ratio(f(self.acceptance_sum), blocks), total,
                 blocks]
        parts += [ratio(f(num), f(den)) for num, den in self.extra.values()]
        parts.append(ratio(correct[1:], supervised[1:]))
        return torch.cat(parts)

    def values(self) -> tuple[dict[str, float], list[float]]:
        """(scalar statistics, accuracy of slots k = 1..B-1), fetched from the device in one transfer."""
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
            "loss": loss,
            "accuracy": sum(correct) / total if total else 0.0,
            "acceptance_length": accept / blocks if blocks else 0.0,
            "num_tokens": total,
            "num_blocks": blocks,
        }
        for i, name in enumerate(names):
            num, den = ratios[2 * i], ratios[2 * i + 1]
            out[name] = num / den if den else 0.0
        positions = [correct[k] / supervised[k] if supervised[k] else 0.0 for k in range(1, block)]
        return out, positions



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


def _layer_spans(drafter, bounds, start, stop, group_blocks, rows) -> Grouping:
    """Attention groups per layer type (``group_spans``) and which layer types take the split attention.

    The form is decided on the block form's groups (``auto_group_blocks``, or ``group_blocks``): the split
    attention where ``split_pays`` and the layers run it (CPU). Unless ``group_blocks`` is given, the split
    layer types are then regrouped by the split form's own cost (``key_cost``: its groups score no own
    keys, so larger groups pay there)."""
    window = getattr(drafter.config, "sliding_window", None)
    attn = drafter.layers[0].self_attn
    bsz = drafter.block_size

    def spans_of(g):
        return {
            t: group_spans(bounds, start, stop, group_blocks=g, layer_type=t, sliding_window=window)
            for t in sorted(set(drafter.layer_types))
        }

    pair_cost = rows * attn.num_heads * attn.head_dim
    sdpa = uses_sdpa(drafter)
    costs = {"fixed_cost": SDPA_GROUP_FIXED_COST, "max_groups": SDPA_MAX_GROUPS} if sdpa else {}
    spans = spans_of(group_blocks or auto_group_blocks(bounds, start, stop, block_size=bsz, pair_cost=pair_cost, **costs))
    if sdpa:  # one SDPA call per group (CUDA): the CPU kernels' split form does not apply
        return Grouping(spans, frozenset(), sdpa=True)
    split = frozenset(t for t, s in spans.items() if split_pays(s, bsz))
    if split and not group_blocks:
        key_cost = rows * attn.num_kv_heads * attn.head_dim * SPLIT_KEY_COST
        g = auto_group_blocks(bounds, start, stop, block_size=bsz, pair_cost=pair_cost, key_cost=key_cost)
        spans.update({t: s for t, s in spans_of(g).items() if t in split})
    return Grouping(spans, split)


def _decode_span(drafter, plan, embed_tokens, context_kv, start, stop, grouping, dtype, drop_first_slot=False):
    """Normed drafter hidden states ``[b, n*B, H]`` of blocks ``start..stop-1`` (``[b, n*(B-1), H]``,
    slots 1..B-1, with ``drop_first_slot``), attending as ``grouping`` (``_layer_spans``) says."""
    b = plan.anchors.shape[0]
    ids = plan.block_ids[:, start:stop]
    scale = float(getattr(drafter, "input_embedding_scale", 1.0))

    def embed(t):
        e = embed_tokens(t)
        return (e * scale if scale != 1.0 else e).to(dtype)

    noise = embed(ids.reshape(b, -1))
    # Slots 1..B-1 all hold the mask token (plan_blocks): the first layer works on N + 1 rows per row.
    # Not under the variable-prefix objective: its slots 1..l-1 hold real tokens.
    # (DFlash 2's first layer takes them too: its convolution makes slots 0..K-1 differ, DFlash2Layer.)
    rows = None
    if plan.prefix_lengths is None:
        rows = SlotRows(embed(ids[:, :, 0]), embed(ids[:1, :1, 1]).reshape(-1))
    layouts = block_layouts(
        plan,
        grouping.spans,
        start,
        stop,
        layer_types=drafter.layer_types,
        sliding_window=getattr(drafter.config, "sliding_window", None),
        dtype=dtype,
        last_drops_first_slot=drop_first_slot,
        split=grouping.split,
        sdpa=grouping.sdpa,
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
    bounds, _ = read_bounds(plan.anchors, plan.keep, context.shape[1])
    grouping = _layer_spans(drafter, bounds, start, stop, group_blocks, plan.anchors.shape[0])
    return _decode_span(
        drafter, plan, embed_tokens, drafter.context_kv(context), start, stop, grouping, context.dtype
    )


def _chunk_terms(drafter, lm_head, embed_tokens, plan, start, stop, grouping, *context_kv):
    """Weighted CE sum and argmax ``[b, n, B-1]`` of blocks ``start..stop-1``. Slot 0 is never
    supervised: the last layer computes no slot-0 queries and the head gets no slot-0 rows.

    A DFlash 2 drafter (``independent_slots`` False: its convolutions read neighbouring slots) computes
    every slot and drops slot 0 before the head; its selector adds ``dflash2.selector_terms`` (the
    weighted sum and weight of its loss, and ``[b, n, B-1]`` masks of selector hits and of true tokens
    among the candidates), teacher-forced with the true previous tokens."""
    kv = list(zip(context_kv[::2], context_kv[1::2], strict=True))
    independent = getattr(drafter, "independent_slots", True)
    h = _decode_span(
        drafter, plan, embed_tokens, kv, start, stop, grouping, context_kv[0].dtype, drop_first_slot=independent
    )
    b, n, bsz = plan.anchors.shape[0], stop - start, plan.block_size
    if not independent:
        h = h.view(b, n, bsz, -1)[:, :, 1:]
    h = h.reshape(b * n * (bsz - 1), -1)
    labels = plan.labels[:, start:stop, 1:].reshape(-1)
    weights = plan.weights[:, start:stop, 1:].reshape(-1)
    selector = getattr(drafter, "candidate_selector", None)
    if selector is None:
        loss_sum, pred = maybe_compiled(_head_terms, getattr(drafter, "compiled", False))(
            drafter, lm_head, h, labels, weights
        )
        return loss_sum, pred.view(b, n, bsz - 1)
    from dflash_flow.model.dflash2 import selector_terms, top_candidate_indices

    logits = drafter.compute_logits(h, lm_head).float()
    candidates = top_candidate_indices(logits, selector.top_k)
    ce_sum, unary = weighted_cross_entropy(logits, labels, weights, gather=candidates)
    # max's indices: argmax's (the first maximum, checked with ties), in under half its CPU time.
    terms = (ce_sum, logits.max(dim=-1).indices.view(b, n, bsz - 1))

    sel_sum, sel_weight, hits, present = selector_terms(
        selector,
        h,
        logits,
        labels,
        plan.labels[:, start:stop, :-1].reshape(-1),  # the true previous token of each slot
        weights,
        plan.supervised[:, start:stop, 1:].reshape(-1),
        candidates=(unary, candidates),
    )
    return (*terms, sel_sum, sel_weight, hits.view(b, n, bsz - 1), present.view(b, n, bsz - 1))


def _head_terms(drafter, lm_head, h, labels, weights):
    """Weighted cross-entropy sum and argmax of the LM head's logits for rows ``h``."""
    logits = drafter.compute_logits(h, lm_head).float()
    return weighted_cross_entropy(logits, labels, weights), logits.argmax(dim=-1)


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
    activation_budget_mb: float | None = None,
    group_blocks: int | None = None,
    prefix_prior: PrefixPrior | None = None,
    prefix_lengths: torch.Tensor | None = None,
    selector_loss_weight: float = 1.0,
    host_plan: HostPlan | None = None,
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
    (``dflash2`` module docstring); its statistics come in ``extra`` (``DFlash2.metric_names``).
    ``block_size``/``mask_token_id`` default to the drafter config's; passing different values raises,
    because the exported config is what inference will use (pitfall 8).

    ``host_plan``: the anchors (and prefix lengths) drawn on the host (``host_plan()``), replacing ``anchors``,
    ``generator``'s draws and ``prefix_lengths``: then nothing is read from the device before the backward.

    Otherwise one device->host read per call before the backward (the block count and the anchors' column
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
    if host_plan is not None:
        anchors_t, keep = _to_device(host_plan.anchors, device), _to_device(host_plan.keep, device)
        bounds = host_plan.bounds
        prefix_lengths = _to_device(host_plan.prefix_lengths, device)
    elif anchors is not None:
        anchors_t, keep = anchors
        bounds, _ = read_bounds(anchors_t, keep, s)
    elif b and min(int(num_anchors), s) > 0:
        width = min(int(num_anchors), s)
        anchors_t, keep, counts = anchor_candidates(
            loss_mask, width, attention_mask=attention_mask, generator=generator
        )
        bounds, count = read_bounds(anchors_t, keep, s, counts)
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
            extra = {name: (z.sum(), z.sum()) for name in VariablePrefix.metric_names}
        if getattr(drafter, "candidate_selector", None) is not None:
            extra.update({name: (z.sum(), z.sum()) for name in DFlash2.metric_names})
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
    # Context keys/values once per layer: every chunk reads slices of them (checkpointing recomputes
    # the blocks only).
    context_kv = drafter.training_context(hidden_states)
    grad = torch.is_grad_enabled()
    step = n if not chunk_blocks or chunk_blocks >= n else int(chunk_blocks)
    loss_sum = torch.zeros((), device=device)
    preds, selector_parts = [], []
    for start in range(0, n, step):
        stop = min(start + step, n)
        grouping = _layer_spans(drafter, bounds, start, stop, group_blocks, plan.anchors.shape[0])
        args = (drafter, lm_head, embed_tokens, plan, start, stop, grouping, *context_kv)
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
