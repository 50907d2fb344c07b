"""TargetForward: the frozen target LM, run (and loaded) only as deep as the deepest requested layer. A replica
may span several devices (``devices: [[cuda:0, cuda:1], [cuda:2, cuda:3]]``): the target's layers are split over
them and the features gathered on the consumer's device.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import attrs

from dflash_flow.core import Stage, cfg
from dflash_flow.core.metrics import Counter, Gauge, Summary, stage_metric
from dflash_flow.items import PaddedBatch, TargetFeatures
from dflash_flow.model.feature_cache import FeatureCache
from dflash_flow.model.spec import UsesModel, model_of


def _absent_local_path(spec: Any) -> bool:
    """A spec written as a local path (``/``, ``.``, ``~``) that does not exist on this machine."""
    from pathlib import Path

    return isinstance(spec, str) and spec.startswith(("/", ".", "~")) and not Path(spec).expanduser().exists()


@attrs.define
class TargetForwardMetrics:
    tokens: Counter = stage_metric("tokens", "Real (unpadded) tokens forwarded")
    batches: Counter = stage_metric("batches", "Batches forwarded")
    forward_s: Summary = stage_metric("s", "Seconds per target forward")


@attrs.define
class FeatureCacheMetrics:
    """Declared when ``cache_features`` is on."""

    cached_samples: Gauge = stage_metric("samples", "Samples whose features are cached")
    cache_mb: Gauge = stage_metric("MiB", "Memory the feature cache holds")
    cache_hits: Counter = stage_metric("samples", "Samples read from the feature cache")
    cache_misses: Counter = stage_metric("samples", "Samples the target ran for (cache on)")


@attrs.define(kw_only=True, eq=False)
class TargetForward(Stage, UsesModel):
    """Frozen target forward: emits the hidden states of the model's target layers, aligned 1:1 with input_ids."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.model.drafter  # noqa: F401
        import dflash_flow.model.target  # noqa: F401

    input_type = PaddedBatch
    output_type = TargetFeatures
    stage_metrics = (TargetForwardMetrics, FeatureCacheMetrics)
    multi_device: ClassVar[bool] = True
    replicas_affect_result: ClassVar[bool] = False  # stateless, per batch; the trainer restores the plan's order
    moved_fields: ClassVar[dict[str, str]] = {
        "target": "model.target", "trust_remote_code": "model.trust_remote_code",
        "num_draft_layers": "model.num_draft_layers", "target_layer_ids": "model.target_layer_ids",
    }

    dtype: str = cfg("auto", choices=("auto", "float32", "bfloat16", "float16"), doc="auto: bf16 on GPU, fp32 on CPU.")
    attn_implementation: str | None = cfg(None, doc="Default: flash_attention_2 when flash-attn imports on CUDA, else sdpa.")
    torch_threads: int | None = cfg(None, ge=1, result=False, doc="torch intra-op threads for this process (CPU runs).")
    cache_features: bool = cfg(
        False, doc="Keep each sample's features in memory after its first forward: later epochs read them instead "
        "of running the target, freeing its cores (CPU runs; each sample is then computed alone, unpadded, so "
        "results do not depend on the cache).",
    )
    cache_budget_mb: float = cfg(
        4096.0, gt=0, result=False,
        doc="Memory the feature cache may hold (samples past it are computed again every epoch).",
    )
    # One cache for all replicas (they are deep copies of this stage, and a copy of a cache is the cache).
    _cache: Any = attrs.field(factory=FeatureCache, init=False)

    def device_problems(self, replica_devices: list[list[str]]) -> list[tuple[str, str]]:
        """This machine's side (validation with device checks): a feature cache larger than its memory would
        be killed by the OOM killer late in the first epoch instead of refused now."""
        if not self.cache_features:
            return []
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return []  # not known on this platform: nothing to compare with
        if self.cache_budget_mb * 2**20 > ram:
            return [("cache_budget_mb", (
                f"cache_budget_mb {self.cache_budget_mb:g} is more than this machine's memory ({ram / 2**20:,.0f} "
                "MiB): the cache would be killed late in the first epoch; lower it (the samples past it run the "
                "target every epoch)"))]
        return []

    def model_problems(self, spec, devices: list[list[str]]) -> list[tuple[str, str]]:
        """A target is declared, and no replica has more devices than layers to run. The target's config is
        read (without weights, never from the network) only when it matters: several devices per replica."""
        if spec.target is None:
            return [("model.target", "TargetForward needs the target: set model.target (a local model directory, "
                                     "a preset such as tiny-qwen3-8l, a hub id, or 'embedded')")]
        widest = max((len(g) for g in devices), default=1)
        if widest == 1 or _absent_local_path(spec.target):
            return []  # e.g. a cluster's /models/... checked on a laptop: nothing to read (and no torch import)
        depth = spec.facts.depth if spec.facts is not None else None
        if depth is None:
            from dflash_flow.model.target import peek_target_depth

            depth = peek_target_depth(spec.target, trust_remote_code=spec.trust_remote_code)
        if depth is None:
            return []  # not readable here: setup reports what is wrong
        try:
            deepest = max(spec.layer_ids(depth))
        except ValueError:
            return []  # the model section's own check names it
        if widest > deepest + 1:
            return [("devices", (
                f"a replica spans {widest} devices but the target runs only {deepest + 1} layer(s) (up to layer "
                f"{deepest}); every device needs at least one layer: use at most {deepest + 1} devices per replica"
            ))]
        return []

    def setup(self, ctx) -> None:
        import torch

        from dflash_flow.core.errors import ConfigError, Problem
        from dflash_flow.model.backend import BackendConfigError

        if self.torch_threads:
            torch.set_num_threads(self.torch_threads)
        devices = list(ctx.devices) or [ctx.device]
        self._devices = [torch.device(d) for d in devices]
        self._device = self._devices[0]  # where the embedding is: inputs go there
        # Outputs go straight to the consumer's device when there is exactly one.
        downstream = set(ctx.downstream_devices)
        self._out_device = torch.device(downstream.pop()) if len(downstream) == 1 else self._device
        self._ctx_name = ctx.name
        self._backend = self._make_backend(ctx)
        try:
            self._backend.setup(devices=devices, out_device=str(self._out_device), name=ctx.name)
        except BackendConfigError as exc:
            # A target that is not there is the user's input, not a crash: exit 2 with the reason.
            raise ConfigError(Problem(str(exc), stage=ctx.name, field=exc.field)) from exc
        self._vocab = self._backend.vocab_size
        self._layer_ids = list(self._backend.layer_ids)
        self._m = ctx.metrics.declare(TargetForwardMetrics)
        if self.cache_features:
            self._cache.budget_bytes = int(self.cache_budget_mb * 2**20)
            self._m_cache = ctx.metrics.declare(FeatureCacheMetrics)

    def _make_backend(self, ctx):
        """Where the features come from (``model.backend.TargetBackend``): the target in this process, or on
        inference engines (``model.engine``); wrapped by the feature store when ``model.features`` reads or
        writes one (offline: the store alone, no target loaded)."""
        from dflash_flow.model.backend import InProcessBackend

        spec = model_of(ctx)
        features = spec.features
        offline = features is not None and features.mode == "offline"
        inner = None
        if not offline and spec.engine is not None:
            from dflash_flow.engine.backend import engine_backend

            inner = engine_backend(spec, output_dir=ctx.output_dir, name=ctx.name, heartbeat=ctx.heartbeat)
            inner.attach_metrics(ctx.metrics)  # requests, retries, failovers, data wait: in the Monitor
        elif not offline:
            inner = InProcessBackend(spec, dtype=self.dtype, attn_implementation=self.attn_implementation)
        if features is not None and features.mode != "online":
            from dflash_flow.model.store_backend import store_backend

            return store_backend(spec, inner=inner, output_dir=ctx.output_dir, name=ctx.name, rank=ctx.rank)
        return inner

    def _cached_forward(self, batch: PaddedBatch, input_ids):
        from dflash_flow.model.feature_cache import per_sample_features

        cache = self._cache
        backend = self._backend
        hidden, computed = per_sample_features(backend.features, input_ids, batch.meta.lengths,
                                               batch.meta.sample_ids, cache, device=self._out_device,
                                               together=backend.rows_independent)
        self._m_cache.cache_hits.inc(len(batch.meta.lengths) - len(computed))
        self._m_cache.cache_misses.inc(len(computed))
        self._m_cache.cached_samples.set(len(cache))
        self._m_cache.cache_mb.set(cache.bytes / 2**20)
        if cache.full and not cache.warned_full:
            cache.warned_full = True
            import logging

            logging.getLogger(__name__).warning(
                "%s: the feature cache is full (%.0f MiB, %d samples): the samples past it run the target every "
                "epoch; raise cache_budget_mb if memory allows", self._ctx_name, cache.bytes / 2**20, len(cache))
        return hidden, sum(int(batch.meta.lengths[i]) for i in computed)

    def process(self, batch: PaddedBatch):
        import time

        import torch

        if batch.meta.filler:
            # No samples: features of the right width and no rows, so the drafter's zero step is cheap.
            width = self._backend.hidden_size * len(self._layer_ids)
            empty = torch.zeros((0, 0), dtype=torch.long, device=self._out_device)
            hidden = torch.zeros((0, 0, width), device=self._out_device)
            return (TargetFeatures(meta=batch.meta, input_ids=empty, loss_mask=empty, attention_mask=empty,
                                   hidden_states=hidden, target_layer_ids=self._layer_ids),)

        top = int(batch.input_ids.max()) if batch.input_ids.numel() else 0
        if top >= self._vocab or int(batch.input_ids.min()) < 0:
            from dflash_flow.data.records import DataError

            raise DataError(
                f"batch {batch.meta.index} of epoch {batch.meta.epoch} (samples {list(batch.meta.sample_ids)[:8]}) "
                f"has token id {top} outside the target's vocabulary of {self._vocab}: the data was tokenized "
                "for another model (set TokenizedSource.vocab_size to reject such rows when reading)"
            )
        t0 = time.perf_counter()
        # The backend copies the host rows on its own stream and returns an ordinary tensor on the output device,
        # its stream already synchronized.
        if self.cache_features:
            hidden, forwarded = self._cached_forward(batch, batch.input_ids)
        else:
            hidden = self._backend.features(batch.input_ids, batch.attention_mask, batch.meta.lengths,
                                            batch.meta.sample_ids)
            forwarded = batch.meta.real_tokens
        self._m.forward_s.observe(time.perf_counter() - t0)
        self._m.tokens.inc(forwarded)  # a cached row ran no target
        self._m.batches.inc()
        # The token rows stay on the host: the trainer copies them without blocking beside the features.
        return (TargetFeatures(meta=batch.meta, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                               attention_mask=batch.attention_mask, hidden_states=hidden, target_layer_ids=self._layer_ids),)

    def teardown(self) -> None:
        backend = getattr(self, "_backend", None)
        if backend is not None:
            backend.close()
        self._backend = None
