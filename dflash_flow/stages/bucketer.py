"""Bucketer: collects all samples, then packs each epoch's batches per length bucket (token budget)."""

from __future__ import annotations

from typing import Optional

import attrs

from dflash_flow.core import Stage, StageContext, cfg, derive_seed
from dflash_flow.data.plan import plan_field
from dflash_flow.items import EpochBatches, Sample


@attrs.define(kw_only=True, eq=False)
class Bucketer(Stage):
    """Packs samples into length-bucketed batches under a padded-token budget, one item per epoch."""

    input_type = Sample
    output_type = EpochBatches
    cardinality = "1:n"
    singleton = True  # the plan needs every sample: one Bucketer per process

    max_tokens: int = plan_field("max_tokens")
    max_batch_size: Optional[int] = plan_field("max_batch_size")
    pad_to_multiple: int = plan_field("pad_to_multiple")
    boundaries: Optional[list[int]] = plan_field("boundaries")
    num_buckets: int = plan_field("num_buckets")
    length_jitter: float = plan_field("length_jitter")
    epochs: int = cfg(1, ge=1, doc="Epochs to plan.")

    def setup(self, ctx: StageContext) -> None:
        self._ctx = ctx
        self._samples: list[Sample] = []
        m = ctx.metrics
        self._m_samples = m.counter("samples", "samples", "Samples collected")
        self._m_buckets = m.gauge("buckets", "buckets", "Number of length buckets")
        self._m_batches = m.labeled("packed_per_bucket", "batches", "Batches packed per bucket (last epoch)")
        self._m_epoch = m.gauge("epoch", "epoch", "Last epoch packed")

    def process(self, item: Sample):
        self._samples.append(item)
        self._m_samples.inc()
        return None

    def finish(self):
        import numpy as np

        from dflash_flow.data.plan import BatchPlanner, PlanConfig

        if not self._samples or self._ctx.stop_requested.is_set():
            return  # nothing to plan, or stopping: no epoch is packed for a run that ends now
        # Arrival order can depend on thread timing upstream; the plan must not.
        self._samples.sort(key=lambda s: s.sample_id)
        ids = np.fromiter((s.sample_id for s in self._samples), dtype=np.int64, count=len(self._samples))
        if np.unique(ids).size != ids.size:
            raise ValueError(
                f"stage '{self._ctx.name}': duplicate sample ids (two sources numbering from 0?)"
            )
        lengths = np.fromiter((len(s) for s in self._samples), dtype=np.int64, count=len(self._samples))
        config = PlanConfig(
            max_tokens=self.max_tokens,
            max_batch_size=self.max_batch_size,
            pad_to_multiple=self.pad_to_multiple,
            boundaries=self.boundaries,
            num_buckets=self.num_buckets,
            length_jitter=self.length_jitter,
        )
        # rank 0 on purpose: every rank must build the same global plan.
        seed = derive_seed(self._ctx.seed, 0, 0, self._ctx.name)
        planner = BatchPlanner(lengths, config, seed=seed, sample_ids=ids)
        self._m_buckets.set(planner.num_buckets)
        for epoch in range(self.epochs):
            if self._ctx.stop_requested.is_set():
                return
            packed = planner.pack(epoch)
            for b, n in enumerate(packed.counts):
                self._m_batches.inc(b, n)
            self._m_epoch.set(epoch)
            yield EpochBatches(epoch=epoch, packed=packed, samples=self._samples, num_epochs=self.epochs)

    # Re-packing is cheap and a pure function of the samples, so every run packs from epoch 0 and the
    # Interleaver skips what was consumed: no state that could disagree with the Interleaver's (the base
    # class's empty one).
