"""The model facts of a run, resolved once from the ``model:`` section (``app.model_spec.build_model_spec``) and
handed to every stage through ``RunServices.model``: the target, its sizes, the fused layers, block size, mask
token, tokenizer. torch-free. ``FeaturesConfig``: ``model.features``, where the target's features come from
(docs/features.md)."""

from __future__ import annotations

import abc
from typing import Any

import attrs

from dflash_flow.core import cfg

from .facts import TargetFacts, build_target_layer_ids


class ModelSpecError(ValueError):
    """A stage needs a model fact the pipeline does not declare (one line: which key to set)."""


@attrs.frozen(kw_only=True)
class ModelSpec:
    """``model:`` resolved. ``target`` is what the model layer loads (``embedded`` already its directory);
    ``declared`` is the value as written (for messages and the ``embedded`` data that only fits that target)."""

    declared: str | dict[str, Any] | None = None
    target: str | dict[str, Any] | None = None
    tokenizer: str | None = None  # model.tokenizer, else the target's directory when it is one
    trust_remote_code: bool = False
    num_draft_layers: int = 1
    block_size: int = 16
    mask_token_id: int | None = None
    explicit_layer_ids: tuple[int, ...] | None = None  # model.target_layer_ids as written
    facts: TargetFacts | None = None  # depth, hidden size, vocabulary when readable without torch
    engine: Any = None  # model.engine: the target served by inference engines (None: in process)
    features: Any = None  # model.features: where features come from and go (None: online, no store)

    @property
    def is_embedded(self) -> bool:
        return self.declared == "embedded"

    def require_target(self, who: str) -> str | dict[str, Any]:
        """The resolved target; a clear error naming ``who`` when the pipeline declares none."""
        if self.target is None:
            raise ModelSpecError(f"{who} needs the target model: set model.target (a local model directory, a "
                                 "preset such as tiny-qwen3-8l, a hub id, or 'embedded')")
        return self.target

    def layer_ids(self, depth: int | None = None) -> list[int]:
        """The target layers the drafter fuses (our ids: transformers' ``hidden_states[id + 1]``): explicit,
        else the DFlash rule over the target's depth (``depth`` when the facts could not be read here).
        Raises :class:`ModelSpecError` when neither the ids nor the depth are known, ValueError from the rule."""
        if self.explicit_layer_ids is not None:
            return list(self.explicit_layer_ids)
        depth = depth if depth is not None else (self.facts.depth if self.facts is not None else None)
        if depth is None:
            raise ModelSpecError("the target's depth is not known here: read it from the loaded config first")
        return build_target_layer_ids(depth, self.num_draft_layers)


class UsesModel(abc.ABC):  # noqa: B024 - a marker with a default hook, not an interface to implement
    """A stage that reads the run's :class:`ModelSpec`: validation asks it, with the one spec, what does not
    fit (``(field, message)``; a field written ``model.KEY`` is located at that key of the ``model:``
    section). No check needs to know another stage's class."""

    def model_problems(self, spec: ModelSpec, devices: list[list[str]]) -> list[tuple[str, str]]:  # noqa: ARG002
        return []


def model_of(ctx: Any) -> ModelSpec:
    """The run's model spec from a stage context's services (``RunServices.model``); a pipeline built in
    Python without one gets a spec with nothing declared, whose first use names the key to set."""
    spec = getattr(getattr(ctx, "services", None), "model", None)
    return spec if isinstance(spec, ModelSpec) else ModelSpec()


FEATURE_MODES = ("online", "offline", "hybrid")
#: Storage dtypes: fp8 is e4m3 (OCP "fn") with one fp32 scale per token.
STORE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8")
MAX_RAM_MB = 16 * 2**20  # 16 TiB: a bound a machine can hold, not a default


@attrs.define(kw_only=True)
class FeaturesConfig:
    """``model.features``: online (the target runs every epoch), offline (read a store that ``dflash-flow
    features build`` wrote; no target loaded) or hybrid (the first epoch computes and writes, later epochs
    read)."""

    mode: str = cfg("online", choices=FEATURE_MODES,
                    doc="online: the target runs every epoch; offline: read the store (no target loaded); hybrid: "
                    "the first epoch computes and writes the store, later epochs read it.")
    path: str | None = cfg(None, result=False,
                           doc="The store's directory (offline: required; hybrid: null keeps the features in RAM only).")
    dtype: str = cfg("auto", choices=STORE_DTYPES,
                     doc="How features are stored: auto (the target's compute dtype: lossless), fp32, bf16, fp16, "
                     "or fp8 (e4m3 with a scale per token: half of bf16's bytes).")
    ram_budget_mb: float = cfg(4096.0, ge=0, le=MAX_RAM_MB, result=False,
                               doc="Features kept in RAM (the RAM tier: read before the disk; what does not fit is "
                               "read from the store, or computed again without one).")
    shard_mb: float = cfg(1024.0, gt=0, le=2**20, result=False,
                          doc="Size of one shard file of the store (the unit written atomically and resumed).")
    free_space_margin_mb: float = cfg(1024.0, ge=0, le=2**30, result=False,
                                      doc="Space left free on the store's filesystem: a build that would leave less "
                                      "is refused before a byte is written.")
    verify_tokens: bool = cfg(True, result=False,
                              doc="Check each row's tokens against the batch's (a digest per sample): a store from "
                              "other data, tokenizer or chat template is refused at the first row.")

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for values that cannot work together (validation reports them located)."""
        out = []
        if self.mode == "offline" and not self.path:
            out.append(("path", "mode offline reads a store: set model.features.path to the directory "
                                "`dflash-flow features build PIPELINE` wrote"))
        if self.mode == "online" and self.path:
            out.append(("path", "mode online neither reads nor writes a store: set mode offline or hybrid, or "
                                "remove path"))
        return out

    @property
    def ram_budget_bytes(self) -> int:
        return int(self.ram_budget_mb * 2**20)

    @property
    def shard_bytes(self) -> int:
        return int(self.shard_mb * 2**20)

    @property
    def margin_bytes(self) -> int:
        return int(self.free_space_margin_mb * 2**20)
