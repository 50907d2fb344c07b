"""Monitor: samples the pipeline every `interval_s` into the run's record, logs to MLflow, shows progress."""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Any

import attrs

from dflash_flow.core import Stage, cfg, limits
from dflash_flow.core.metrics import Counter, stage_metric
from dflash_flow.core.registry import resolve
from dflash_flow.items import EvalReport, StepReport
from dflash_flow.observe.names import eval_label, eval_tags
from dflash_flow.observe.progress import ProgressPrinter
from dflash_flow.observe.sample import (
    EpochPoint,
    EvalPoint,
    HeldoutPoint,
    Throughput,
    TrainPoint,
    take_sample,
)
from dflash_flow.observe.schema import metric_points, mlflow_metrics, reduce_ranks
from dflash_flow.services import services_of


@attrs.define
class MonitorMetrics:
    samples: Counter = stage_metric("samples", "Monitor samples taken")


@attrs.define(kw_only=True, eq=False)
class Monitor(Stage):
    """Samples metrics, queue depths and stage load into the run record; logs them to MLflow; prints progress."""

    input_type = object  # StepReport and EvalReport
    output_type = None
    stage_metrics = (MonitorMetrics,)
    singleton = True
    affects_result = False  # it observes: a resume may change any of its settings

    interval_s: float = cfg(30.0, gt=0, le=limits.MAX_SECONDS, doc="Seconds between samples of the whole pipeline.")
    progress: bool = cfg(True, doc="Show live progress on the console.")
    progress_interval_s: float | None = cfg(None, gt=0, le=limits.MAX_SECONDS, doc="Seconds between plain progress lines when not a terminal (default: interval_s).")
    total_steps: int | None = cfg(None, ge=1, doc="Steps expected (for the ETA); default: from the reports.")
    plots: bool = cfg(True, doc="Ask for PNG plots in the end-of-run report (and in MLflow).")
    sinks: list[str] = cfg(factory=list, doc="Stages for which being the bottleneck is the goal (default: the trainer feeding this monitor).")
    _printer: Any = attrs.field(default=None, init=False)
    _bannered: bool = attrs.field(default=False, init=False)  # the run's plan was shown
    _subscription: Any = attrs.field(default=None, init=False)

    def setup(self, ctx) -> None:
        services = services_of(ctx)
        self._ctx = ctx
        # Under torchrun every rank's Monitor reduces each step's metrics with the others; rank 0 logs and prints.
        self._dist = services.dist
        self._main = self._dist is None or self._dist.rank == 0
        self._tracker = services.tracker
        self._record = services.record
        self._record.plots = self.plots
        if self.total_steps:
            self._record.total_steps = self.total_steps
        self._last_sample = time.monotonic()
        # The snapshot that opens the current window (each sample's snapshot opens the next one).
        self._prev = ctx.runtime.snapshot() if ctx.runtime is not None else None
        self._window: list[list[float]] = []  # per block slot: [sum, count] over the sampling window
        self._open_epoch: tuple[int, int] | None = None  # (epoch, its last step) whose mean is not logged yet
        self._printer = None
        if self.progress and self._main:
            printer = self._printer = ProgressPrinter(sys.stderr, total_steps=self.total_steps,
                                                      elapsed_before_s=self._record.elapsed_before_s,
                                                      interval_s=self.progress_interval_s or self.interval_s)
            self._record.watch_phase(lambda p: printer.show(p.line(), force=p.done in (0, p.total)))
        graph = ctx.runtime.graph if ctx.runtime is not None else None
        self._edges: dict[str, list[str]] = {}
        self._sinks = set(self.sinks)
        self._fixed: set[str] = set()  # stages that cannot take more replicas (the verdict advises ranks)
        # The steady state the run's verdict covers: snapshots at the first and the latest training step.
        self._steady: list[Any] = [None, None]
        self._steady_at = 0.0
        if graph is not None:
            for s in graph.stages:
                for i in s.inputs:
                    self._edges.setdefault(i.stage, []).append(s.name)
                try:
                    cls = resolve(s.type)
                except Exception:  # noqa: BLE001 - a type the registry cannot name: assume it replicates
                    continue
                if cls.singleton or s.ordered or (cls.is_source() and not cls.shards_by_replica):
                    self._fixed.add(s.name)
            if not self._sinks:
                self._sinks = {i.stage for i in graph.stage(ctx.name).inputs}
        self._m = ctx.metrics.declare(MonitorMetrics)
        self._record.logging_started()  # a checkpoint of step S waits until step S's metrics are handed over
        self._lock = threading.Lock()  # the window and the record's samples: this thread and the sampler's
        if ctx.runtime is not None and self._dist is None:
            self._subscription = ctx.runtime.subscribe(self._tick, self.interval_s, owner=ctx.name)

    def process(self, item: Any):
        now = time.monotonic()
        # Under torchrun the ranks sample together at step reports; in one process the sampler does it.
        due = self._dist is not None and now - self._last_sample >= self.interval_s
        if isinstance(item, StepReport):
            due = self._on_step(item, due)
            self._note_steady(item, now)
            self._record.mark_logged(item.step)
        elif isinstance(item, EvalReport):
            self._on_eval(item)
            due = False
        if due:
            with self._lock:
                self._sample(now)
        if self._printer is not None and isinstance(item, StepReport):
            r, m = self._record, self._record.train
            self._printer.update(r.step, epoch=r.epoch, tokens_per_s=m.get("tokens_per_s"),
                                 samples_per_s=m.get("samples_per_s"), loss=m.get("loss"),
                                 bottleneck=r.bottleneck.stage if r.bottleneck is not None else None,
                                 extra=self._accept_extra())

    def _on_step(self, item: StepReport, due: bool) -> bool:
        """Record one step report; returns whether to sample now (under torchrun: whether any rank wants to)."""
        if self._dist is not None:
            reduced, positions, due = self._dist.reduce_train(item.metrics, item.position_accuracy, due)
            item = attrs.evolve(item, metrics=reduced, position_accuracy=positions)
        record = self._record
        if item.artifacts:
            record.artifacts.update(item.artifacts)
        if item.total_steps and not self.total_steps:
            record.total_steps = item.total_steps
            if self._printer is not None:
                self._printer.total_steps = item.total_steps
        plan = item.meta.plan if item.meta is not None else None
        if plan is not None and not self._bannered:
            self._bannered = True  # once, before the first step's line
            if self._printer is not None:
                self._printer.message(plan.sentence(item.total_steps))
        logged = dict(item.metrics)
        # Per block slot: noisy per step and many, so logged as their mean over each sampling window.
        windowed = tuple(item.position_accuracy)
        with self._lock:
            self._window.extend([0.0, 0] for _ in range(len(windowed) - len(self._window)))
            for acc, v in zip(self._window, windowed, strict=False):
                acc[0] += v
                acc[1] += 1
        meta = item.meta if item.meta is not None and not item.meta.filler and item.meta.bucket >= 0 else None
        point = TrainPoint(step=item.step, epoch=item.epoch, metrics=logged, positions=windowed,
                           bucket=meta.bucket if meta is not None else None,
                           bucket_range=meta.bucket_range if meta is not None else None)
        if self._open_epoch is not None and (logged or windowed) and item.epoch != self._open_epoch[0]:
            self._log_epoch_mean()  # the first step of the next epoch ends the previous one
        record.add_train(point)  # the final report carries artifacts, not metrics: it only moves the step
        if self._tracker is not None and logged:
            self._tracker.log_metrics(mlflow_metrics(point), step=item.step)
        if item.heldout is not None:
            self._on_heldout(item)
        if (logged or windowed) and item.epoch is not None:
            self._open_epoch = (item.epoch, item.step)
        if item.final or (item.meta is not None and item.meta.last_of_epoch and (logged or windowed)):
            # Its means go out before a checkpoint of this step commits (a run resumed from it would not log them).
            self._log_epoch_mean()
        return due

    def _on_heldout(self, item: StepReport) -> None:
        """Acceptance over time: the trainer's held-out walk into the record, MLflow and the console."""
        point = HeldoutPoint.of(item.step, item.heldout)
        self._record.add_heldout(point)
        if self._tracker is not None:
            self._tracker.log_metrics(mlflow_metrics(point), step=item.step)
        if self._printer is not None:
            v = point.values
            self._printer.message(f"held-out walk at step {item.step} ({v.elapsed_s:.0f} s): tau {v.tau:.3f} "
                                  f"over {point.conversations} conversations ({v.probe_s:.2f} s)")

    def _note_steady(self, item: StepReport, now: float) -> None:
        """Keep the snapshots that bound the training steady state (the first step's and the latest step's)."""
        runtime = self._ctx.runtime
        if runtime is None or (not item.metrics and not item.final):
            return
        first = self._steady[0] is None
        if first or item.final or now - self._steady_at >= 0.5:
            self._steady[0 if first else 1] = runtime.snapshot()
            self._steady_at = now

    def _log_epoch_mean(self) -> None:
        """Log the open epoch's means (once): ``train_epoch/<metric>`` at the epoch's last step."""
        if self._open_epoch is None:
            return
        epoch, step = self._open_epoch
        self._open_epoch = None
        means = self._record.epoch_mean(epoch)
        positions = self._record.epoch_positions(epoch)
        if self._tracker is not None and (means or positions):
            point = EpochPoint(step=step, epoch=epoch, means=means, positions=positions)
            self._tracker.log_metrics(mlflow_metrics(point), step=step)

    def _accept_extra(self) -> dict[str, float] | None:
        """The progress line's acceptance: the current epoch's running mean (one batch's value is noise)."""
        if "sim_accept_len" not in self._record.train:
            return None
        mean = self._record.epoch_mean().get("sim_accept_len")
        return {"train accept (sim, epoch mean)": mean} if mean is not None else None

    def _on_eval(self, item: EvalReport) -> None:
        point = EvalPoint(step=self._record.step, reports=(item,))
        self._record.add_eval(point)
        if self._tracker is not None:
            self._tracker.log_metrics(mlflow_metrics(point), step=point.step)
            self._tracker.set_tags(eval_tags(item))  # settings and facts (max_new_tokens, lossless): not curves
            self._tracker.flush_async()
        if self._printer is not None:
            self._printer.message(f"eval {eval_label(item)}: " + ", ".join(f"{k} {v:.4g}" for k, v in item.metrics.items()))

    # -- sampling ---------------------------------------------------------------------------------
    def _tick(self, snap: Any) -> None:
        """The runtime sampler's call (its thread), every ``interval_s``."""
        with self._lock:
            self._sample(time.monotonic(), snap=snap)

    def _sample(self, now: float, whole_run: bool = False, snap: Any = None) -> None:
        """One sample of the whole pipeline into the record (and MLflow); the caller holds ``_lock``."""
        runtime = self._ctx.runtime
        if runtime is None:
            return
        prev = self._prev
        if whole_run:
            # The closing verdict covers the steady state (first to last training step), else the whole run.
            first, last = self._steady
            if first is not None and last is not None and last.time - first.time > 1e-3:
                snap, prev = last, first
            else:
                prev = None
        snap = snap if snap is not None else runtime.snapshot()
        positions = [total / n if n else math.nan for total, n in self._window]
        self._window = []
        m = self._record.train
        sample = take_sample(
            snap, prev, step=self._record.step, positions=positions,
            throughput=Throughput(tokens_per_s=m.get("tokens_per_s"), samples_per_s=m.get("samples_per_s")),
            sinks=self._sinks, edges=self._edges, exclude={self._ctx.name}, fixed=self._fixed, whole_run=whole_run)
        self._prev = snap
        per_rank = self._dist.gather_to_main(sample) if self._dist is not None else None
        self._record.add_sample(sample)
        if self._tracker is not None:
            if per_rank:
                # Plain keys: the job, reduced over ranks as each metric declares; rank<r>/...: each rank.
                metrics = reduce_ranks([metric_points(s) for s in per_rank])
                for r, other in enumerate(per_rank):
                    metrics.update(mlflow_metrics(other, rank=r))
            else:
                metrics = mlflow_metrics(sample)
            self._tracker.log_metrics(metrics, step=sample.step)
            self._tracker.flush_async()  # store writes happen on the tracker's writer thread
        self._m.samples.inc()
        self._last_sample = now

    def finish(self):
        self._unsubscribe()  # the closing sample is the last one
        self._log_epoch_mean()
        with self._lock:
            self._sample(time.monotonic(), whole_run=True)

    def _unsubscribe(self) -> None:
        if self._subscription is not None and self._ctx.runtime is not None:
            self._ctx.runtime.unsubscribe(self._subscription)
        self._subscription = None

    def teardown(self) -> None:
        self._unsubscribe()
        if getattr(self, "_record", None) is not None:
            self._record.logging_ended()
        if self._printer is not None:
            self._printer.close()
            self._printer = None
