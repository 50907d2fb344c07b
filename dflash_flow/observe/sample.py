"""What the Monitor records, as attrs objects with declared metric fields: a :class:`MonitorSample` per window
(:func:`take_sample`), a :class:`TrainPoint` per step, an :class:`EvalPoint` per evaluation."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from dflash_flow.core.snapshot import RuntimeSnapshot, StageSnapshot
from dflash_flow.items import EvalReport

from .bottleneck import Bottleneck, StageWindow, counter_delta, find_bottleneck, number
from .names import eval_label, eval_metrics, position_accuracy_name
from .schema import metric, train_reduction


def _slot_name(i: int) -> str:
    return position_accuracy_name(i + 1)  # element 0 is block slot 1

# The Interleaver's labeled metric (batches dispatched per bucket): the source of the bucket mix.
BUCKET_METRIC = "bucket_dispatch"
# A source's labeled metric (unusable records by reason) and its counters of samples it changed or dropped:
# what the end-of-run summary reports as the data's quality.
BAD_RECORDS_METRIC = "bad_records"
DATA_COUNTERS = {"truncated": "truncated to max_length", "dropped_overlong": "dropped (over max_length)",
                 "too_few_supervised": "dropped (too few supervised tokens)"}


@attrs.frozen
class SummaryStats:
    """A ``Summary`` metric merged over replicas."""

    count: float = metric("count", reduce="sum", doc="Observations")
    mean: float = metric("mean", reduce="mean", doc="Mean observation")
    min: float = metric("min", reduce="min", doc="Smallest observation")
    max: float = metric("max", reduce="max", doc="Largest observation")


@attrs.frozen
class ReplicaSample:
    replica: int
    device: str
    state: str
    busy: float = metric("busy_frac", reduce="mean", doc="Window fraction running its own work")
    blocked_in: float = metric("blocked_in_frac", reduce="mean", doc="Window fraction waiting for input")
    blocked_out: float = metric("blocked_out_frac", reduce="mean", doc="Window fraction waiting to put output")
    items_in: int = metric("items_in", reduce="sum", doc="Items taken so far")
    items_out: int = metric("items_out", reduce="sum", doc="Items emitted so far")
    queue_depth: int | None = metric("queue_depth", reduce="max", doc="Items waiting in its input queue (not for sources)")
    queue_capacity: int | None = None


@attrs.frozen
class StageSample:
    name: str
    type: str
    replicas: int
    busy: float = metric("busy_frac", reduce="mean", doc="Window fraction busy, mean over replicas")
    blocked_in: float = metric("blocked_in_frac", reduce="mean", doc="Window fraction starved, mean over replicas")
    blocked_out: float = metric("blocked_out_frac", reduce="mean", doc="Window fraction back-pressured, mean over replicas")
    items_in: int = metric("items_in", reduce="sum", doc="Items taken so far, all replicas")
    items_out: int = metric("items_out", reduce="sum", doc="Items emitted so far, all replicas")
    items_in_per_s: float = metric("items_in_per_s", reduce="sum", doc="Items taken per second over the window")
    items_out_per_s: float = metric("items_out_per_s", reduce="sum", doc="Items emitted per second over the window")
    per_replica: tuple[ReplicaSample, ...] = metric("replica", doc="The same per replica")
    # The stage's own metrics (``ctx.metrics``) by kind. A name is declared with one kind per stage, so
    # counters, gauges, summaries and labeled counts share the ``metric/`` segment without colliding.
    counters: dict[str, float] = metric("metric", reduce="sum", factory=dict, doc="Counter totals")
    rates: dict[str, float] = metric("rate", reduce="sum", factory=dict, doc="Counter increase per second over the window")
    gauges: dict[str, float] = metric("metric", reduce="mean", factory=dict, doc="Gauge values")
    summaries: dict[str, SummaryStats] = metric("metric", factory=dict, doc="Summary count/mean/min/max")
    labeled: dict[str, dict[str, float]] = metric("metric", reduce="sum", factory=dict, doc="Counts per label")


@attrs.frozen
class BucketSample:
    dispatched: float = metric("dispatched", reduce="sum", doc="Batches of this bucket dispatched so far")
    share: float | None = metric("share", reduce="mean", doc="Its share of the batches dispatched in the window")


@attrs.frozen
class Throughput:
    tokens_per_s: float | None = metric("tokens_per_s", reduce="sum", default=None, doc="Trainer tokens per second (last step)")
    samples_per_s: float | None = metric("samples_per_s", reduce="sum", default=None, doc="Trainer samples per second (last step)")


@attrs.frozen
class MonitorSample:
    """One look at the whole pipeline: the window ending at ``elapsed_s`` (``window_s`` long; the whole
    run when ``whole_run``), at training step ``step``."""

    step: int
    elapsed_s: float
    window_s: float
    whole_run: bool
    stages: dict[str, StageSample] = metric("stage", doc="Per stage")
    buckets: dict[str, BucketSample] = metric("bucket", factory=dict, doc="Per length bucket")
    positions: tuple[float, ...] = metric("train", reduce="mean", element=_slot_name, factory=tuple,
                                          doc="Per-position accuracies, mean over the window (slot 1 first)")
    throughput: Throughput = metric("throughput", factory=Throughput, doc="Trainer throughput")
    bottleneck: Bottleneck | None = metric("bottleneck", default=None, doc="The verdict for this window")

    @property
    def window_label(self) -> str:
        """What the window covers, for tables: ``last 5 s``, ``whole run``, or the training steady state."""
        if not self.whole_run:
            return f"last {self.window_s:.0f} s"
        if self.window_s >= self.elapsed_s - 1e-6:
            return "whole run"
        return f"training steady state, {self.window_s:.0f} s"


@attrs.frozen
class TrainPoint:
    """One optimizer step's report: ``metrics`` are logged every step; ``positions`` (block slot 1 first) only
    as their mean over each Monitor sample, but they are part of the run's last and epoch-mean values."""

    step: int
    epoch: int | None
    metrics: dict[str, float] = metric("train", reduce=train_reduction, doc="The trainer's step metrics")
    positions: tuple[float, ...] = ()
    bucket: int | None = None  # the length bucket of the step's (last) batch; None: a filler or no batch
    bucket_range: tuple[int, int] | None = None  # the sample lengths that bucket holds


@attrs.frozen
class EpochPoint:
    """The mean of every trainer metric over one epoch's steps (``RunRecord.epoch_mean``), logged when
    the epoch ends at its last ``step``: one batch's value is noise, the epoch's mean is the trend."""

    step: int
    epoch: int
    means: dict[str, float] = metric("train_epoch", reduce=train_reduction, doc="Epoch means of the trainer's metrics")
    positions: tuple[float, ...] = metric("train_epoch", reduce="mean", element=_slot_name, factory=tuple,
                                          doc="Epoch means of the per-position accuracies (slot 1 first)")


@attrs.frozen
class HeldoutValues:
    """The held-out walk measured during training (``items.HeldoutWalk``), as logged."""

    tau: float = metric("tau", reduce="mean", doc="Tokens per block of the teacher-forced walk on the held-out sample")
    elapsed_s: float = metric("elapsed_s", reduce="max", doc="Seconds since the trainer's setup began")
    probe_s: float = metric("probe_s", reduce="max", doc="Seconds this measurement cost the trainer")


@attrs.frozen
class HeldoutPoint:
    """Acceptance over time: the trainer's held-out walk at ``step`` (logged as ``heldout/<value>``)."""

    step: int
    values: HeldoutValues = metric("heldout", doc="The held-out walk during training")
    conversations: int = 0
    horizon: int = 0

    @classmethod
    def of(cls, step: int, walk: Any) -> HeldoutPoint:
        """From the trainer's ``items.HeldoutWalk``."""
        return cls(step, HeldoutValues(walk.tau, walk.elapsed_s, walk.probe_s), walk.conversations, walk.horizon)


def _eval_results(point: EvalPoint) -> dict[str, dict[str, float]]:
    return {eval_label(r): eval_metrics(r) for r in point.reports}


@attrs.frozen
class EvalPoint:
    """Evaluation results at ``step``: the typed reports (``items.EvalReport``). ``results`` is their
    export form, ``{label: {name: value}}``, made from them by ``observe.names`` (never read back)."""

    step: int
    reports: tuple[EvalReport, ...] = attrs.field(converter=tuple, factory=tuple)
    results: dict[str, dict[str, float]] = metric(
        "eval", reduce="mean", init=False, default=attrs.Factory(_eval_results, takes_self=True),
        doc="Per evaluation",
    )


# ------------------------------------------------------------------------------------ from snapshots


def _stage(cur: StageSnapshot, w: StageWindow, window: float, prev: StageSnapshot | None) -> StageSample:
    reps = []
    for r, rw in zip(cur.replicas, w.replicas, strict=True):  # its window's fractions, cumulative items, queue now
        span, ch = w.span_of(rw), r.channel
        reps.append(ReplicaSample(r.replica, r.device, r.state, rw.busy(span), rw.blocked_in(span),
                                  rw.blocked_out(span), r.items_in, r.items_out, None if ch is None else ch.depth,
                                  None if ch is None else ch.capacity))
    counters: dict[str, float] = {}
    rates: dict[str, float] = {}
    gauges: dict[str, float] = {}
    summaries: dict[str, SummaryStats] = {}
    labeled: dict[str, dict[str, float]] = {}
    for name, kind in cur.metric_kinds.items():
        value = cur.metric(name)
        if kind == "summary":
            if value and value.get("count"):
                summaries[name] = SummaryStats(value["count"], value["mean"], value["min"], value["max"])
        elif kind == "labeled":
            labeled[name] = {str(k): float(v) for k, v in (value or {}).items()}
        elif kind == "gauge" and (x := number(value)) is not None:
            gauges[name] = x
        elif kind == "counter" and (x := number(value)) is not None:
            counters[name] = x
            rates[name] = counter_delta(cur, prev, name) / window if window > 0 else 0.0  # type: ignore[operator]
    return StageSample(
        cur.name, cur.type, len(reps), w.busy, w.blocked_in, w.blocked_out,
        items_in=sum(r.items_in for r in cur.replicas), items_out=sum(r.items_out for r in cur.replicas),
        items_in_per_s=w.items_in / window if window > 0 else 0.0,
        items_out_per_s=w.items_out / window if window > 0 else 0.0,
        per_replica=tuple(reps), counters=counters, rates=rates, gauges=gauges, summaries=summaries, labeled=labeled,
    )


def _bucket_counts(snap: RuntimeSnapshot | None) -> dict[str, float]:
    """Batches dispatched per bucket so far, over every stage that counts them."""
    out: dict[str, float] = {}
    for st in snap.stages.values() if snap is not None else ():
        if st.metric_kinds.get(BUCKET_METRIC) == "labeled":
            for label, n in (st.metric(BUCKET_METRIC) or {}).items():
                out[str(label)] = out.get(str(label), 0.0) + float(n)
    return out


def _buckets(now: Mapping[str, float], before: Mapping[str, float]) -> dict[str, BucketSample]:
    deltas = {b: max(0.0, n - before.get(b, 0.0)) for b, n in now.items()}
    total = sum(deltas.values())
    return {b: BucketSample(dispatched=n, share=deltas[b] / total if total > 0 else None) for b, n in now.items()}


def take_sample(cur: RuntimeSnapshot, prev: RuntimeSnapshot | None, *, step: int,
                positions: Sequence[float] = (), throughput: Throughput | None = None,
                sinks: Iterable[str] = (), edges: Mapping[str, Sequence[str]] | None = None,
                exclude: Iterable[str] = (), fixed: Iterable[str] = (), whole_run: bool | None = None,
                min_alive: float = 0.5) -> MonitorSample:
    """The window from ``prev`` to ``cur`` (``prev=None``: the whole run, whose verdict is the run's); the
    bottleneck analysis leaves out ``exclude`` and stages alive under ``min_alive`` of it."""
    whole = prev is None
    window = cur.elapsed_s if whole else max(cur.time - prev.time, 1e-9)
    before = {} if whole else prev.stages
    windows = {name: StageWindow.between(st, before.get(name), None if before.get(name) is None else window)
               for name, st in cur.stages.items()}
    stages = {name: _stage(st, windows[name], window, before.get(name)) for name, st in cur.stages.items()}
    skip = set(exclude)
    loads = {name: w.load() for name, w in windows.items() if name not in skip and w.alive(window) >= min_alive}
    return MonitorSample(
        step=int(step), elapsed_s=cur.elapsed_s, window_s=window,
        whole_run=whole if whole_run is None else bool(whole_run), stages=stages,
        buckets=_buckets(_bucket_counts(cur), _bucket_counts(prev)),
        positions=tuple(float(v) for v in positions), throughput=throughput or Throughput(),
        bottleneck=find_bottleneck(loads, sinks=sinks, edges=edges, fixed=fixed) if loads else None,
    )


def data_quality(sample: MonitorSample | None) -> list[list[Any]]:
    """Each source's unusable records by reason and the samples it cut or dropped, from the run's last
    sample: ``[[stage, count, what]]`` (empty when every record was used as read)."""
    rows: list[list[Any]] = []
    for name, st in (sample.stages.items() if sample is not None else ()):
        if BAD_RECORDS_METRIC not in st.labeled:
            continue  # not a record reader
        for reason, n in sorted(st.labeled[BAD_RECORDS_METRIC].items()):
            if n:
                rows.append([name, int(n), f"unusable, skipped: {reason}"])
        for counter, what in DATA_COUNTERS.items():
            n = st.counters.get(counter)
            if n:
                rows.append([name, int(n), what])
    return rows
