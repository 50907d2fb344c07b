"""The DFlash training objective (SpecForge ``OnlineDFlashModel``, loss "dflash").

Per row, up to ``num_anchors`` anchors are drawn among positions ``i`` with ``loss_mask[i]`` and
``loss_mask[i+1]``. Each anchor opens a block ``[input_ids[a], MASK x (B-1)]`` at positions ``a..a+B-1``
that sees the target features strictly before its anchor (the anchor's own is the bonus token being
verified at inference) and the keys of its own block (offsets <= j in sliding layers). Slot k is supervised
with the token at ``a+k`` (slot 0 excluded), weighted ``exp(-(k-1)/gamma)``. The variable-prefix objective
(docs/objectives.md) shows a prefix of ``l`` real tokens and supervises slots ``k >= l``, weighted
``exp(-(k-l)/gamma)``. A DFlash 2 drafter adds its selector's loss; its convolutions mix slots, so the
independent-slot shortcuts are off for it (``independent_slots``).

The plan is drawn first (``host_plan`` on the host rows: no device read; ``draw_plan`` on the device); terms
and statistics are ``model.lossstats``'. Blocks run in chunks (checkpointed when more than one), grouped by anchor
(``BlockLayout``) instead of a dense mask (``block_attention_mask``, the reference).
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
    plan_blocks,
    sample_prefix_lengths,
)
from dflash_flow.model.dflash2 import drafter_variant
from dflash_flow.model.drafter_layers import SlotRows
from dflash_flow.model.layout import (
    SDPA_GROUP_FIXED_COST,
    SDPA_MAX_GROUPS,
    SPLIT_KEY_COST,
    ColumnBounds,
    Grouping,
    auto_chunk_blocks,
    auto_group_blocks,
    block_layouts,
    group_spans,
    read_bounds,
    split_pays,
    uses_sdpa,
)
from dflash_flow.model.lossstats import (
    DFlashLossOutput,
    HeadTerms,
    acceptance_runs,
    objective_extras,
    terms_for,
)
from dflash_flow.model.strategies import VARIANTS, TrainerConfig


# -- the plan
@attrs.frozen
class HostPlan:
    """A micro-batch's anchors drawn on the host (what ``dflash_loss`` draws from the same generator)."""

    anchors: torch.Tensor  # [b, W] long, CPU
    keep: torch.Tensor  # [b, W] bool, CPU
    bounds: ColumnBounds
    prefix_lengths: torch.Tensor | None = None  # [b, W] long, CPU (the variable-prefix objective)


def host_plan(loss_mask: torch.Tensor, attention_mask: torch.Tensor | None, *, num_anchors: int,
              block_size: int, generator: torch.Generator | None,
              prefix_prior: PrefixPrior | None = None) -> HostPlan:
    """The anchors (and prefix lengths) ``dflash_loss`` would draw from ``generator``, from CPU tensors."""
    if loss_mask.device.type != "cpu" or (attention_mask is not None and attention_mask.device.type != "cpu"):
        raise ValueError("host_plan draws from the batch's host rows: pass the CPU loss and attention masks")
    if prefix_prior is not None:
        prefix_prior.bounds(block_size)
    b, s = loss_mask.shape
    width = min(int(num_anchors), s)
    if b and width > 0:
        anchors, keep, counts = anchor_candidates(loss_mask, width, attention_mask=attention_mask, generator=generator)
        a, k = anchors.numpy(), keep.numpy()  # host rows: no tensor read-back (train_batch reads once a step)
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
    """A host tensor on ``device``, through pinned memory without blocking on CUDA."""
    if t is None or t.device == device:
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def block_settings(drafter: nn.Module, block_size: int | None, mask_token_id: int | None) -> tuple[int, int]:
    """The block size and mask token: the drafter config's (what inference uses); a different value raises."""
    values = []
    for name, given in (("block_size", block_size), ("mask_token_id", mask_token_id)):
        own = getattr(drafter, name)
        if given is not None and own is not None and int(given) != int(own):
            raise ValueError(f"{name} {given} differs from the drafter config's {own}")
        values.append(own if given is None else given)
    if None in values:
        raise ValueError("block_size and mask_token_id are needed (none in the drafter config)")
    return int(values[0]), int(values[1])


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
        return (_to_device(host.anchors, device), _to_device(host.keep, device), host.bounds,
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


def draw_plan(input_ids: torch.Tensor, loss_mask: torch.Tensor, *, block_size: int, mask_token_id: int,
              gamma: float | None, attention_mask: torch.Tensor | None = None, num_anchors: int = 512,
              generator: torch.Generator | None = None, prefix_prior: PrefixPrior | None = None,
              anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
              prefix_lengths: torch.Tensor | None = None,
              host: HostPlan | None = None) -> tuple[BlockPlan, ColumnBounds]:
    """The block plan and its column bounds, from ``host`` (``host_plan``), given ``anchors`` ``(anchors, keep)``
    or drawn from ``generator``; ``prefix_prior``: lengths drawn after the anchors unless ``prefix_lengths``."""
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


# -- the loss
def _layer_spans(drafter, bounds, start, stop, group_blocks, rows) -> Grouping:
    """Attention groups per layer type (``group_spans``) and which layer types take the split attention
    (CPU, where ``split_pays`` on the block form's groups); unless ``group_blocks`` is given, split layer
    types are regrouped by the split form's own cost (its groups score no own keys, so larger groups pay)."""
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
    layouts = block_layouts(plan, grouping.spans, start, stop, layer_types=drafter.layer_types,
                            sliding_window=getattr(drafter.config, "sliding_window", None), dtype=dtype,
                            last_drops_first_slot=drop_first_slot, split=grouping.split, sdpa=grouping.sdpa)
    positions = plan.block_positions[:, start:stop].reshape(b, -1)
    return drafter.decode_blocks(noise, context_kv, positions, layouts, rows)


def draft_block_hidden(drafter: nn.Module, plan: BlockPlan, *, embed_tokens: nn.Module,
                       hidden_states: torch.Tensor, context: torch.Tensor | None = None,
                       blocks: slice | None = None, group_blocks: int | None = None) -> torch.Tensor:
    """Training-path drafter hidden states ``[b, n*B, H]`` for the blocks in ``blocks`` (default all);
    ``group_blocks`` (None: from the anchors) changes only the speed."""
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
    """The variant's terms (default: the drafter config's) of blocks ``start..stop-1``: the weighted CE sum,
    the argmax ``[b, n, B-1]``, the variant's own parts. Slot 0 is never supervised: no slot-0 queries in the
    last layer (a drafter whose slots are not independent computes them and drops slot 0 before the head)."""
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
    extra = objective_extras(plan, torch.zeros_like(plan.anchors))  # zeros: there is no block
    extra.update({name: (z.sum(), z.sum()) for name in terms.names})
    return DFlashLossOutput(zero, z.sum(), z, z.clone(), z.sum(), z.sum(), extra=extra)


def _statistics(plan: BlockPlan, pred, terms: HeadTerms, parts, sums, loss, loss_sum, weight_sum) -> DFlashLossOutput:
    """The micro-batch's statistics: per-slot accuracy, the simulated acceptance, the objective's and the
    variant's own."""
    with torch.no_grad():
        sup = plan.supervised
        hits = (pred == plan.labels[:, :, 1:]) & sup[:, :, 1:]
        correct = torch.cat([torch.zeros_like(hits[:, :, :1]), hits], dim=-1)
        correct_per_pos = correct.sum(dim=(0, 1)).float()
        sup_per_pos = sup.sum(dim=(0, 1)).float()
        kept = plan.keep
        run = acceptance_runs(hits, plan)
        extra = objective_extras(plan, run)
        acceptance_sum = ((1 + run).float() * kept).sum()
        kept_blocks = kept.sum().float()
        extra.update(terms.extras(plan, parts, sums, loss_sum, weight_sum))
    return DFlashLossOutput(loss=loss, weight_sum=weight_sum.detach(), correct_per_position=correct_per_pos,
                            supervised_per_position=sup_per_pos, acceptance_sum=acceptance_sum,
                            kept_blocks=kept_blocks, extra=extra)


def block_loss(drafter: nn.Module, plan: BlockPlan, bounds: ColumnBounds, *, embed_tokens: nn.Module,
               lm_head: nn.Module, hidden_states: torch.Tensor, terms: HeadTerms,
               chunk_blocks: int | None = 128, activation_budget_mb: float | None = None,
               group_blocks: int | None = None) -> DFlashLossOutput:
    """The loss of a drawn ``plan`` (``draw_plan``) with the variant's ``terms``, chunk by chunk;
    the knobs are ``dflash_loss``'s."""
    n = plan.num_blocks
    if n == 0:
        return _zero_output(drafter, plan, terms)
    b, s = plan.context_valid.shape
    if activation_budget_mb is not None:
        vocab = int(getattr(lm_head, "out_features", None) or drafter.config.vocab_size)
        chunk_blocks = auto_chunk_blocks(drafter, batch=b, num_blocks=n, context_len=s, vocab_size=vocab,
                                         budget_mb=activation_budget_mb)
    # Context keys/values once per layer: chunks read slices (checkpointing recomputes the blocks only).
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


def dflash_loss(drafter: nn.Module, *, embed_tokens: nn.Module, lm_head: nn.Module, input_ids: torch.Tensor,
                loss_mask: torch.Tensor, hidden_states: torch.Tensor,
                attention_mask: torch.Tensor | None = None, num_anchors: int = 512,
                block_size: int | None = None, mask_token_id: int | None = None, gamma: float | None = 7.0,
                generator: torch.Generator | None = None, chunk_blocks: int | None = 128,
                anchors: tuple[torch.Tensor, torch.Tensor] | None = None,
                activation_budget_mb: float | None = None, group_blocks: int | None = None,
                prefix_prior: PrefixPrior | None = None, prefix_lengths: torch.Tensor | None = None,
                selector_loss_weight: float = 1.0, host_plan: HostPlan | None = None) -> DFlashLossOutput:
    """Token-weighted DFlash loss for one micro-batch (``draw_plan``, then ``block_loss``). ``hidden_states``
    ``[b, S, n*H]``: target features aligned 1:1 with ``input_ids``; ``chunk_blocks``: blocks per checkpointed
    chunk (None or 0: one pass), replaced by ``activation_budget_mb`` when given; ``block_size`` /
    ``mask_token_id`` default to the drafter config's (different values raise)."""
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
    """The drafter and its DFlash loss as one module, so a data-parallel wrapper sees every parameter use in
    its ``forward``; the target's frozen head is held outside the module's parameters."""

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
        self.loss_weight = variant.loss_weight  # of the variant's own term
        bounds = config.objective.bounds(drafter.block_size)  # a bad setting fails here, naming the field
        self.prefix_prior = None if bounds is None else PrefixPrior(
            weight_base=config.objective.prefix_weight_base, min_length=bounds[0], max_length=bounds[1])

    def plan_on_host(self, loss_mask, attention_mask, generator) -> HostPlan:
        return host_plan(loss_mask, attention_mask, num_anchors=self.num_anchors, block_size=self.drafter.block_size,
                         generator=generator, prefix_prior=self.prefix_prior)

    def forward(self, input_ids, loss_mask, hidden_states, attention_mask, generator, plan=None):
        return dflash_loss(self.drafter, embed_tokens=self._head.embed_tokens, lm_head=self._head.lm_head,
                           input_ids=input_ids, loss_mask=loss_mask, hidden_states=hidden_states,
                           attention_mask=attention_mask, num_anchors=self.num_anchors, gamma=self.gamma,
                           generator=generator, chunk_blocks=self.chunk_blocks,
                           activation_budget_mb=self.activation_budget_mb, prefix_prior=self.prefix_prior,
                           selector_loss_weight=self.loss_weight, host_plan=plan)
