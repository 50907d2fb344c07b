"""What a profile holds and how it is built from two snapshots (``app.profile`` runs one): per stage and
replica the window fractions, items/s, seconds per item and per trained batch, the queue depths, the
bottleneck, and the balanced replica counts; the window's equal parts (``Window``: each part's trainer
batches and every stage's busy seconds and items, from which ``app.splitplan`` makes an interval). The
graph facts it reads are ``app.profile_graph``'s."""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs

from dflash_flow.app.profile_graph import (
    direct_feeders,
    grad_accum_of,
    graph_edges,
    is_replicable,
    observer_stages,
)
from dflash_flow.core.snapshot import ReplicaState, RuntimeSnapshot, StageSnapshot
from dflash_flow.core.validate import Validated
from dflash_flow.observe.bottleneck import Bottleneck, find_bottleneck
from dflash_flow.observe.schema import metric
from dflash_flow.observe.window import StageWindow
from dflash_flow.util import usable_cores

PROFILE_VERSION = 2  # 2: the window's parts (``windows``) and each stage's spread over them
READABLE_VERSIONS = (1, 2)  # version 1 has no parts: it plans, without an interval
DEFAULT_WINDOWS = 6  # parts of the measured window (an interval needs at least 2)
DEFAULT_INTERVAL_S = 0.1
MAX_SERIES_POINTS = 400  # the queue-depth series kept in profile.json (evenly thinned)
ACTIVE = frozenset({ReplicaState.WAITING, ReplicaState.BUSY, ReplicaState.BLOCKED, ReplicaState.TEARDOWN,
                    ReplicaState.FINISHED})  # past setup


# ------------------------------------------------------------------------------------------ results


@attrs.frozen
class QueueStats:
    """Depth of one input queue (or of a stage's queues together) over the window's polls."""

    capacity: int
    min: int = metric("min", reduce="min", doc="Smallest depth seen")
    mean: float = metric("mean", reduce="mean", doc="Mean depth over the polls")
    max: int = metric("max", reduce="max", doc="Largest depth seen")
    polls: int = 0


@attrs.frozen
class ReplicaProfile:
    replica: int
    device: str
    busy_s: float = metric("busy_s", reduce="sum", doc="Seconds running its own work in the window")
    blocked_in_s: float = metric("blocked_in_s", reduce="sum", doc="Seconds waiting for input")
    blocked_out_s: float = metric("blocked_out_s", reduce="sum", doc="Seconds waiting to put output")
    busy: float = metric("busy_frac", reduce="mean", doc="Window fraction busy")
    blocked_in: float = metric("blocked_in_frac", reduce="mean", doc="Window fraction waiting for input")
    blocked_out: float = metric("blocked_out_frac", reduce="mean", doc="Window fraction waiting to put output")
    items_in: int = metric("items_in", reduce="sum", doc="Items taken in the window")
    items_out: int = metric("items_out", reduce="sum", doc="Items emitted in the window")
    items_per_s: float = metric("items_per_s", reduce="sum", doc="Items handled per second")
    queue: QueueStats | None = metric("queue", default=None, doc="Its input queue")
    cpu_s: float | None = metric("cpu_s", reduce="sum", default=None, doc="CPU seconds its thread ran in the window")
    cpu_wait_s: float | None = metric("cpu_wait_s", reduce="sum", default=None,
                                      doc="Seconds its thread waited, runnable, for a core in the window")


@attrs.frozen
class StageProfile:
    """One stage over the window. ``service_s``: replica-seconds of work per item handled (taken; emitted
    for a source). ``work_s_per_batch``: replica-seconds per trained batch, whatever the stage's item is
    (a sample, an epoch, a batch): what a throughput model needs."""

    name: str
    type: str
    replicas: int
    replicable: bool
    observer: bool  # the Monitor: its load is its own sampling, left out of the analysis
    busy: float = metric("busy_frac", reduce="mean", doc="Window fraction busy, mean over replicas")
    blocked_in: float = metric("blocked_in_frac", reduce="mean", doc="Window fraction starved")
    blocked_out: float = metric("blocked_out_frac", reduce="mean", doc="Window fraction back-pressured")
    items_in: int = metric("items_in", reduce="sum", doc="Items taken in the window")
    items_out: int = metric("items_out", reduce="sum", doc="Items emitted in the window")
    items_per_s: float = metric("items_per_s", reduce="sum", doc="Items handled per second")
    service_s: float | None = metric("service_s", reduce="max", default=None, doc="Replica-seconds of work per item")
    items_per_batch: float = metric("items_per_batch", reduce="mean", default=0.0, doc="Items handled per trained batch")
    work_s_per_batch: float = metric("work_s_per_batch", reduce="max", default=0.0, doc="Replica-seconds of work per trained batch")
    work_s_sd: float | None = metric("work_s_sd", reduce="max", default=None,
                                     doc="Standard deviation of work_s_per_batch over the window's parts (None: one part, or a version-1 profile)")
    queue: QueueStats | None = metric("queue", default=None, doc="Its input queues together")
    per_replica: tuple[ReplicaProfile, ...] = metric("replica", factory=tuple, doc="The same per replica")
    cpu_s_per_batch: float | None = metric("cpu_s_per_batch", reduce="max", default=None,
                                           doc="CPU seconds its threads ran per trained batch (its replicas' own threads)")
    cpu_wait_s_per_batch: float | None = metric("cpu_wait_s_per_batch", reduce="max", default=None,
                                                doc="Seconds its threads waited, runnable, for a core per trained batch")

    @property
    def max_batches_per_s(self) -> float:
        """The trained batches per second this stage alone allows with its replicas."""
        return self.replicas / self.work_s_per_batch if self.work_s_per_batch > 0 else math.inf


@attrs.frozen
class Window:
    """One of the equal parts (by trainer batches) of the measured window: what an interval is made of.
    ``busy_s[stage]``: replica-seconds busy in the part; ``handled[stage]``: items it took (emitted, for a
    source); ``samples`` / ``tokens``: what the trainer's batches held (None without those counters)."""

    start_s: float  # seconds since the window opened
    window_s: float
    batches: int
    samples: float | None = None
    tokens: float | None = None
    busy_s: dict[str, float] = attrs.field(factory=dict)
    handled: dict[str, int] = attrs.field(factory=dict)
    cpu_s: float | None = None  # the process's CPU seconds in the part (None: a profile written before)


@attrs.frozen
class QueueSeries:
    """Every poll's queue depths: ``t`` seconds since the run started, ``depth[label][i]`` at ``t[i]``."""

    t: list[float] = attrs.field(factory=list)
    depth: dict[str, list[int]] = attrs.field(factory=dict)
    window: tuple[float, float] = (0.0, 0.0)


@attrs.frozen
class Profile:
    """The measured window of one run (see the module docstring)."""

    pipeline: str
    step_stage: str
    steps: int  # optimizer steps asked for (with --precision: what the window grew to)
    grad_accum: int
    warmup_batches: int
    complete: bool  # False: the pipeline ended before the window held `steps` steps
    batches: int = metric("profile/batches", reduce="sum", doc="Batches the trainer took in the window")
    window_s: float = metric("profile/window_s", reduce="max", doc="Seconds of the window")
    elapsed_s: float = metric("profile/elapsed_s", reduce="max", doc="Seconds of the whole run")
    batches_per_s: float = metric("profile/batches_per_s", reduce="sum", doc="Trained batches per second")
    steps_per_s: float = metric("profile/steps_per_s", reduce="mean", doc="Optimizer steps per second")
    samples_per_batch: float | None = metric("profile/samples_per_batch", reduce="mean", default=None, doc="Samples per trained batch")
    tokens_per_batch: float | None = metric("profile/tokens_per_batch", reduce="mean", default=None, doc="Real tokens per trained batch")
    samples_per_s: float | None = metric("profile/samples_per_s", reduce="sum", default=None, doc="Samples trained per second")
    tokens_per_s: float | None = metric("profile/tokens_per_s", reduce="sum", default=None, doc="Real tokens trained per second")
    stages: dict[str, StageProfile] = metric("profile/stage", factory=dict, doc="Per stage")
    bottleneck: Bottleneck | None = metric("profile/bottleneck", default=None, doc="The verdict over the window")
    balanced_replicas: dict[str, int] = metric("profile/balanced_replicas", reduce="max", factory=dict, doc="Replicas that balance the pipeline")
    cpu_s_per_batch: float | None = metric("profile/cpu_s_per_batch", reduce="mean", default=None,
                                           doc="CPU seconds of the whole process (all its threads) per trained batch")
    cores: int | None = metric("profile/cores", reduce="max", default=None, doc="CPU cores the process could use")
    precision: float | None = None  # asked: measure until the rate's 90% interval is within +- this fraction
    reached: float | None = metric("profile/reached", reduce="max", default=None,
                                   doc="With --precision: the rate's 90% interval half-width over the rate at the end")
    interval_s: float = DEFAULT_INTERVAL_S
    queues: QueueSeries = attrs.field(factory=QueueSeries)
    windows: list[Window] = attrs.field(factory=list)
    version: int = PROFILE_VERSION

    def stage(self, name: str) -> StageProfile:
        return self.stages[name]

    def window_work(self, w: Window) -> dict[str, float]:
        return window_work(self.stages, w)


def window_work(stages: Mapping[str, StageProfile], w: Window) -> dict[str, float]:
    """Every stage's replica-seconds of work per trained batch in the part ``w``: its seconds per item
    there times its items per batch over the whole window (a part's own item count would also count what
    a stage queued ahead), or its busy seconds per batch when it took no item in the part."""
    out = {}
    for name, s in stages.items():
        busy, handled = w.busy_s.get(name, 0.0), w.handled.get(name, 0)
        if handled > 0:
            out[name] = busy / handled * s.items_per_batch
        else:
            out[name] = busy / w.batches if w.batches else s.work_s_per_batch
    return out


# ------------------------------------------------------------------------------------ computation


def _counter(st: StageSnapshot | None, name: str) -> float | None:
    if st is None or st.metric_kinds.get(name) != "counter":
        return None
    value = st.metric(name)
    return float(value) if isinstance(value, (int, float)) else None


def _per_batch(cur: StageSnapshot, prev: StageSnapshot, name: str, batches: int) -> float | None:
    a, b = _counter(cur, name), _counter(prev, name)
    if a is None or batches <= 0:
        return None
    return (a - (b or 0.0)) / batches


def queue_stats(depths: list[int], capacity: int) -> QueueStats | None:
    if not depths:
        return None
    return QueueStats(capacity=capacity, min=min(depths), mean=sum(depths) / len(depths), max=max(depths), polls=len(depths))


def _merge_queues(stats: list[QueueStats | None]) -> QueueStats | None:
    got = [q for q in stats if q is not None]
    if not got:
        return None
    return QueueStats(
        capacity=sum(q.capacity for q in got),
        min=min(q.min for q in got),
        mean=sum(q.mean for q in got) / len(got),
        max=max(q.max for q in got),
        polls=min(q.polls for q in got),
    )


def stage_profile(
    cur: StageSnapshot,
    prev: StageSnapshot,
    window_s: float,
    batches: int,
    *,
    is_source: bool,
    replicable: bool,
    observer: bool,
    per_batch: float | None = None,
    depths: Mapping[int, list[int]] | None = None,
) -> StageProfile:
    """One stage's figures from the window's two snapshots (``depths``: replica -> polled queue depths).

    ``per_batch``: the items it handles per trained batch when that is known exactly (a stage that feeds
    the trainer through 1:1 stages handles one item per batch; counting them in a short window would also
    count what it queued ahead). Otherwise the window's ratio."""
    w = StageWindow.between(cur, prev, max(window_s, 1e-9))
    window = w.span_s
    reps = []
    for r, rw in zip(cur.replicas, w.replicas, strict=True):
        q = queue_stats(list((depths or {}).get(r.replica, [])), r.channel.capacity) if r.channel is not None else None
        reps.append(ReplicaProfile(
            replica=r.replica, device=r.device, busy_s=rw.busy_s, blocked_in_s=rw.blocked_in_s,
            blocked_out_s=rw.blocked_out_s, busy=rw.busy(window), blocked_in=rw.blocked_in(window),
            blocked_out=rw.blocked_out(window), items_in=rw.items_in, items_out=rw.items_out,
            items_per_s=rw.handled(is_source) / window, queue=q, cpu_s=rw.cpu_s, cpu_wait_s=rw.cpu_wait_s,
        ))
    busy_s = w.busy_s
    handled = w.handled(is_source)
    service = busy_s / handled if handled else None
    if per_batch is None:
        per_batch = handled / batches if batches else 0.0
    work = service * per_batch if service is not None else (busy_s / batches if batches else 0.0)

    def per_trained_batch(total: float) -> float:  # as the work: per item handled, times items per batch
        return total / handled * per_batch if handled else (total / batches if batches else 0.0)

    measured = all(r.cpu_s is not None for r in reps) and bool(reps)
    return StageProfile(
        name=cur.name,
        type=cur.type,
        replicas=len(reps),
        replicable=replicable,
        observer=observer,
        busy=w.busy,
        blocked_in=w.blocked_in,
        blocked_out=w.blocked_out,
        items_in=w.items_in,
        items_out=w.items_out,
        items_per_s=handled / window,
        service_s=service,
        items_per_batch=per_batch,
        work_s_per_batch=work,
        queue=_merge_queues([r.queue for r in reps]),
        per_replica=tuple(reps),
        cpu_s_per_batch=per_trained_batch(sum(r.cpu_s for r in reps)) if measured else None,
        cpu_wait_s_per_batch=per_trained_batch(sum(r.cpu_wait_s for r in reps)) if measured else None,
    )


def balanced_replicas(stages: Mapping[str, StageProfile]) -> dict[str, int]:
    """Replica counts that balance the pipeline (see the module docstring); fixed stages keep theirs.

    The throughput to balance for is ``X* = min(cap, budget)``: ``cap`` is what the fixed stages allow,
    ``budget`` what today's replicas of the replicable stages would allow if spread by their work (so a
    trainer that costs nothing, as in a test pipeline, does not ask for hundreds of replicas)."""
    active = [s for s in stages.values() if not s.observer]
    cap = min((s.max_batches_per_s for s in active if not s.replicable), default=math.inf)
    free = [s for s in active if s.replicable]
    work = sum(s.work_s_per_batch for s in free)
    budget = sum(s.replicas for s in free) / work if work > 0 else math.inf
    target = min(cap, budget)
    if not math.isfinite(target):
        return {}
    # The epsilon keeps float noise (2.0000000001) from adding a replica.
    return {
        s.name: max(1, math.ceil(s.work_s_per_batch * target - 1e-6)) if s.replicable else s.replicas
        for s in active
    }


def build_profile(
    v: Validated,
    start: RuntimeSnapshot,
    end: RuntimeSnapshot,
    *,
    step_stage: str,
    steps: int,
    warmup_batches: int,
    complete: bool,
    elapsed_s: float,
    depths: Mapping[str, Mapping[int, list[int]]] | None = None,
    series: QueueSeries | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    cuts: list[RuntimeSnapshot] | None = None,
) -> Profile:
    """The profile of the window from ``start`` to ``end`` (pure: the tests feed it snapshots); ``cuts``:
    the snapshots inside it that part it (``Window``), in order."""
    window = max(end.time - start.time, 1e-9)
    trainer_end, trainer_start = end.stages[step_stage], start.stages[step_stage]
    batches = StageWindow.between(trainer_end, trainer_start, window).items_in
    observers = observer_stages(v)
    feeders = direct_feeders(v, step_stage)
    stages = {}
    for name, cur in end.stages.items():
        cls = v.classes[name]
        stages[name] = stage_profile(
            cur, start.stages[name], window, batches,
            is_source=cls.is_source(), replicable=is_replicable(v, name, step_stage),
            observer=name in observers, per_batch=1.0 if name in feeders else None,
            depths=(depths or {}).get(name),
        )
    loads = {name: StageWindow.between(cur, start.stages[name], window).load()
             for name, cur in end.stages.items() if not stages[name].observer}
    sinks = {step_stage}
    verdict = find_bottleneck(loads, sinks=sinks, edges=graph_edges(v)) if loads else None
    windows = window_parts(v, [start, *(cuts or []), end], step_stage)
    if len(windows) > 1:
        stages = _with_spread(stages, windows)
    grad_accum = grad_accum_of(v, step_stage)
    samples = _per_batch(trainer_end, trainer_start, "samples", batches)
    tokens = _per_batch(trainer_end, trainer_start, "tokens", batches)
    rate = batches / window
    cpu = end.cpu_s - start.cpu_s if end.cpu_s is not None and start.cpu_s is not None else None
    return Profile(
        pipeline=v.graph.name,
        step_stage=step_stage,
        steps=steps,
        grad_accum=grad_accum,
        warmup_batches=warmup_batches,
        complete=complete,
        batches=batches,
        window_s=window,
        elapsed_s=elapsed_s,
        batches_per_s=rate,
        steps_per_s=rate / grad_accum,
        samples_per_batch=samples,
        tokens_per_batch=tokens,
        samples_per_s=samples * rate if samples is not None else None,
        tokens_per_s=tokens * rate if tokens is not None else None,
        stages=stages,
        bottleneck=verdict,
        balanced_replicas=balanced_replicas(stages),
        interval_s=interval_s,
        queues=series or QueueSeries(),
        windows=windows,
        cpu_s_per_batch=cpu / batches if cpu is not None and batches > 0 else None,
        cores=usable_cores(),
    )


def window_parts(v: Validated, snaps: list[RuntimeSnapshot], step_stage: str) -> list[Window]:
    """The parts between consecutive snapshots (a part with no trainer batch is dropped)."""
    out = []
    t0 = snaps[0].time
    for a, b in zip(snaps, snaps[1:], strict=False):
        batches = StageWindow.between(b.stages[step_stage], a.stages[step_stage], None).items_in
        if batches <= 0:
            continue
        busy, handled = {}, {}
        for name, cur in b.stages.items():
            w = StageWindow.between(cur, a.stages[name], None)
            busy[name], handled[name] = w.busy_s, w.handled(v.classes[name].is_source())
        samples = _counter(b.stages[step_stage], "samples")
        tokens = _counter(b.stages[step_stage], "tokens")
        out.append(Window(
            start_s=a.time - t0, window_s=max(b.time - a.time, 1e-9), batches=batches,
            samples=samples - (_counter(a.stages[step_stage], "samples") or 0.0) if samples is not None else None,
            tokens=tokens - (_counter(a.stages[step_stage], "tokens") or 0.0) if tokens is not None else None,
            busy_s=busy, handled=handled,
            cpu_s=b.cpu_s - a.cpu_s if a.cpu_s is not None and b.cpu_s is not None else None,
        ))
    return out


def _with_spread(stages: dict[str, StageProfile], windows: list[Window]) -> dict[str, StageProfile]:
    """``stages`` with each one's ``work_s_sd`` over ``windows``."""
    import statistics

    works = [window_work(stages, w) for w in windows]
    return {n: attrs.evolve(s, work_s_sd=statistics.stdev(w[n] for w in works)) for n, s in stages.items()}
