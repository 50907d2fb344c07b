"""Interleaver: orders each epoch's batches into global steps and deals this rank its batch of each."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from dflash_flow.core import Stage, StageContext, cfg
from dflash_flow.core.errors import SavedStateError
from dflash_flow.core.metrics import Counter, Gauge, Labeled, stage_metric
from dflash_flow.data.epoch import DataPosition, order_packed, resume_plan
from dflash_flow.data.packing import plan_field
from dflash_flow.items import EpochBatches, PlannedBatch, RunPlan


@attrs.define
class InterleaverMetrics:
    batches: Counter = stage_metric("batches", "Batches dispatched")
    fillers: Counter = stage_metric("batches", "Filler batches dispatched (keep ranks in step)")
    bucket_dispatch: Labeled = stage_metric("batches", "Batches dispatched per bucket (the Monitor plots the mix)")
    max_same_bucket_run: Gauge = stage_metric("batches", "Longest same-bucket run dispatched")
    run_cap: Gauge = stage_metric("batches", "Run cap in force (above max_run when infeasible)")
    epoch: Gauge = stage_metric("epoch", "Epoch being dispatched")


@attrs.define(kw_only=True, eq=False)
class Interleaver(Stage):
    """Orders an epoch's bucket batches into global steps with a same-bucket run cap and an even mix;
    every rank takes one batch per step (fillers keep short ranks in step); resumable, also elastically."""

    input_type = EpochBatches
    output_type = PlannedBatch
    stage_metrics = (InterleaverMetrics,)
    cardinality = "1:n"
    singleton = True  # one ordered stream per rank
    state_version = 2

    max_run: int = plan_field("max_run")
    repeat_penalty: float = plan_field("repeat_penalty")
    evenness: float = plan_field("evenness")
    tail: Literal["filler", "drop"] = cfg("filler", choices=("filler", "drop"), doc="The last step of an epoch with "
                                          "fewer batches than ranks: filler batches (train nothing) for the short "
                                          "ranks, or drop the step.")
    max_batches: int | None = cfg(None, ge=1, run_length=True, doc="Stop after this many batches (steps) in all, per rank; null: every epoch in full.")

    _epoch: int = attrs.field(default=0, init=False)
    _emitted: int = attrs.field(default=0, init=False)
    _plan_state: Any = attrs.field(default=None, init=False)
    _resume: Any = attrs.field(default=None, init=False)

    def setup(self, ctx: StageContext) -> None:
        self._ctx = ctx
        self._m = ctx.metrics.declare(InterleaverMetrics)
        self._last_bucket, self._run, self._max_run = -1, 0, 0

    def _plan(self, item: EpochBatches):
        """(plan, first global position) for this epoch, continuing a checkpoint's plan if there is one."""
        world = self._ctx.world_size
        state = self._resume
        if state is not None and item.epoch == state["epoch"] and state.get("plan"):
            # Rebuilt from the same data, config and seed (fingerprint checked), re-dealt for a new rank count.
            try:
                base = self._order(item, world_size=int(state["plan"]["chain"][0][0]))
                return resume_plan(base, state["plan"], world)
            except (TypeError, ValueError, KeyError, IndexError) as exc:
                # The checkpoint's data position does not fit the plan rebuilt from this data and config.
                raise SavedStateError(f"the checkpoint's data position cannot continue this run's plan of epoch "
                                      f"{item.epoch}: {exc}") from exc
        return self._order(item, world_size=world), 0

    def _order(self, item: EpochBatches, *, world_size: int):
        return order_packed(item.packed, max_run=self.max_run, repeat_penalty=self.repeat_penalty,
                            evenness=self.evenness, world_size=world_size)

    def process(self, item: EpochBatches):
        ctx = self._ctx
        if self._resume is not None and item.epoch < self._resume["epoch"]:
            return  # consumed before the checkpoint
        plan, start = self._plan(item)
        self._resume = None
        self._epoch = item.epoch
        self._m.epoch.set(item.epoch)
        self._m.run_cap.set(plan.max_run)
        world = plan.world_size
        positions = plan.rank_positions(ctx.rank, start=start, tail=self.tail).tolist()
        # The trainer's schedule: the steps this rank takes in this and every later epoch, max_batches applied.
        cut = len(positions)
        ahead = [cut, *(-(-n // world) if self.tail == "filler" else n // world for n in self._later_sizes(item))]
        if self.max_batches is not None:
            budget = max(self.max_batches - self._emitted, 0)
            for i, n in enumerate(ahead):
                ahead[i] = min(n, budget)
                budget -= ahead[i]
        epoch_steps = ahead[0]
        total = self._emitted + sum(ahead)
        run_plan = RunPlan(samples=len(item.samples), epochs=item.num_epochs, batches=total, world_size=world,
                           max_tokens=item.max_tokens, buckets=len(item.packed.counts), from_epoch=item.epoch)
        first_step = start // world
        for s, pos in enumerate(positions[:epoch_steps]):
            if ctx.stop_requested.is_set():
                return
            meta = plan.meta(pos)
            meta.rank = ctx.rank
            meta.step = first_step + s
            meta.total_batches = total
            meta.batches_ahead = (epoch_steps - s, *ahead[1:])
            meta.last_of_epoch = s == cut - 1
            # The run's last batch for this rank: max_batches reached, or the last epoch's last batch.
            meta.last_of_run = sum(meta.batches_ahead) == 1
            # Advance before yielding: a state taken while this batch is downstream must count it.
            self._plan_state = plan.state_dict(min(start + (s + 1) * world, len(plan)))
            meta.plan_state = self._plan_state
            meta.plan = run_plan
            samples = [] if meta.filler else [item.samples[i] for i in plan.batch(pos).tolist()]
            self._emitted += 1
            self._count(meta)
            yield PlannedBatch(meta=meta, samples=samples)

    @staticmethod
    def _later_sizes(item: EpochBatches) -> list[int]:
        """Global batch counts of the epochs after ``item``'s (taken as large as this one when not given)."""
        later = range(item.epoch + 1, item.num_epochs)
        if len(item.epoch_sizes) >= item.num_epochs:
            return [int(item.epoch_sizes[e]) for e in later]
        return [sum(item.packed.counts)] * len(later)

    def _count(self, meta) -> None:
        if meta.filler:
            self._m.fillers.inc()
            return
        self._m.batches.inc()
        self._m.bucket_dispatch.inc(meta.bucket)
        self._run = self._run + 1 if meta.bucket == self._last_bucket else 1
        self._last_bucket = meta.bucket
        if self._run > self._max_run:
            self._max_run = self._run
            self._m.max_same_bucket_run.set(self._run)

    def get_state(self) -> dict[str, Any]:
        if self._resume is not None:  # restored but not reached yet: keep it unchanged
            return dict(self._resume)
        return {"epoch": self._epoch, "plan": self._plan_state, "emitted": self._emitted}

    @classmethod
    def resume_state_for(cls, position: DataPosition) -> dict[str, Any]:
        """The state that continues right after what the trainer consumed (its own would skip the queued batches)."""
        return {"version": cls.state_version, "epoch": position.epoch, "plan": position.plan,
                "emitted": position.total}

    def set_state(self, state: dict[str, Any]) -> None:
        self._resume = dict(state)
        self._emitted = int(state.get("emitted", 0))
