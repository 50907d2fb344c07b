"""Where the target's features come from. A TargetBackend (what ``TargetForward`` runs) has ``layer_ids``,
``hidden_size`` (of one layer), ``vocab_size`` (ids at or above it are refused before the forward),
``rows_independent`` (a row's features do not depend on the other rows of its call, as an engine's requests; then
a per-sample cache sends all its missing rows in one call), ``setup(*, devices, out_device, name)``,
``features(input_ids, attention_mask, lengths, sample_ids)`` -> ``[b, S, n*H]`` of right-padded rows (our layer
ids: ``hidden_states[id + 1]``) and ``close()``. Here the in-process one (transformers, loaded only as deep as
the deepest requested layer); an engine and a feature store implement the same, so the trainer cannot tell them
apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .spec import ModelSpec


class BackendConfigError(ValueError):
    """The backend cannot start with this model spec (a missing target, layer ids it does not have):
    the user's input, reported as a config problem of the stage's ``field``."""

    def __init__(self, message: str, field: str = "model.target") -> None:
        super().__init__(message)
        self.field = field


class InProcessBackend:
    """The frozen transformers target in this process (``model.target.load_target``), run only up to the
    deepest requested layer; the layers above it are never loaded."""

    def __init__(self, spec: ModelSpec, *, dtype: str = "auto", attn_implementation: str | None = None) -> None:
        self.spec = spec
        self.dtype = dtype
        self.attn_implementation = attn_implementation
        self.layer_ids: list[int] = []
        self.hidden_size = 0
        self.vocab_size = 0
        self.rows_independent = False  # a padded batch's rows are not bit-equal to each row alone
        self.model: Any = None
        self.extractor: Any = None

    def setup(self, *, devices: Sequence[str], out_device: str, name: str) -> None:  # noqa: ARG002
        import torch

        from . import MODEL_LOAD_LOCK
        from .features import TargetFeatureExtractor
        from .spec import ModelSpecError
        from .target import (
            TargetOfflineError,
            load_target,
            load_target_config,
            num_hidden_layers,
            resolve_dtype,
        )

        spec = self.spec
        with MODEL_LOAD_LOCK:
            try:
                target = spec.require_target(f"stage '{name}'")
                depth = num_hidden_layers(load_target_config(target, trust_remote_code=spec.trust_remote_code))
                ids = spec.layer_ids(depth)
                self.model = load_target(target, devices=list(devices),
                                         num_layers=min(max(ids) + 1, depth) if min(ids) >= 0 else None,
                                         dtype=resolve_dtype(self.dtype, devices[0]),
                                         trust_remote_code=spec.trust_remote_code,
                                         attn_implementation=self.attn_implementation)
            except (TargetOfflineError, ModelSpecError, ValueError, OSError) as exc:
                raise BackendConfigError(str(exc)) from exc
        self.layer_ids = list(ids)
        embed = self.model.get_input_embeddings()
        self.vocab_size = int(embed.num_embeddings)
        self.hidden_size = int(embed.embedding_dim)
        try:
            self.extractor = TargetFeatureExtractor(self.model, ids, output_device=torch.device(out_device))
        except ValueError as exc:  # layer ids the target does not have
            raise BackendConfigError(str(exc), field="model.target_layer_ids") from exc

    def features(self, input_ids, attention_mask, lengths, sample_ids):  # noqa: ARG002 - whole rows in one forward
        return self.extractor(input_ids, attention_mask)

    def close(self) -> None:
        self.model = None
        self.extractor = None
