"""What a drafter is made of and how it is trained, torch-free: ``DrafterShape`` and ``TrainerConfig``
hold the one declaration of each of their knobs (doc and bounds; the DrafterStep includes them as its YAML
fields, ``core.fields.include``). The variant and the objective are strategies (``model.strategies``)
that own their own knobs; a shape and a recipe hold the chosen strategy objects."""

from __future__ import annotations

from typing import Literal

import attrs

from dflash_flow.core.stage import cfg
from dflash_flow.model.strategies import Objective, Variant, as_objective, as_variant


def _optional_variant(value: Variant | str | None) -> Variant | None:
    return None if value is None else as_variant(value)


@attrs.frozen(kw_only=True)
class DrafterShape:
    """What a fresh drafter is made of (the rest comes from the target's config)."""

    num_layers: int = cfg(1, ge=1, doc="Drafter decoder layers.")
    block_size: int = cfg(16, ge=2, doc="Block size B: one anchor token + B-1 mask tokens.")
    mask_token_id: int | None = cfg(None, ge=0, doc="Mask token id (default: tokenizer mask, else first free embedding row).")
    target_layer_ids: list[int] | None = cfg(None, doc="Target layers fused as context (default: the DFlash rule).")
    layer_types: list[str] | None = cfg(None, doc="Per-layer full_attention / sliding_attention (default: all full).")
    sliding_window: int | None = cfg(None, ge=1, doc="Window of sliding_attention layers.")
    #: The variant (``strategies.Variant``, ``DFlash2``, or a name: its knobs at their defaults).
    variant: Variant = attrs.field(default="dflash", converter=as_variant)


@attrs.frozen(kw_only=True)
class TrainerConfig:
    """The optimisation recipe (defaults: SpecForge's DFlash recipe)."""

    num_anchors: int = cfg(512, ge=1, doc="Anchors (blocks) drawn per sequence each step.")
    gamma: float | None = cfg(None, gt=0, doc="Loss decay exp(-(k-1)/gamma) (default 7 for B=16, 5 for B=10, 4 for B=8).")
    chunk_blocks: int | None = cfg(
        None, ge=1, doc="Blocks per checkpointed loss chunk; null: chosen from activation_budget_mb."
    )
    activation_budget_mb: float | None = cfg(
        4096.0, gt=0, le=1e7, doc="Activation memory one step may use: one pass (no recomputation) when it fits, "
        "else the largest checkpointed chunks that do (null: always one pass).",
    )
    compile: bool | Literal["auto"] = cfg(
        "auto", result=False, doc="torch.compile the step's work outside the attention kernels (the drafter's layers, the context "
        "projections, the loss head): same loss, 10-20% faster steps on CPU (1 thread) after 12-56 s of compiling per "
        "batch shape, 5-18 s with a warm compile cache (docs/benchmarks.md); false: never (no start-up cost); auto: "
        "on CPU, compile when the run's planned steps repay it, measured on its first steps and said at the start "
        "(model.compile_plan; runs under 300 micro-batches and tests never compile).",
    )
    lr: float = cfg(6e-4, gt=0, doc="Peak learning rate.")
    warmup_ratio: float = cfg(0.04, ge=0, le=1, doc="Linear warmup share of all steps.")
    min_lr_ratio: float = cfg(0.0, ge=0, le=1, doc="Cosine floor as a share of lr.")
    weight_decay: float = cfg(0.0, ge=0, doc="AdamW weight decay.")
    max_grad_norm: float | None = cfg(1.0, gt=0, doc="Global gradient-norm clip.")
    grad_accum: int = cfg(1, ge=1, doc="Micro-batches per optimizer step.")
    total_steps: int | None = cfg(None, ge=1, doc="Schedule length (default: from the batch plan).")
    data_parallel: Literal["ddp", "fsdp"] = cfg(
        "ddp", choices=("ddp", "fsdp"), doc="Under torchrun: ddp replicates the drafter per rank; fsdp shards it."
    )
    on_nonfinite: Literal["stop", "skip"] = cfg(
        "stop", choices=("stop", "skip"),
        doc="A NaN/inf loss or gradient norm: stop the run naming the step and batch, or skip that update (warned).",
    )
    #: Under ddp: time the gradient all-reduce with a comm hook around the default one (step metric
    #: ``allreduce_wait_s``); a clock read per bucket, nothing else changes. Not a YAML field.
    time_allreduce: bool = True
    #: The objective (``strategies.Objective``, ``VariablePrefix``, or a name: its knobs at their defaults).
    objective: Objective = attrs.field(default="dflash", converter=as_objective)
    #: The variant whose loss term is added (its ``loss_weight``); None: the drafter's own, at its defaults.
    variant: Variant | None = attrs.field(default=None, converter=_optional_variant)


#: The DrafterStep's YAML fields that are not declared by itself: these two classes' knobs (the strategy
#: fields and trainer-only settings excluded) and every strategy's.
STRATEGY_FIELDS = ("variant", "objective")
NOT_IN_YAML = (*STRATEGY_FIELDS, "time_allreduce")
