"""The drafter's variants (``dflash``, ``dflash2``) and training objectives (``dflash``, ``variable_prefix``)
as small strategies, torch-free: which settings (knobs) belong to which, their checks (each once), and the
strategy objects the trainer and the export read.

A knob is a DrafterStep config field (the YAML's one declaration, with its doc and bounds); ``KNOBS`` says
which strategy it belongs to, so a knob set for another strategy is refused by one rule, and the strategy
is built from the stage's fields by name (``variant_of`` / ``objective_of``). The variants' settings go
into the exported ``dflash_config`` (``Variant.settings``); the objectives' prior is ``model.blockplan``'s.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

VARIANTS = ("dflash", "dflash2")
OBJECTIVES = ("dflash", "variable_prefix")
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# The published DFlash 2 settings (NeMo AutoModel's and speculators' defaults; z-lab reads them from
# the checkpoint's dflash_config and has none of its own): two taps, 16 channels per dynamic group, a
# rank-256 selector over 16 candidates.
DFLASH2_DEFAULTS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16}
PREFIX_KEYS = ("prefix_weight_base", "prefix_min_length", "prefix_max_length")
#: The knobs of each strategy (the base ``dflash`` variant and objective have none).
KNOBS: dict[str, tuple[str, ...]] = {"dflash2": (*DFLASH2_KEYS, "selector_loss_weight"), "variable_prefix": PREFIX_KEYS}
#: The metrics a DFlash 2 drafter's loss adds (``DFlashLossOutput.extra``).
SELECTOR_EXTRAS = ("dflash_loss", "selector_loss", "selector_accuracy", "candidate_recall", "selector_accept_len")


def dflash2_problems(
    settings: dict[str, Any], *, hidden_size: int, vocab_size: int, block_size: int | None = None
) -> list[tuple[str, str]]:
    """``(setting, message)`` for what is wrong with DFlash 2 settings for a drafter of this hidden and
    vocabulary size (and block size, when given); each message also names the setting."""
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
    if block_size is not None and isinstance(kernel, int) and kernel > block_size:
        problems.append(("conv_kernel_size", (
            f"conv_kernel_size {kernel} is longer than the block ({block_size} slots): taps past the block's "
            "first slot read nothing")))
    return problems


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


def prefix_bounds(block_size: int, weight_base: Any, min_length: int, max_length: int | None) -> tuple[int, int]:
    """``(lo, hi)``: the visible prefix lengths the variable-prefix prior draws from for blocks of
    ``block_size``; the one check of its settings (ValueError naming the config field)."""
    if isinstance(weight_base, bool) or not isinstance(weight_base, (int, float)) or not math.isfinite(weight_base) \
            or weight_base <= 0:
        raise ValueError(f"prefix_weight_base must be a finite number > 0, got {weight_base!r}")
    hi = block_size - 1 if max_length is None else max_length
    if not 1 <= min_length <= block_size - 1:
        raise ValueError(f"prefix_min_length must be in [1, block_size - 1] = [1, {block_size - 1}], got {min_length}")
    if not min_length <= hi <= block_size - 1:
        raise ValueError(
            f"prefix_max_length must be in [prefix_min_length, block_size - 1] = [{min_length}, {block_size - 1}], "
            f"got {hi}"
        )
    return int(min_length), int(hi)


@attrs.frozen
class Variant:
    """A drafter variant: its settings (``dflash2``: the four DFlash 2 settings, None for the published
    defaults) and the weight of its own loss term."""

    name: str = "dflash"
    settings: dict[str, int | None] = attrs.field(factory=dict)
    selector_loss_weight: float = 1.0

    def problems(self, *, hidden_size: int, vocab_size: int, block_size: int) -> list[tuple[str, str]]:
        """What this variant's settings cannot do with a target of these sizes."""
        if self.name != "dflash2":
            return []
        full = dflash2_settings(**{k: self.settings.get(k) for k in DFLASH2_KEYS})
        return dflash2_problems(full, hidden_size=hidden_size, vocab_size=vocab_size, block_size=block_size)

    @property
    def metric_names(self) -> tuple[str, ...]:
        return SELECTOR_EXTRAS if self.name == "dflash2" else ()


@attrs.frozen
class Objective:
    """A training objective: ``dflash`` (one real token per block) or ``variable_prefix`` (a visible prefix
    of ``l`` real tokens, ``Pr(l) ~ weight_base ** l`` on ``[min_length, max_length]``)."""

    name: str = "dflash"
    weight_base: float = 0.9
    min_length: int = 1
    max_length: int | None = None

    def bounds(self, block_size: int) -> tuple[int, int] | None:
        """The prefix lengths drawn (None for ``dflash``); raises on a bad setting, naming the field."""
        if self.name != "variable_prefix":
            return None
        return prefix_bounds(block_size, self.weight_base, self.min_length, self.max_length)


def misplaced_knobs(conf: Any, variant: str, objective: str) -> list[tuple[str, str]]:
    """``(field, message)`` for each knob set (not None) for a strategy other than the chosen one."""
    out = []
    for owner, knobs in KNOBS.items():
        if owner in (variant, objective):
            continue
        kind = "variant" if owner in VARIANTS else "objective"
        chosen = variant if kind == "variant" else objective
        for k in knobs:
            if k in _DEFAULTED:
                continue  # a knob with a plain default (not None) cannot tell set from unset
            if getattr(conf, k) is not None:
                out.append((k, f"'{k}' only applies to {kind}: {owner} ({kind} is {chosen})"))
    return out


_DEFAULTED = frozenset({"selector_loss_weight", "prefix_weight_base", "prefix_min_length"})


def variant_of(conf: Any) -> Variant:
    """The variant a DrafterStep config (or anything with the same fields) asks for."""
    if conf.variant not in VARIANTS:
        raise ValueError(f"unknown drafter variant {conf.variant!r}; expected one of {list(VARIANTS)}")
    if conf.variant == "dflash":
        return Variant()
    return Variant("dflash2", {k: getattr(conf, k) for k in DFLASH2_KEYS}, float(conf.selector_loss_weight))


def objective_of(conf: Any) -> Objective:
    if conf.objective not in OBJECTIVES:
        raise ValueError(f"unknown objective {conf.objective!r}; expected one of {list(OBJECTIVES)}")
    if conf.objective == "dflash":
        return Objective()
    return Objective("variable_prefix", conf.prefix_weight_base, conf.prefix_min_length, conf.prefix_max_length)
