"""The drafter's variants (``dflash``, ``dflash2``) and training objectives (``dflash``, ``variable_prefix``)
as small strategies, torch-free. Each strategy is an attrs class that owns its knobs (their one
declaration, with doc and bounds: the DrafterStep's YAML fields and its ``dflash-flow stages`` lines are
included from here, ``core.fields.include``), their checks (each once), its loss term, the metrics it adds
and, for a variant, the keys it writes into the exported ``dflash_config``.

``VARIANTS`` and ``OBJECTIVES`` map each name to its class; ``variant_of`` / ``objective_of`` build the
chosen one from a config that carries the knobs flat (the stage), and ``misplaced_knobs`` is the one rule
that refuses a knob set for a strategy that is not the chosen one.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs

from dflash_flow.core.stage import cfg

# The published DFlash 2 settings (NeMo AutoModel's and speculators' defaults; z-lab reads them from
# the checkpoint's dflash_config and has none of its own): two taps, 16 channels per dynamic group, a
# rank-256 selector over 16 candidates.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
#: The DFlash 2 settings written into the exported ``dflash_config`` (``DFlash2.export_settings``).
DFLASH2_KEYS = tuple(DFLASH2_DEFAULTS)


def dflash2_problems(
    settings: dict[str, Any], *, hidden_size: int, vocab_size: int, block_size: int | None = None
) -> list[tuple[str, str]]:
    """``(setting, message)`` for what is wrong with DFlash 2 settings for a drafter of this hidden and
    vocabulary size (and block size, when given); each message also names the setting. The one check of
    the settings against the sizes (the stage's preflight, the drafter's config and an exported
    checkpoint's all ask it)."""
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
    """The in-block convolution's taps against the block (the one check of it)."""
    if isinstance(kernel, int) and kernel > block_size:
        return [("conv_kernel_size", f"'conv_kernel_size' must be <= block_size = {block_size}: {kernel} taps, and "
                                     "taps past the block's first slot read nothing")]
    return []


def dflash2_settings(
    conv_kernel_size: int | None = None,
    conv_group_size: int | None = None,
    selector_rank: int | None = None,
    selector_top_k: int | None = None,
) -> dict[str, int]:
    """The four DFlash 2 settings, None replaced by the published defaults (``DFLASH2_DEFAULTS``)."""
    given = {
        "conv_kernel_size": conv_kernel_size,
        "conv_group_size": conv_group_size,
        "selector_rank": selector_rank,
        "selector_top_k": selector_top_k,
    }
    return {k: DFLASH2_DEFAULTS[k] if v is None else v for k, v in given.items()}


# -- variants --------------------------------------------------------------------------------------------
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
        """``(knob, message)``: what its knobs cannot do with blocks of ``block_size`` (known before any
        target is read)."""
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


# -- objectives ------------------------------------------------------------------------------------------
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
        """The one check of the prefix settings against the block (the stage's validation reads it through
        ``DrafterStep.model_problems``; the trainer's and the loss's prior through ``bounds``)."""
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
        """``(lo, hi)``: the visible prefix lengths drawn for blocks of ``block_size``; ValueError with the
        first of ``block_problems`` (naming its field)."""
        problems = self.block_problems(block_size)
        if problems:
            raise ValueError(problems[0][1])
        hi = block_size - 1 if self.prefix_max_length is None else self.prefix_max_length
        return int(self.prefix_min_length), int(hi)


VARIANTS: dict[str, type[Variant]] = {cls.name: cls for cls in (Variant, DFlash2)}
OBJECTIVES: dict[str, type[Objective]] = {cls.name: cls for cls in (Objective, VariablePrefix)}


def knobs(cls: type) -> tuple[attrs.Attribute, ...]:
    """A strategy's knobs (its init fields)."""
    return tuple(f for f in attrs.fields(cls) if f.init)


def _build(registry: dict[str, type], kind: str, name: Any, conf: Any) -> Any:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; expected one of {list(registry)}")
    cls = registry[name]
    return cls(**{f.name: getattr(conf, f.name) for f in knobs(cls)})


def variant_of(conf: Any) -> Variant:
    """The variant a config that carries the knobs flat (DrafterStep) asks for (``conf.variant``)."""
    return _build(VARIANTS, "drafter variant", conf.variant, conf)


def objective_of(conf: Any) -> Objective:
    """The objective such a config asks for (``conf.objective``)."""
    return _build(OBJECTIVES, "objective", conf.objective, conf)


def as_variant(value: Variant | str) -> Variant:
    """A variant strategy, or a variant's name (its knobs at their defaults)."""
    if isinstance(value, Variant):
        return value
    if value not in VARIANTS:
        raise ValueError(f"unknown drafter variant {value!r}; expected one of {list(VARIANTS)}")
    return VARIANTS[value]()


def as_objective(value: Objective | str) -> Objective:
    """An objective strategy, or an objective's name (its knobs at their defaults)."""
    if isinstance(value, Objective):
        return value
    if value not in OBJECTIVES:
        raise ValueError(f"unknown objective {value!r}; expected one of {list(OBJECTIVES)}")
    return OBJECTIVES[value]()


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
    """``(field, message)``: the strategies against the block size; with the target's ``facts`` (its sizes),
    a fresh DFlash 2 drafter's settings against its hidden and vocabulary size, and a drafter to start from
    (``init_from``) made for this target's hidden size and this block size. Setup would fail the same way."""
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


def refuse_misplaced_knobs(conf: Any) -> None:
    """``misplaced_knobs`` as one error, each problem at its own field (its own YAML line): a validator that
    runs once every field of ``conf`` is set."""
    from dflash_flow.core.fields import field_errors

    problems = misplaced_knobs(conf)
    if problems:
        raise field_errors(type(conf), problems)
