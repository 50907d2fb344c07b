"""Bucketer: collects the corpus, then packs each epoch's batches per length bucket (optionally a mixture)."""

from __future__ import annotations

import logging
import math
from typing import Any, Optional

import attrs
import numpy as np

from dflash_flow.core import Stage, StageContext, cfg, derive_seed
from dflash_flow.core.metrics import Counter, Gauge, Labeled, stage_metric
from dflash_flow.data.packing import PlanConfig, bucket_boundaries, plan_field
from dflash_flow.items import EpochBatches, Sample, SampleSet, SampleTable

log = logging.getLogger(__name__)


def _weights_ok(_inst, _attr, value) -> None:
    if value is None:
        return
    if not value:
        raise ValueError("mixture must name at least one source (or be null)")
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"mixture weight of '{k}' must be a finite number >= 0, got {v!r}")
    if sum(value.values()) <= 0:
        raise ValueError("mixture weights are all 0")


@attrs.define
class BucketerMetrics:
    samples: Counter = stage_metric("samples", "Samples collected")
    buckets: Gauge = stage_metric("buckets", "Number of length buckets")
    packed_per_bucket: Labeled = stage_metric("batches", "Batches packed per bucket (last epoch)")
    epoch: Gauge = stage_metric("epoch", "Last epoch packed")
    mixture_samples: Labeled = stage_metric("samples", "Samples drawn per source, all epochs so far")
    mixture_tokens: Labeled = stage_metric("tokens", "Tokens drawn per source, all epochs so far")


@attrs.define(kw_only=True, eq=False)
class Bucketer(Stage):
    """Packs samples into length-bucketed batches under a padded-token budget, one item per epoch. Stateless: every
    run re-packs from epoch 0 (a pure function of the samples) and the Interleaver skips what was consumed."""

    input_type = SampleSet
    output_type = EpochBatches
    stage_metrics = (BucketerMetrics,)
    cardinality = "1:n"
    singleton = True  # the plan needs every sample: one Bucketer per process

    max_tokens: int = plan_field("max_tokens")
    max_batch_size: Optional[int] = plan_field("max_batch_size")
    pad_to_multiple: int = plan_field("pad_to_multiple")
    boundaries: Optional[list[int]] = plan_field("boundaries")
    num_buckets: int = plan_field("num_buckets")
    length_jitter: float = plan_field("length_jitter")
    epochs: int = cfg(1, ge=1, run_length=True, doc="Epochs to plan.")
    mixture: Optional[dict[str, float]] = attrs.field(
        default=None, validator=_weights_ok, kw_only=True,
        metadata={"config": True, "doc": "Weight per source stage, e.g. {chat: 0.6, code: 0.3, math: 0.1}: each epoch "
                  "draws samples_per_epoch samples in these proportions; null: every sample once per epoch."},
    )
    mixture_replacement: bool = cfg(False, doc="Draw a source's samples with replacement (else: whole passes in "
                                    "random order, then a random subset).")
    samples_per_epoch: Optional[int] = cfg(None, ge=1, doc="Samples per epoch with a mixture (null: the corpus size).")

    def setup(self, ctx: StageContext) -> None:
        self._ctx = ctx
        self._samples: list[Sample] = []
        self._tables: list[SampleTable] = []
        self._m = ctx.metrics.declare(BucketerMetrics)

    def process(self, item: SampleSet):
        if isinstance(item, SampleTable):
            self._tables.append(item)
            self._m.samples.inc(len(item))
        else:
            self._samples.append(item)
            self._m.samples.inc()

    def _corpus(self):
        from dflash_flow.data.plan import Corpus

        # Arrival order can depend on thread timing upstream; the plan must not.
        corpus = Corpus(self._tables, self._samples)
        if not self._tables:
            ids = corpus.sample_ids
            if np.unique(ids).size != ids.size:
                raise ValueError(f"stage '{self._ctx.name}': duplicate sample ids (two sources numbering from 0?)")
        seen: dict[str, str] = {}
        for t in corpus.tables:
            for digest, path in zip(t.digests, t.inputs, strict=False):
                if digest in seen and seen[digest] != t.name:
                    log.warning("%s: %s (source '%s') has the same content as an input of source '%s': it is "
                                "trained on twice per epoch; use mixture weights to weight a source",
                                self._ctx.name, path, t.name, seen[digest])
                seen.setdefault(digest, t.name)
        return corpus

    def _no_samples(self):
        """An empty dataset trains nothing: an error naming what each source read, never a run of 0 steps."""
        from dflash_flow.data.reports import DataError

        read = [f"source '{t.name}' read 0 samples from {', '.join(t.inputs) or 'its inputs'}" for t in self._tables]
        what = "; ".join(read) if read else "no source emitted a sample"
        return DataError(f"stage '{self._ctx.name}': nothing to train on: {what} (an empty file, or every record "
                         "skipped or too long: see the source's report)")

    def finish(self):
        from dflash_flow.data.plan import BatchPlanner, EpochView, describe_mixture, draw_epoch

        if self._ctx.stop_requested.is_set():
            return  # stopping: no epoch is packed for a run that ends now
        corpus = self._corpus() if self._samples or self._tables else None
        if corpus is None or len(corpus) == 0:
            raise self._no_samples()
        config = PlanConfig(max_tokens=self.max_tokens, max_batch_size=self.max_batch_size,
                            pad_to_multiple=self.pad_to_multiple, boundaries=self.boundaries,
                            num_buckets=self.num_buckets, length_jitter=self.length_jitter)
        # rank 0 on purpose: every rank must build the same global plan.
        seed = derive_seed(self._ctx.seed, 0, 0, self._ctx.name)
        planner: Any = None
        if self.mixture is None:
            planner = BatchPlanner(corpus.lengths, config, seed=seed, sample_ids=corpus.sample_ids)
        else:  # bucket ids stay those of the whole corpus, whatever an epoch draws
            config = attrs.evolve(config, boundaries=tuple(int(b) for b in bucket_boundaries(corpus.lengths, config)))
        groups = corpus.groups

        def epoch_plan(epoch: int):
            """(planner, samples, drawn per source) of one epoch: a pure function of the corpus, seed and epoch."""
            if self.mixture is None:
                return planner, corpus, None
            pos, drawn = draw_epoch(groups, self.mixture, samples_per_epoch=self.samples_per_epoch,
                                    replacement=self.mixture_replacement, seed=seed, epoch=epoch)
            return (BatchPlanner(corpus.lengths[pos], config, seed=seed, sample_ids=corpus.sample_ids[pos]),
                    EpochView(corpus, pos), (pos, drawn))

        # Every epoch's exact batch count (packing varies) for the trainer's schedule; epoch 0's packing is kept.
        sizes: list[int] = []
        first: Any = None
        for epoch in range(self.epochs):
            if self._ctx.stop_requested.is_set():
                return
            packed = epoch_plan(epoch)[0].pack(epoch)
            first = packed if epoch == 0 else first
            sizes.append(sum(packed.counts))
        for epoch in range(self.epochs):
            if self._ctx.stop_requested.is_set():
                return
            planner_e, samples, mix = epoch_plan(epoch)
            if mix is not None:
                pos, drawn = mix
                src = np.searchsorted(corpus.starts, pos, side="right") - 1
                tokens = {name: int(corpus.lengths[pos[src == k]].sum()) for k, (name, _a, _b) in enumerate(groups)}
                for name, n in drawn.items():
                    self._m.mixture_samples.inc(name, n)
                    self._m.mixture_tokens.inc(name, tokens[name])
                if epoch == 0:
                    log.info("%s: %s", self._ctx.name, describe_mixture(groups, self.mixture, drawn, tokens))
            self._m.buckets.set(planner_e.num_buckets)
            packed = first if epoch == 0 else planner_e.pack(epoch)
            first = None
            for b, n in enumerate(packed.counts):
                self._m.packed_per_bucket.inc(b, n)
            self._m.epoch.set(epoch)
            yield EpochBatches(epoch=epoch, packed=packed, samples=samples, num_epochs=self.epochs,
                               epoch_sizes=tuple(sizes), max_tokens=self.max_tokens)
