"""What a run has recorded so far, as typed objects: filled by the Monitor while the pipeline runs
(``services.record``), read by the application's end of run (``observe.report``); and the trained-batch log.
"""

from __future__ import annotations

import errno
import json
import math
import os
import threading
from array import array
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.items import EvalReport
from dflash_flow.util import refuse_outside

from .bottleneck import Bottleneck
from .names import eval_json, eval_label
from .progress import format_duration, format_rate
from .sample import EvalPoint, HeldoutPoint, MonitorSample, TrainPoint, data_quality


@attrs.define(eq=False)
class TrainSeries:
    """Per-step trainer metrics as columns of float64 (NaN where a step did not report a metric): 8 bytes a
    value, a tenth of per-step dicts of boxed floats."""

    steps: array = attrs.field(factory=lambda: array("q"))
    columns: dict[str, array] = attrs.field(factory=dict)

    def append(self, step: int, metrics: Mapping[str, float]) -> None:
        n = len(self.steps)
        self.steps.append(int(step))
        for name, value in metrics.items():
            try:
                x = float(value)
            except (TypeError, ValueError):
                continue
            col = self.columns.get(name)
            if col is None:
                col = self.columns[name] = array("d", [math.nan]) * n
            col.append(x)
        for col in self.columns.values():
            if len(col) == n:
                col.append(math.nan)

    def series(self, name: str) -> list[tuple[int, float]]:
        """``[(step, value)]`` of one metric, finite values only."""
        col = self.columns.get(name)
        return [] if col is None else [(s, v) for s, v in zip(self.steps, col, strict=True) if math.isfinite(v)]

    def __len__(self) -> int:
        return len(self.steps)

    def to_json(self) -> dict[str, list]:
        return {"step": list(self.steps),
                **{name: [v if math.isfinite(v) else None for v in col] for name, col in self.columns.items()}}


@attrs.define(eq=False)
class History:
    """The run over time: every step's trainer metrics, every Monitor sample, every evaluation."""

    train: TrainSeries = attrs.field(factory=TrainSeries)
    samples: list[MonitorSample] = attrs.field(factory=list)
    evals: list[EvalPoint] = attrs.field(factory=list)
    heldout: list[HeldoutPoint] = attrs.field(factory=list)  # acceptance over time (the trainer's probe)
    # (step, bucket) of every trained step, and each bucket's lengths: the whole run's bucket mix as trained.
    trained_buckets: list[tuple[int, int]] = attrs.field(factory=list)
    bucket_ranges: dict[int, tuple[int, int]] = attrs.field(factory=dict)

    def __bool__(self) -> bool:  # whether anything was recorded
        return bool(len(self.train) or self.samples or self.evals or self.heldout)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "train": self.train.to_json(),
            # A verdict's ``loads`` copy the stage fractions the sample already holds.
            "samples": [jsonable(attrs.asdict(s, filter=lambda a, _: a.name != "loads")) for s in self.samples],
            "evals": [{"step": e.step, "results": {eval_label(r): eval_json(r) for r in e.reports}} for e in self.evals],
            "heldout": [jsonable(attrs.asdict(h)) for h in self.heldout],
            "trained_buckets": [list(p) for p in self.trained_buckets],
            "bucket_ranges": {str(b): list(r) for b, r in self.bucket_ranges.items()},
        }


@attrs.frozen
class PhaseProgress:
    """Counted work of a phase after training (the evaluation), for the console's progress line."""

    label: str  # e.g. "evaluate: decoding and walking held-out data"
    done: int
    total: int
    tokens: int  # tokens produced or walked so far
    elapsed_s: float
    unit: str = "units"

    def line(self) -> str:
        parts = [f"{self.label} {self.done}/{self.total} {self.unit}"]
        if self.elapsed_s > 0 and self.tokens:
            parts.append(f"{format_rate(self.tokens / self.elapsed_s)} tok/s")
        eta = self.elapsed_s / self.done * (self.total - self.done) if self.done else None
        parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)


@attrs.define(eq=False)
class _Mean:
    total: float = 0.0
    count: int = 0

    def add(self, value: Any) -> None:
        if (x := _finite(value)) is not None:
            self.total += x
            self.count += 1


@attrs.define(eq=False)
class RunRecord:
    """Filled by the Monitor (and the trainer's final report) while the pipeline runs; read by the
    application's end of run (summary files, plots, artifact uploads, the printed table)."""

    step: int = 0
    epoch: int | None = None
    history: History = attrs.field(factory=History)
    train: dict[str, float] = attrs.field(factory=dict)  # the last step's trainer metrics
    positions: tuple[float, ...] = ()  # the last step's per-position accuracies (block slot 1 first)
    evals: dict[str, EvalReport] = attrs.field(factory=dict)  # the last report of each evaluation, by label
    artifacts: dict[str, str] = attrs.field(factory=dict)  # named by the trainer's final report
    serve_commands: dict[str, str] = attrs.field(factory=dict)  # engine -> the command serving the export
    bottleneck: Bottleneck | None = None  # the latest verdict; after the Monitor's finish, the whole run's
    total_steps: int | None = None
    plots: bool = True  # whether the run asked for plots (the Monitor's ``plots`` option)
    # Seconds the resumed runs had run (their checkpoint's clock): the run's elapsed time goes on from there.
    elapsed_before_s: float = 0.0
    _epoch_means: dict[int, dict[str, _Mean]] = attrs.field(factory=dict, init=False, repr=False)
    _epoch_positions: dict[int, list[_Mean]] = attrs.field(factory=dict, init=False, repr=False)
    # The hand-off that puts a step's metrics in MLflow before a checkpoint of that step commits: the
    # Monitor says which step it has logged (``mark_logged``), the checkpoint service waits for it.
    _logged_step: int = attrs.field(default=-1, init=False, repr=False)
    _logger_live: bool = attrs.field(default=False, init=False, repr=False)
    _logged: threading.Condition = attrs.field(factory=threading.Condition, init=False, repr=False)
    phase: PhaseProgress | None = None  # the latest progress of the work after training
    _phase_watchers: list[Any] = attrs.field(factory=list, init=False, repr=False)

    # -- progress after training --------------------------------------------------------------------
    def watch_phase(self, fn: Any) -> None:
        """Call ``fn(PhaseProgress)`` at every ``note_phase`` (the Monitor's console line)."""
        self._phase_watchers.append(fn)

    def note_phase(self, progress: PhaseProgress) -> None:
        self.phase = progress
        for fn in list(self._phase_watchers):
            fn(progress)

    # -- the logging hand-off -----------------------------------------------------------------------
    def logging_started(self) -> None:
        """A Monitor will log every step report it gets (until ``logging_ended``)."""
        with self._logged:
            self._logger_live = True

    def logging_ended(self) -> None:
        with self._logged:
            self._logger_live = False
            self._logged.notify_all()

    def mark_logged(self, step: int) -> None:
        """Every step report up to ``step`` has been handed to the tracker."""
        with self._logged:
            if step > self._logged_step:
                self._logged_step = step
                self._logged.notify_all()

    def wait_logged(self, step: int, timeout_s: float) -> bool:
        """Wait until the step reports up to ``step`` were handed to the tracker (at once when no Monitor
        logs them); False when ``timeout_s`` ran out first."""
        with self._logged:
            return self._logged.wait_for(lambda: not self._logger_live or self._logged_step >= step, timeout_s)

    # -- filled by the Monitor ----------------------------------------------------------------------
    def add_train(self, point: TrainPoint) -> None:
        self.step = point.step
        if point.epoch is not None:
            self.epoch = point.epoch
        if point.bucket is not None:
            self.history.trained_buckets.append((point.step, point.bucket))
            if point.bucket_range is not None:
                self.history.bucket_ranges[point.bucket] = (int(point.bucket_range[0]), int(point.bucket_range[1]))
        if not point.metrics and not point.positions:
            return
        self.train = dict(point.metrics)
        self.history.train.append(point.step, point.metrics)
        epoch = point.epoch if point.epoch is not None else -1
        if point.positions:
            self.positions = tuple(point.positions)
            slots = self._epoch_positions.setdefault(epoch, [])
            slots.extend(_Mean() for _ in range(len(point.positions) - len(slots)))
            for m, v in zip(slots, point.positions, strict=False):
                m.add(v)
        acc = self._epoch_means.setdefault(epoch, {})
        for name, value in self.train.items():
            acc.setdefault(name, _Mean()).add(value)

    def add_eval(self, point: EvalPoint) -> None:
        for report in point.reports:
            self.evals[eval_label(report)] = report
        self.history.evals.append(point)

    def add_heldout(self, point: HeldoutPoint) -> None:
        self.history.heldout.append(point)

    def add_sample(self, sample: MonitorSample) -> None:
        self.history.samples.append(sample)
        if sample.bottleneck is not None:
            self.bottleneck = sample.bottleneck

    # -- read at the end ----------------------------------------------------------------------------
    def _epoch(self, by_epoch: dict, epoch: int | None) -> Any:
        """``by_epoch``'s entry for ``epoch`` (default: the last epoch trained)."""
        return by_epoch.get(epoch if epoch is not None else self.epoch if self.epoch in by_epoch else max(by_epoch))

    def epoch_mean(self, epoch: int | None = None) -> dict[str, float]:
        """Mean of each trainer metric over the steps of ``epoch`` (default: the last epoch trained)."""
        if not self._epoch_means:
            return {}
        return {k: m.total / m.count for k, m in (self._epoch(self._epoch_means, epoch) or {}).items() if m.count}

    def epoch_positions(self, epoch: int | None = None) -> tuple[float, ...]:
        """Mean of each per-position accuracy over the steps of ``epoch`` (default: the last epoch trained)."""
        if not self._epoch_positions:
            return ()
        return tuple(m.total / m.count if m.count else math.nan for m in self._epoch(self._epoch_positions, epoch) or [])

    @property
    def last_sample(self) -> MonitorSample | None:
        return self.history.samples[-1] if self.history.samples else None

    def summary(self) -> dict[str, Any]:
        """The run in one JSON-able dict (``monitor/summary.json``)."""
        b = self.bottleneck
        last = self.last_sample
        return jsonable(
            {
                "step": self.step,
                "epoch": self.epoch,
                "total_steps": self.total_steps,
                "last_train_metrics": self.train,
                "epoch_mean_train_metrics": self.epoch_mean(),
                # Accuracy of block slots 1, 2, ...: the last step's and the last epoch's mean.
                "position_accuracy": {"last": list(self.positions), "epoch_mean": list(self.epoch_positions())},
                "eval": {label: eval_json(r) for label, r in self.evals.items()},
                "heldout": None if not self.history.heldout else _heldout_summary(self.history.heldout),
                "artifacts": self.artifacts,
                "bottleneck": None if b is None else {k: getattr(b, k) for k in (
                    "stage", "busy", "replicas", "replicas_needed", "next_stage", "saturated", "is_sink", "sentence")},
                "stage_load": {
                    name: {k: getattr(st, k) for k in ("replicas", "busy", "blocked_in", "blocked_out", "items_in",
                                                       "items_out")}
                    for name, st in (last.stages.items() if last is not None else ())
                },
                "stage_load_window": None if last is None else last.window_label,
                "data_quality": [{"stage": st, "records": n, "what": what} for st, n, what in data_quality(last)],
            }
        )


def _heldout_summary(points: list[HeldoutPoint]) -> dict[str, Any]:
    """The held-out walk's last value and its curve (step, seconds, tau), for summary.json."""
    last = points[-1]
    return {
        "tau": last.values.tau, "step": last.step, "elapsed_s": last.values.elapsed_s,
        "conversations": last.conversations, "horizon": last.horizon,
        "probe_s_total": math.fsum(p.values.probe_s for p in points),
        "curve": [[p.step, p.values.elapsed_s, p.values.tau] for p in points],
    }


def _finite(value: Any) -> float | None:
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def jsonable(obj: Any) -> Any:
    """Plain JSON types: NaN and infinities become None (JSON has no such numbers), tuples lists."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, bool)):
        return obj
    if attrs.has(type(obj)):
        return jsonable(attrs.asdict(obj))
    return str(obj)


class BatchLog:
    """The trained-batch log (``record_batches``): a flushed JSON line per batch (epoch, index, sample ids) in
    ``OUTPUT/batches.jsonl`` (``batches.rank<r>.jsonl`` under torchrun), never through a symlink. ``append``:
    a resumed run continues it (lines after its checkpoint appear twice); a fresh run truncates it."""

    def __init__(self, root: Path, *, rank: int, world_size: int, append: bool) -> None:
        self.path = root / ("batches.jsonl" if world_size == 1 else f"batches.rank{rank}.jsonl")
        refuse_outside(self.path.parent, root)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PermissionError(errno.EACCES, "refusing to follow a symbolic link in output_dir",
                                      str(self.path)) from None
            raise
        self._file: Any = os.fdopen(fd, "a" if append else "w")

    def write(self, meta: Any) -> None:
        """One trained batch (``items.BatchMeta``); a failed write names the file (a full disk's does not)."""
        try:
            self._file.write(json.dumps({"epoch": meta.epoch, "index": meta.index,
                                         "sample_ids": list(meta.sample_ids)}) + "\n")
            self._file.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
