"""Interleaver: orders each epoch's batches diversity-first and deals this rank its share."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from dflash_flow.core import Stage, StageContext, cfg
from dflash_flow.data.plan import plan_field
from dflash_flow.items import EpochBatches, PlannedBatch


@attrs.define(kw_only=True, eq=False)
class Interleaver(Stage):
    """Orders an epoch's bucket batches with a same-bucket run cap and an even mix; resumable by position."""

    input_type = EpochBatches
    output_type = PlannedBatch
    cardinality = "1:n"
    singleton = True  # one ordered stream per rank

    max_run: int = plan_field("max_run")
    repeat_penalty: float = plan_field("repeat_penalty")
    evenness: float = plan_field("evenness")
    rank_aware: bool = cfg(
        True, doc="Order so that each rank's own share keeps the cap (else one global order)."
    )
    tail: Literal["pad", "drop"] = cfg(
        "pad",
        choices=("pad", "drop"),
        doc="Equal batches per rank: pad repeats the epoch's first batches; drop cuts.",
    )

    max_batches: int | None = cfg(None, ge=1, doc="Stop after this many batches in all (this rank); null: every epoch in full.")

    _epoch: int = attrs.field(default=0, init=False)
    _emitted: int = attrs.field(default=0, init=False)
    _position: int = attrs.field(default=0, init=False)
    _fingerprint: Any = attrs.field(default=None, init=False)
    _plan_world: int = attrs.field(default=1, init=False)
    _resume: Any = attrs.field(default=None, init=False)

    def setup(self, ctx: StageContext) -> None:
        self._ctx = ctx
        m = ctx.metrics
        self._m_batches = m.counter("batches", "batches", "Batches dispatched")
        self._m_bucket = m.labeled("bucket_dispatch", "batches", "Batches dispatched per bucket (the Monitor plots the mix)")
        self._m_run = m.gauge("max_same_bucket_run", "batches", "Longest same-bucket run dispatched")
        self._m_cap = m.gauge("run_cap", "batches", "Run cap in force (above max_run when infeasible)")
        self._m_epoch = m.gauge("epoch", "epoch", "Epoch being dispatched")
        self._last_bucket, self._run, self._max_run = -1, 0, 0

    def process(self, item: EpochBatches):
        from dflash_flow.data.plan import order_packed

        ctx = self._ctx
        world = ctx.world_size
        plan = order_packed(
            item.packed,
            max_run=self.max_run,
            repeat_penalty=self.repeat_penalty,
            evenness=self.evenness,
            world_size=world if self.rank_aware else 1,
        )
        start = 0
        if self._resume is not None:
            state = self._resume
            if item.epoch < state["epoch"]:
                return  # consumed before the checkpoint
            if item.epoch == state["epoch"]:
                # A state derived from the trainer's position knows neither the plan's fingerprint nor
                # how it was ordered; the plan is rebuilt from the same data, config and seed.
                state.setdefault("plan_world_size", plan.world_size)
                start = plan.check_state(state)
            self._resume = None
        self._epoch, self._position = item.epoch, start
        self._fingerprint, self._plan_world = plan.fingerprint(), plan.world_size
        self._m_epoch.set(item.epoch)
        self._m_cap.set(plan.max_run)
        positions = plan.rank_positions(ctx.rank, world, start=start, tail=self.tail)
        full = plan.rank_positions(ctx.rank, world, start=0, tail=self.tail)
        n = len(plan)
        # Sizes the trainer needs for its schedule and epoch-end checkpoints. Packing varies slightly per
        # epoch, so the run total is estimated from this epoch's size (exact for the first epoch).
        epoch_size = len(full)
        total = epoch_size * item.num_epochs
        if self.max_batches is not None:
            # Emitted in earlier epochs (after a mid-epoch resume, _emitted also counts this epoch's start).
            done_before = self._emitted - (len(full) - len(positions))
            epoch_size = min(epoch_size, max(self.max_batches - done_before, 0))
            total = min(total, self.max_batches)
        for step, pos in enumerate(positions.tolist()):
            if ctx.stop_requested.is_set():
                return
            if self.max_batches is not None and self._emitted >= self.max_batches:
                return
            meta = plan.meta(pos)
            meta.epoch_batches = epoch_size
            meta.total_batches = total
            meta.rank = ctx.rank
            samples = [item.samples[i] for i in plan.batch(pos).tolist()]
            # Advance before yielding: a state taken while this batch is downstream must count it.
            self._position = min(start + (step + 1) * world, n)
            self._emitted += 1
            self._count(meta.bucket)
            yield PlannedBatch(meta=meta, samples=samples)

    def _count(self, bucket: int) -> None:
        self._m_batches.inc()
        self._m_bucket.inc(bucket)
        self._run = self._run + 1 if bucket == self._last_bucket else 1
        self._last_bucket = bucket
        if self._run > self._max_run:
            self._max_run = self._run
            self._m_run.set(self._run)

    def state_dict(self) -> dict[str, Any]:
        if self._resume is not None:  # restored but not reached yet: keep it unchanged
            return dict(self._resume)
        return {
            "version": 1,
            "epoch": self._epoch,
            "position": self._position,
            "plan_world_size": self._plan_world,
            "fingerprint": self._fingerprint,
            "emitted": self._emitted,
        }

    @classmethod
    def resume_state_for(cls, position: dict[str, Any]) -> dict[str, Any]:
        """The state that continues right after what the trainer consumed.

        The Interleaver runs ahead of the trainer by whatever sits in the queues; resuming from its own
        state would skip those batches. ``position`` is the trainer's: batches of ``epoch`` it consumed
        on this rank, the world size, and the run total.
        """
        world = int(position.get("world_size", 1))
        return {
            "version": 1,
            "epoch": int(position["epoch"]),
            "position": int(position["consumed"]) * world,
            "fingerprint": None,
            "emitted": int(position.get("total", 0)),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported Interleaver state version {state.get('version')!r}")
        self._resume = dict(state)
        self._emitted = int(state.get("emitted", 0))
