"""The model facts of a run, resolved once: which target, its sizes, the layers the drafter fuses, the
block size, the mask token, the tokenizer. Built by the application from the ``model:`` section at
validation (``app.model_spec.build_model_spec``) and handed to every stage through ``RunServices.model``;
no stage keeps a copy. torch-free (``validate`` imports it).
"""

from __future__ import annotations

import abc
from typing import Any

import attrs

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
