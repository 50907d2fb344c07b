"""The drafter's variants (``dflash``, ``dflash2``) and objectives (``dflash``, ``variable_prefix``) as
torch-free strategies, each owning its knobs (DrafterStep's YAML fields), checks, metrics and exported
``dflash_config`` keys; and the recipe that holds them: ``DrafterShape`` and ``TrainerConfig``."""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

import attrs

from dflash_flow.core.stage import cfg, field_errors

# The published DFlash 2 settings (NeMo AutoModel's and speculators' defaults; z-lab reads them from
# the checkpoint's dflash_config and has none of its own): two taps, 16 channels per dynamic group, a
# rank-256 selector over 16 candidates.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
#: The DFlash 2 settings written into the exported ``dflash_config`` (``DFlash2.export_settings``).
DFLASH2_KEYS = tuple(DFLASH2_DEFAULTS)


def dflash2_problems(
    settings: dict[str, Any], *, hidden_size: int, vocab_size: int, block_size: int | None = None
) -> list[tuple[str, str]]:
    """``(setting, message)`` for what is wrong with DFlash 2 settings for a drafter of these sizes: the one
    check (the stage's preflight, the drafter's config and an exported checkpoint's all ask it)."""
    problems = []
    for key in DFLASH2_KEYS:
        value = settings.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            problems.append((key, f"{key} must be a positive integer, got {value!r}"))
    kernel, group = settings.get("conv_kernel_size"), settings.get("conv_group_size")
    top_k = settings.get("selector_top_k")
    if isinstance(group, int) and group >= 1 and hidden_size % group:
        problems.append(("conv_group_size", (
            f"conv_group_size {group} must divide the hidden size {hidden_size} (channels are split into "
            "groups that share one dynamic tap)")))
    if isinstance(top_k, int) and top_k > vocab_size:
        problems.append(("selector_top_k", f"selector_top_k {top_k} exceeds the vocabulary ({vocab_size} tokens)"))
    if block_size is not None:
        problems += kernel_problems(kernel, block_size)
    return problems


def kernel_problems(kernel: Any, block_size: int) -> list[tuple[str, str]]:
    if isinstance(kernel, int) and kernel > block_size:
        return [("conv_kernel_size", f"'conv_kernel_size' must be <= block_size = {block_size}: {kernel} taps, and "
                                     "taps past the block's first slot read nothing")]
    return []


def dflash2_settings(conv_kernel_size: int | None = None, conv_group_size: int | None = None,
                     selector_rank: int | None = None, selector_top_k: int | None = None) -> dict[str, int]:
    """The four DFlash 2 settings, None replaced by the published defaults."""
    given = (conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
    return {k: DFLASH2_DEFAULTS[k] if v is None else v for k, v in zip(DFLASH2_KEYS, given, strict=True)}


@attrs.frozen(kw_only=True)
class Variant:
    """The DFlash drafter (z-lab's architecture): no knobs, no loss term or metrics of its own."""

    name: ClassVar[str] = "dflash"
    #: The metrics its loss adds to a step's (``DFlashLossOutput.extra``).
    metric_names: ClassVar[tuple[str, ...]] = ()

    def export_settings(self) -> dict[str, int]:
        """What it writes into the exported ``dflash_config`` (None knobs filled with their defaults)."""
        return {}

    @property
    def loss_weight(self) -> float:
        """The weight of its own loss term (0: none)."""
        return 0.0

    def problems(self, *, hidden_size: int, vocab_size: int, block_size: int) -> list[tuple[str, str]]:
        """``(knob, message)``: what its knobs cannot do with a target of these sizes."""
        return []

    def block_problems(self, block_size: int) -> list[tuple[str, str]]:
        """``(knob, message)``: what its knobs cannot do with blocks of ``block_size``."""
        return []


@attrs.frozen(kw_only=True)
class DFlash2(Variant):
    """DFlash 2 (docs/dflash2.md): in-block convolutions and a candidate selector."""

    name: ClassVar[str] = "dflash2"
    metric_names: ClassVar[tuple[str, ...]] = (
        "dflash_loss", "selector_loss", "selector_accuracy", "candidate_recall", "selector_accept_len")

    conv_kernel_size: int | None = cfg(None, ge=1, doc="dflash2: taps of the in-block convolutions (null: 2).")
    conv_group_size: int | None = cfg(
        None, ge=1, doc="dflash2: channels sharing one dynamic tap; must divide the hidden size (null: 16)."
    )
    selector_rank: int | None = cfg(None, ge=1, doc="dflash2: rank of the selector's codebooks (null: 256).")
    selector_top_k: int | None = cfg(
        None, ge=1, doc="dflash2: candidates the selector reranks per slot, at most the vocabulary (null: 16)."
    )
    selector_loss_weight: float = cfg(
        1.0, ge=0, doc="dflash2: loss = DFlash loss + this x the selector's candidate cross-entropy."
    )

    def export_settings(self) -> dict[str, int]:
        return dflash2_settings(self.conv_kernel_size, self.conv_group_size, self.selector_rank, self.selector_top_k)

    @property
    def loss_weight(self) -> float:
        return float(self.selector_loss_weight)

    def problems(self, *, hidden_size: int, vocab_size: int, block_size: int) -> list[tuple[str, str]]:
        return dflash2_problems(self.export_settings(), hidden_size=hidden_size, vocab_size=vocab_size,
                                block_size=block_size)

    def block_problems(self, block_size: int) -> list[tuple[str, str]]:
        return kernel_problems(self.conv_kernel_size, block_size)


@attrs.frozen(kw_only=True)
class Objective:
    """DFlash's objective: one real token (the anchor) per block, every other slot supervised."""

    name: ClassVar[str] = "dflash"
    metric_names: ClassVar[tuple[str, ...]] = ()

    def block_problems(self, block_size: int) -> list[tuple[str, str]]:
        """``(knob, message)``: what its knobs cannot do with blocks of ``block_size``."""
        return []

    def bounds(self, block_size: int) -> tuple[int, int] | None:
        """The visible prefix lengths it draws for blocks of ``block_size`` (None: always 1); raises on a bad
        setting, naming the field."""
        return None


@attrs.frozen(kw_only=True)
class VariablePrefix(Objective):
    """D2SD's VP-Drafter (docs/objectives.md): each block shows ``l`` real tokens, ``Pr(l) ~ base ** l`` on
    ``[prefix_min_length, prefix_max_length]``; only the masked suffix is supervised."""

    name: ClassVar[str] = "variable_prefix"
    metric_names: ClassVar[tuple[str, ...]] = ("prefix_length", "sim_accept_len_prefix1")

    prefix_weight_base: float = cfg(
        0.9, gt=0, doc="variable_prefix: truncated geometric prior Pr(l) ~ base**l (< 1 favours short prefixes)."
    )
    prefix_min_length: int = cfg(1, ge=1, doc="variable_prefix: shortest visible prefix l (counts the anchor slot).")
    prefix_max_length: int | None = cfg(
        None, ge=1, doc="variable_prefix: longest visible prefix l (default block_size - 1: one masked slot at least)."
    )

    def block_problems(self, block_size: int) -> list[tuple[str, str]]:
        base, lo = self.prefix_weight_base, self.prefix_min_length
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not math.isfinite(base) or base <= 0:
            return [("prefix_weight_base", f"prefix_weight_base must be a finite number > 0, got {base!r}")]
        hi = block_size - 1 if self.prefix_max_length is None else self.prefix_max_length
        if not 1 <= lo <= block_size - 1:
            return [("prefix_min_length",
                     f"prefix_min_length must be in [1, block_size - 1] = [1, {block_size - 1}], got {lo}")]
        if not lo <= hi <= block_size - 1:
            return [("prefix_max_length", (
                f"prefix_max_length must be in [prefix_min_length, block_size - 1] = [{lo}, {block_size - 1}], "
                f"got {hi}"))]
        return []

    def bounds(self, block_size: int) -> tuple[int, int]:
        """``(lo, hi)`` for blocks of ``block_size``; ValueError with the first of ``block_problems``."""
        problems = self.block_problems(block_size)
        if problems:
            raise ValueError(problems[0][1])
        hi = block_size - 1 if self.prefix_max_length is None else self.prefix_max_length
        return int(self.prefix_min_length), int(hi)


VARIANTS: dict[str, type[Variant]] = {cls.name: cls for cls in (Variant, DFlash2)}
OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (Objective, VariablePrefix)}


@attrs.frozen(kw_only=True)
class StrategyChoice:
    """The chosen variant and objective (included flat by a config that carries every strategy's knobs)."""

    variant: Literal["dflash", "dflash2"] = cfg(
        "dflash", choices=tuple(VARIANTS),
        doc="dflash, or dflash2: in-block convolutions and a candidate selector (docs/dflash2.md).",
    )
    objective: Literal["dflash", "variable_prefix"] = cfg(
        "dflash", choices=tuple(OBJECTIVES),
        doc="dflash: one real token per block; variable_prefix: D2SD VP-Drafter, each block shows l real tokens, "
        "only the masked suffix is supervised (docs/objectives.md).",
    )

    @objective.validator
    def _refuse_misplaced(self, _attribute: attrs.Attribute, _value: str) -> None:
        """``misplaced_knobs`` of the including config as one error, each at its own field (its YAML line)."""
        problems = misplaced_knobs(self)
        if problems:
            raise field_errors(type(self), problems)


def knobs(cls: type) -> tuple[attrs.Attribute, ...]:
    return tuple(f for f in attrs.fields(cls) if f.init)


def _known(registry: dict[str, type], kind: str, name: Any) -> type:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {list(registry)}")
    return registry[name]


def _build(registry: dict[str, type], kind: str, name: Any, conf: Any) -> Any:
    cls = _known(registry, kind, name)
    return cls(**{f.name: getattr(conf, f.name) for f in knobs(cls)})


def variant_of(conf: Any) -> Variant:
    """The variant a config that carries the knobs flat (DrafterStep) asks for."""
    return _build(VARIANTS, "drafter variant", conf.variant, conf)


def objective_of(conf: Any) -> Objective:
    """The objective such a config asks for (``conf.objective``)."""
    return _build(OBJECTIVES, "objective", conf.objective, conf)


def as_variant(value: Variant | str) -> Variant:
    """A variant strategy, or a variant's name (its knobs at their defaults)."""
    return value if isinstance(value, Variant) else _known(VARIANTS, "drafter variant", value)()


def as_objective(value: Objective | str) -> Objective:
    """An objective strategy, or an objective's name (its knobs at their defaults)."""
    return value if isinstance(value, Objective) else _known(OBJECTIVES, "objective", value)()


def misplaced_knobs(conf: Any) -> list[tuple[str, str]]:
    """``(knob, message)`` for each knob of a strategy other than the chosen one (``conf.variant``,
    ``conf.objective``) that is not at its default: it would silently do nothing."""
    out = []
    for kind, registry, chosen in (("variant", VARIANTS, conf.variant), ("objective", OBJECTIVES, conf.objective)):
        for name, cls in registry.items():
            if name == chosen:
                continue
            for f in knobs(cls):
                if getattr(conf, f.name) != f.default:
                    default = "null" if f.default is None else f.default
                    out.append((f.name, f"'{f.name}' only applies to {kind}: {name} ({kind} is {chosen}): remove "
                                f"it, or set it to {default}"))
    return out


def _at_model(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """A problem of the block size is the ``model:`` section's (where it is declared)."""
    return [("model.block_size" if f == "block_size" else f, m) for f, m in problems]


def setting_problems(variant: Variant, objective: Objective, *, block_size: int, facts: Any = None,
                     init_from: str | None = None) -> list[tuple[str, str]]:
    """``(field, message)``: the strategies against the block size; with the target's ``facts``, a fresh
    drafter's settings against its sizes and ``init_from`` made for this target and block size."""
    out = _at_model([*variant.block_problems(block_size), *objective.block_problems(block_size)])
    if facts is None:
        return out
    if not init_from:
        out += _at_model(variant.problems(hidden_size=facts.hidden_size, vocab_size=facts.vocab_size,
                                          block_size=block_size))
    return out + init_from_problems(init_from, hidden_size=facts.hidden_size, block_size=block_size)


def init_from_problems(init_from: str | None, *, hidden_size: int, block_size: int) -> list[tuple[str, str]]:
    """A drafter to start from (``init_from``) was made for a target of this hidden size and this block size."""
    import json
    from pathlib import Path

    if not init_from:
        return []
    try:
        d = json.loads((Path(init_from).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return []  # a missing directory is a path problem; an unreadable one, setup's
    out = []
    hidden = d.get("hidden_size")
    if isinstance(hidden, int) and hidden != hidden_size:
        out.append(("init_from", f"the drafter in {init_from} has hidden_size {hidden}, the target "
                                 f"{hidden_size}: it was made for another target"))
    block = (d.get("dflash_config") or {}).get("block_size", d.get("block_size"))
    if isinstance(block, int) and block != block_size:
        out.append(("model.block_size", f"block_size {block_size}, but the drafter in {init_from} was "
                                        f"made with block_size {block}"))
    return out


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
    variant: Variant | None = attrs.field(default=None, converter=attrs.converters.optional(as_variant))
