"""The DFlash training objective (SpecForge ``OnlineDFlashModel``, loss "dflash"): plan, terms, statistics.

Per row, up to ``num_anchors`` anchors are drawn among positions ``i`` with ``loss_mask[i]`` and
``loss_mask[i+1]``. Each anchor opens a block ``[input_ids[a], MASK x (B-1)]`` at positions ``a..a+B-1``.
A block sees the target features of positions strictly before its anchor (the anchor's own feature is
not available at inference: it is the bonus token being verified) and the keys of its own block
(all of them in full-attention layers, offsets <= j in sliding layers). Slot k is supervised with the
token at ``a+k`` (same-position labels, slot 0 excluded), weighted by ``exp(-(k-1)/gamma)``.

The variable-prefix objective (D2SD VP-Drafter, ``PrefixPrior``; docs/objectives.md) changes only the
block plan: block n draws a visible prefix length ``l`` (``1 <= l <= B-1``), slots ``0..l-1`` hold the
real tokens ``a..a+l-1``, and only slots ``k >= l`` are supervised, weighted ``exp(-(k-l)/gamma)``.

A DFlash 2 drafter trains with NeMo AutoModel's DFlash 2 rule: ``loss = dflash + selector_loss_weight *
selector`` (``model.terms.SelectorTerms``; why that rule: the ``dflash2`` module docstring). Its in-block
convolutions mix slots, so the two shortcuts below that assume independent slots (factored first-layer
rows, no slot-0 queries in the last layer) are off for it (``independent_slots``).

The loss is three parts, each in its module: the **plan** (``model.lossplan``: the anchors and blocks,
drawn from the host rows on the trainer's path, ``host_plan``), the **terms** of the drafter's variant
(``model.terms``, polymorphic: the LM head's cross-entropy, DFlash 2's selector), and the **statistics**
(``model.lossstats``: ``DFlashLossOutput``, each objective's own). Here, each step the work a block actually
needs and nothing else:

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
* ``DFlashLossOutput.stat_vector`` keeps the statistics on the device, so a trainer reads them once per
  optimizer step (``DFlashLossOutput.metrics`` reads them once more).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_flow.model.blockplan import (
    BlockPlan,
    PrefixPrior,
    decay_weights,
    plan_blocks,
    prefix_decay_weights,
    sample_anchors,
    sample_prefix_lengths,
    valid_anchor_mask,
)
from dflash_flow.model.dflash2 import drafter_variant
from dflash_flow.model.drafter_layers import SlotRows
from dflash_flow.model.layout import (
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
from dflash_flow.model.lossplan import HostPlan, block_settings, check_inputs, draw_plan, host_plan
from dflash_flow.model.lossstats import DFlashLossOutput, acceptance_runs, objective_stats, zero_extras
from dflash_flow.model.recipe import TrainerConfig
from dflash_flow.model.strategies import VARIANTS
from dflash_flow.model.terms import HeadTerms, terms_for

# The plan, the layouts and the statistics live in their modules; these names are re-exported for the
# callers of the objective.
__all__ = [
    "BlockPlan", "ColumnBounds", "DFlashLossOutput", "DFlashObjective", "HostPlan", "PrefixPrior",
    "activation_bytes_per_block", "auto_chunk_blocks", "auto_group_blocks", "block_attention_mask", "block_layouts",
    "block_loss", "decay_weights", "dflash_loss", "draft_block_hidden", "group_spans", "host_plan", "plan_blocks",
    "prefix_decay_weights", "read_bounds", "sample_anchors", "sample_prefix_lengths", "valid_anchor_mask",
]


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


def _chunk_terms(drafter, lm_head, embed_tokens, plan, start, stop, grouping, *context_kv, terms=None):
    """The variant's terms (``model.terms``; default: those of the drafter's config) of blocks
    ``start..stop-1``: the weighted CE sum, the argmax ``[b, n, B-1]``, then the variant's own parts. Slot 0 is
    never supervised: the last layer computes no slot-0 queries and the head gets no slot-0 rows; a drafter
    whose slots are not independent (DFlash 2's convolutions read neighbouring slots) computes every slot and
    drops slot 0 before the head."""
    kv = list(zip(context_kv[::2], context_kv[1::2], strict=True))
    independent = drafter.independent_slots
    h = _decode_span(
        drafter, plan, embed_tokens, kv, start, stop, grouping, context_kv[0].dtype, drop_first_slot=independent
    )
    b, n, bsz = plan.anchors.shape[0], stop - start, plan.block_size
    if not independent:
        h = h.view(b, n, bsz, -1)[:, :, 1:]
    h = h.reshape(b * n * (bsz - 1), -1)
    terms = terms if terms is not None else terms_for(drafter_variant(drafter.config))
    return terms.chunk(drafter, lm_head, h, plan, start, stop)


def _zero_output(drafter: nn.Module, plan: BlockPlan, terms: HeadTerms) -> DFlashLossOutput:
    """No supervised pair anywhere: a zero loss that still reaches every parameter, so a backward (and
    data-parallel gradient reduction) works the same as for any other batch."""
    zero = sum(p.sum() * 0.0 for p in drafter.parameters() if p.requires_grad)
    z = torch.zeros(plan.block_size, device=plan.anchors.device)
    extra = zero_extras((*objective_stats(plan).names, *terms.names), z)
    return DFlashLossOutput(zero, z.sum(), z, z.clone(), z.sum(), z.sum(), extra=extra)


def _statistics(plan: BlockPlan, pred, terms: HeadTerms, parts, sums, loss, loss_sum, weight_sum) -> DFlashLossOutput:
    """The micro-batch's statistics (no gradient): per-slot accuracy, the simulated acceptance (the run of
    consecutive correct slots, ``lossstats.acceptance_runs``), the objective's and the variant's own."""
    with torch.no_grad():
        sup = plan.supervised
        hits = (pred == plan.labels[:, :, 1:]) & sup[:, :, 1:]
        correct = torch.cat([torch.zeros_like(hits[:, :, :1]), hits], dim=-1)
        correct_per_pos = correct.sum(dim=(0, 1)).float()
        sup_per_pos = sup.sum(dim=(0, 1)).float()
        kept = plan.keep
        run = acceptance_runs(hits, plan)
        extra = objective_stats(plan).extras(plan, run)
        acceptance_sum = ((1 + run).float() * kept).sum()
        kept_blocks = kept.sum().float()
        extra.update(terms.extras(plan, parts, sums, loss_sum, weight_sum))
    return DFlashLossOutput(loss=loss, weight_sum=weight_sum.detach(), correct_per_position=correct_per_pos,
                            supervised_per_position=sup_per_pos, acceptance_sum=acceptance_sum,
                            kept_blocks=kept_blocks, extra=extra)


def block_loss(
    drafter: nn.Module,
    plan: BlockPlan,
    bounds: ColumnBounds,
    *,
    embed_tokens: nn.Module,
    lm_head: nn.Module,
    hidden_states: torch.Tensor,
    terms: HeadTerms,
    chunk_blocks: int | None = 128,
    activation_budget_mb: float | None = None,
    group_blocks: int | None = None,
) -> DFlashLossOutput:
    """The loss of a drawn ``plan`` (``lossplan.draw_plan``): the drafter over its blocks, chunk by chunk,
    the variant's ``terms``, then the statistics. ``chunk_blocks``, ``activation_budget_mb``, ``group_blocks``:
    see ``dflash_loss``."""
    n = plan.num_blocks
    if n == 0:
        return _zero_output(drafter, plan, terms)
    b, s = plan.context_valid.shape
    if activation_budget_mb is not None:
        vocab = int(getattr(lm_head, "out_features", None) or drafter.config.vocab_size)
        chunk_blocks = auto_chunk_blocks(drafter, batch=b, num_blocks=n, context_len=s, vocab_size=vocab,
                                         budget_mb=activation_budget_mb)
    # Context keys/values once per layer: every chunk reads slices of them (checkpointing recomputes
    # the blocks only).
    context_kv = drafter.training_context(hidden_states)
    grad = torch.is_grad_enabled()
    step = n if not chunk_blocks or chunk_blocks >= n else int(chunk_blocks)
    loss_sum = torch.zeros((), device=plan.anchors.device)
    preds, parts = [], []
    for start in range(0, n, step):
        stop = min(start + step, n)
        grouping = _layer_spans(drafter, bounds, start, stop, group_blocks, plan.anchors.shape[0])
        args = (drafter, lm_head, embed_tokens, plan, start, stop, grouping, *context_kv)
        if step < n and grad:
            part, pred, *own = checkpoint(_chunk_terms, *args, terms=terms, use_reentrant=False)
        else:
            part, pred, *own = _chunk_terms(*args, terms=terms)
        loss_sum = loss_sum + part
        preds.append(pred)
        if own:
            parts.append(own)
    pred = torch.cat(preds, dim=1) if len(preds) > 1 else preds[0]  # [b, N, B-1]
    weight_sum = plan.weights.sum()
    loss, sums = terms.total(loss_sum / weight_sum.clamp(min=1e-6), parts)
    return _statistics(plan, pred, terms, parts, sums, loss, loss_sum, weight_sum)


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
    """Token-weighted DFlash loss for one micro-batch: its plan (``lossplan.draw_plan``), then
    ``block_loss`` with the terms of the drafter's variant (its config's).

    ``hidden_states`` ``[b, S, n*H]`` are the target features aligned 1:1 with ``input_ids`` (no shift).
    ``embed_tokens``/``lm_head`` are the target's frozen modules (the caller sets requires_grad=False);
    ``embed_tokens`` must be a plain lookup (z-lab uses ``F.embedding`` on the raw weight), any
    Gemma-style scaling comes from ``input_embedding_scale`` in the drafter config.
    ``chunk_blocks``: blocks per checkpointed chunk; None or 0 runs everything in one pass without
    checkpointing (more memory: activations and logits of all blocks are kept for the backward).
    ``activation_budget_mb``: when set, replaces ``chunk_blocks``: one pass if the estimated activations
    (``activation_bytes_per_block``) fit the budget, else the largest chunks that do.
    ``group_blocks``: blocks per attention group (None: from the anchors); only speed depends on it.
    ``anchors``, ``prefix_prior``, ``prefix_lengths``, ``host_plan``: see ``draw_plan``. Under the
    variable prefix the simulated acceptance counts, per block, the bonus token and the run of correct drafts
    from the first masked slot ``l``; its statistics (``VariablePrefix.metric_names``) are reported beside it.
    ``selector_loss_weight``: a DFlash 2 drafter's loss is the DFlash loss plus this times its selector's;
    its statistics come in ``extra`` (``DFlash2.metric_names``).
    ``block_size``/``mask_token_id`` default to the drafter config's; passing different values raises.

    Without ``host_plan``, one device->host read before the backward (the block count and the anchors'
    column bounds, which set the attention shapes); ``DFlashLossOutput.metrics`` is the second.
    """
    block_size, mask_token_id = block_settings(drafter, block_size, mask_token_id)
    check_inputs(drafter, input_ids, loss_mask, hidden_states)
    plan, bounds = draw_plan(
        input_ids, loss_mask, block_size=block_size, mask_token_id=mask_token_id, gamma=gamma,
        attention_mask=attention_mask, num_anchors=num_anchors, generator=generator, prefix_prior=prefix_prior,
        anchors=anchors, prefix_lengths=prefix_lengths, host=host_plan,
    )
    return block_loss(drafter, plan, bounds, embed_tokens=embed_tokens, lm_head=lm_head, hidden_states=hidden_states,
                      terms=terms_for(drafter_variant(drafter.config), selector_loss_weight),
                      chunk_blocks=chunk_blocks, activation_budget_mb=activation_budget_mb, group_blocks=group_blocks)


class DFlashObjective(nn.Module):
    """The drafter and its DFlash loss as one module: a data-parallel wrapper sees every parameter use
    in its ``forward`` (the loss calls the drafter's ``fuse_context``/``decode``/``compute_logits``, not
    its ``forward``). The target's frozen head is held outside the module's parameters. The strategies
    (``model.strategies``) choose the variant's loss terms and the objective's prior."""

    def __init__(self, drafter: nn.Module, head, *, gamma: float, config: TrainerConfig) -> None:
        super().__init__()
        self.drafter = drafter
        drafter.compiled = config.compile  # torch.compile outside the attention (DFlashDrafter.compiled)
        object.__setattr__(self, "_head", head)  # not a submodule: frozen, shared, never synced
        self.gamma = gamma
        self.num_anchors = config.num_anchors
        self.chunk_blocks = config.chunk_blocks
        self.activation_budget_mb = config.activation_budget_mb if config.chunk_blocks is None else None
        self.needs_input_grad = False  # set under fsdp
        found = drafter_variant(drafter.config)
        variant = config.variant or VARIANTS[found]()
        if variant.name != found:
            raise ValueError(f"the trainer's variant is {variant.name} but the drafter is a {found}")
        self.terms = terms_for(variant)
        bounds = config.objective.bounds(drafter.block_size)  # a bad setting fails here, naming the field
        self.prefix_prior = None if bounds is None else PrefixPrior(
            weight_base=config.objective.prefix_weight_base, min_length=bounds[0], max_length=bounds[1])

    def plan_on_host(self, loss_mask, attention_mask, generator) -> HostPlan:
        """This micro-batch's anchors (and prefix lengths) drawn from its host rows (``lossplan.host_plan``)."""
        return host_plan(loss_mask, attention_mask, num_anchors=self.num_anchors, block_size=self.drafter.block_size,
                         generator=generator, prefix_prior=self.prefix_prior)

    def forward(self, input_ids, loss_mask, hidden_states, attention_mask, generator, plan=None):
        drafter = self.drafter
        check_inputs(drafter, input_ids, loss_mask, hidden_states)
        drawn, bounds = draw_plan(
            input_ids, loss_mask, block_size=drafter.block_size, mask_token_id=int(drafter.mask_token_id),
            gamma=self.gamma, attention_mask=attention_mask, num_anchors=self.num_anchors, generator=generator,
            prefix_prior=self.prefix_prior, host=plan,
        )
        return block_loss(drafter, drawn, bounds, embed_tokens=self._head.embed_tokens, lm_head=self._head.lm_head,
                          hidden_states=hidden_states, terms=self.terms, chunk_blocks=self.chunk_blocks,
                          activation_budget_mb=self.activation_budget_mb)
