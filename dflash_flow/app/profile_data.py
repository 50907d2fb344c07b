"""What a profile holds and how it is built from snapshots: per stage and replica the window's figures, the
bottleneck, the balanced replica counts, the window's parts and their 90% intervals (batch means)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import attrs

from dflash_flow.core.snapshot import ReplicaState, RuntimeSnapshot, StageSnapshot
from dflash_flow.core.validate import Validated
from dflash_flow.observe.bottleneck import Bottleneck, StageWindow, counter_delta, delta, find_bottleneck
from dflash_flow.observe.schema import metric
from dflash_flow.util import usable_cores

PROFILE_VERSION = 2  # 2: the window's parts (``windows``) and each stage's spread over them
READABLE_VERSIONS = (1, 2)  # version 1 has no parts: it plans, without an interval
DEFAULT_WINDOWS = 6  # parts of the measured window (an interval needs at least 2)
DEFAULT_INTERVAL_S = 0.1
MAX_SERIES_POINTS = 400  # the queue-depth series kept in profile.json (evenly thinned)
ACTIVE = frozenset({ReplicaState.WAITING, ReplicaState.BUSY, ReplicaState.BLOCKED, ReplicaState.TEARDOWN,
                    ReplicaState.FINISHED})  # past setup


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
    for a source); ``work_s_per_batch``: per trained batch, whatever the stage's item is."""

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
    """One of the equal parts (by trainer batches) of the measured window: ``busy_s[stage]`` replica-seconds,
    ``handled[stage]`` items taken (emitted, for a source), ``samples``/``tokens`` the trainer's batches held."""

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


def window_work(stages: Mapping[str, StageProfile], w: Window) -> dict[str, float]:
    """Every stage's work per trained batch in the part ``w``: its seconds per item there times its items per
    batch over the whole window (a part's own count includes what it queued ahead), else busy s per batch."""
    out = {}
    for name, s in stages.items():
        busy, handled = w.busy_s.get(name, 0.0), w.handled.get(name, 0)
        out[name] = (busy / handled * s.items_per_batch if handled > 0 else
                     busy / w.batches if w.batches else s.work_s_per_batch)
    return out


class ProfileError(Exception):
    """The profile could not measure what was asked (the pipeline ended too early, no trainer stage...)."""


def observer_stages(v: Validated) -> set[str]:
    from dflash_flow.stages.monitor import Monitor

    return {name for name, cls in v.classes.items() if issubclass(cls, Monitor)}


def find_step_stage(v: Validated) -> str:
    """The trainer: the DrafterStep stage; else the one sink that is not a Monitor."""
    from dflash_flow.stages.drafter_step import DrafterStep

    trainers = [n for n in v.order if issubclass(v.classes[n], DrafterStep)]
    if len(trainers) == 1:
        return trainers[0]
    observers = observer_stages(v)
    sinks = [n for n in v.order if v.classes[n].is_sink() and n not in observers]
    if len(trainers) > 1 or len(sinks) != 1:
        found = trainers if len(trainers) > 1 else sinks
        raise ProfileError(
            f"cannot tell which stage is the trainer (found {', '.join(found) or 'no sink'}); name it with --step-stage"
        )
    return sinks[0]


def direct_feeders(v: Validated, step_stage: str) -> set[str]:
    """The trainer and the stages that feed it through 1:1 stages only: one item per trained batch each."""
    out = {step_stage}
    todo = [i.stage for i in v.graph.stage(step_stage).inputs]
    while todo:
        name = todo.pop()
        cls = v.classes[name]
        if name in out or cls.is_source() or cls.cardinality != "1:1":
            continue
        out.add(name)
        todo.extend(i.stage for i in v.graph.stage(name).inputs)
    return out


def is_replicable(v: Validated, name: str, step_stage: str) -> bool:
    """Whether more replicas of ``name`` would share its work (not a singleton, a sharding source, or the
    trainer, which grows by data-parallel ranks instead)."""
    cls = v.classes[name]
    return name != step_stage and not cls.singleton and (not cls.is_source() or cls.shards_by_replica)


def grad_accum_of(v: Validated, step_stage: str) -> int:
    return max(1, v.configs[step_stage].inputs_per_step)


def _per_batch(cur: StageSnapshot, prev: StageSnapshot, name: str, batches: int) -> float | None:
    d = counter_delta(cur, prev, name)
    return None if d is None or batches <= 0 else d / batches


def _merge_queues(stats: list[QueueStats | None]) -> QueueStats | None:
    if not (got := [q for q in stats if q is not None]):
        return None
    return QueueStats(sum(q.capacity for q in got), min(q.min for q in got), sum(q.mean for q in got) / len(got),
                      max(q.max for q in got), min(q.polls for q in got))


def stage_profile(cur: StageSnapshot, w: StageWindow, batches: int, *, is_source: bool, replicable: bool,
                  observer: bool, per_batch: float | None = None,
                  depths: Mapping[int, list[int]] | None = None) -> StageProfile:
    """One stage's figures from its window ``w`` (``depths``: replica -> polled queue depths). ``per_batch``:
    its items per trained batch when known exactly (1 through 1:1 stages), else the window's ratio."""
    window = w.span_s
    assert window is not None
    reps = []
    for r, rw in zip(cur.replicas, w.replicas, strict=True):
        d = list((depths or {}).get(r.replica, []))
        q = QueueStats(capacity=r.channel.capacity, min=min(d), mean=sum(d) / len(d), max=max(d),
                       polls=len(d)) if r.channel is not None and d else None
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
        name=cur.name, type=cur.type, replicas=len(reps), replicable=replicable, observer=observer,
        busy=w.busy, blocked_in=w.blocked_in, blocked_out=w.blocked_out, items_in=w.items_in,
        items_out=w.items_out, items_per_s=handled / window, service_s=service, items_per_batch=per_batch,
        work_s_per_batch=work, queue=_merge_queues([r.queue for r in reps]), per_replica=tuple(reps),
        cpu_s_per_batch=per_trained_batch(sum(r.cpu_s for r in reps)) if measured else None,
        cpu_wait_s_per_batch=per_trained_batch(sum(r.cpu_wait_s for r in reps)) if measured else None,
    )


def balanced_replicas(stages: Mapping[str, StageProfile]) -> dict[str, int]:
    """Replica counts that balance the pipeline at ``X* = min(cap, budget)``: ``cap`` what the fixed stages
    (which keep their counts) allow, ``budget`` what today's replicable replicas would if spread by their
    work (a trainer that costs nothing does not ask for hundreds of replicas)."""
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


def build_profile(v: Validated, start: RuntimeSnapshot, end: RuntimeSnapshot, *, step_stage: str, steps: int,
                  warmup_batches: int, complete: bool, elapsed_s: float,
                  depths: Mapping[str, Mapping[int, list[int]]] | None = None,
                  series: QueueSeries | None = None, interval_s: float = DEFAULT_INTERVAL_S,
                  cuts: list[RuntimeSnapshot] | None = None) -> Profile:
    """The profile of the window from ``start`` to ``end``, parted at ``cuts`` (pure: tests feed it snapshots)."""
    window = max(end.time - start.time, 1e-9)
    trainer_end, trainer_start = end.stages[step_stage], start.stages[step_stage]
    ws = {name: StageWindow.between(cur, start.stages[name], window) for name, cur in end.stages.items()}
    batches = ws[step_stage].items_in
    observers = observer_stages(v)
    feeders = direct_feeders(v, step_stage)
    stages = {
        name: stage_profile(
            cur, ws[name], batches, is_source=v.classes[name].is_source(),
            replicable=is_replicable(v, name, step_stage), observer=name in observers,
            per_batch=1.0 if name in feeders else None, depths=(depths or {}).get(name),
        )
        for name, cur in end.stages.items()
    }
    loads = {name: w.load() for name, w in ws.items() if name not in observers}
    edges: dict[str, list[str]] = {}  # each stage's consumers
    for s in v.graph.stages:
        for i in s.inputs:
            edges.setdefault(i.stage, []).append(s.name)
    verdict = find_bottleneck(loads, sinks={step_stage}, edges=edges) if loads else None
    windows = window_parts(v, [start, *(cuts or []), end], step_stage)
    if len(windows) > 1:  # each stage's work_s_sd over the parts
        works = [window_work(stages, w) for w in windows]
        stages = {n: attrs.evolve(s, work_s_sd=statistics.stdev(w[n] for w in works)) for n, s in stages.items()}
    grad_accum = grad_accum_of(v, step_stage)
    samples = _per_batch(trainer_end, trainer_start, "samples", batches)
    tokens = _per_batch(trainer_end, trainer_start, "tokens", batches)
    rate = batches / window
    cpu = delta(end.cpu_s, start.cpu_s)
    return Profile(
        pipeline=v.graph.name, step_stage=step_stage, steps=steps, grad_accum=grad_accum,
        warmup_batches=warmup_batches, complete=complete, batches=batches, window_s=window,
        elapsed_s=elapsed_s, batches_per_s=rate, steps_per_s=rate / grad_accum, samples_per_batch=samples,
        tokens_per_batch=tokens, samples_per_s=samples * rate if samples is not None else None,
        tokens_per_s=tokens * rate if tokens is not None else None, stages=stages, bottleneck=verdict,
        balanced_replicas=balanced_replicas(stages), interval_s=interval_s, queues=series or QueueSeries(),
        windows=windows, cpu_s_per_batch=cpu / batches if cpu is not None and batches > 0 else None,
        cores=usable_cores(),
    )


def window_parts(v: Validated, snaps: list[RuntimeSnapshot], step_stage: str) -> list[Window]:
    """The parts between consecutive snapshots (a part with no trainer batch is dropped)."""
    out = []
    t0 = snaps[0].time
    for a, b in zip(snaps, snaps[1:], strict=False):
        ws = {name: StageWindow.between(cur, a.stages[name], None) for name, cur in b.stages.items()}
        if ws[step_stage].items_in <= 0:
            continue
        trainer = b.stages[step_stage], a.stages[step_stage]
        out.append(Window(
            start_s=a.time - t0, window_s=max(b.time - a.time, 1e-9), batches=ws[step_stage].items_in,
            samples=counter_delta(*trainer, "samples"), tokens=counter_delta(*trainer, "tokens"),
            busy_s={n: w.busy_s for n, w in ws.items()},
            handled={n: w.handled(v.classes[n].is_source()) for n, w in ws.items()}, cpu_s=delta(b.cpu_s, a.cpu_s),
        ))
    return out


LEVEL = 0.90  # the intervals' confidence
# Student's t, one-sided 0.95 quantile (a two-sided 90% interval), 1..30 degrees of freedom.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def t95(df: int) -> float:
    """The 0.95 quantile of Student's t with ``df`` degrees of freedom (past 30: a one-term expansion)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.6449
    return z + (z**3 + z) / (4 * df)


@attrs.frozen
class Interval:
    """A ``LEVEL`` interval from ``windows`` parts of the profile's window."""

    low: float
    high: float
    windows: int
    level: float = LEVEL

    def __contains__(self, x: float) -> bool:
        return self.low <= x <= self.high

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def batch_means(centre: float, per_window: Sequence[float]) -> Interval | None:
    """``centre +- t(0.95, k-1) * sd / sqrt(k)`` over ``k`` per-part values; None below two or if not finite."""
    k = len(per_window)
    if k < 2 or not math.isfinite(centre) or not all(math.isfinite(x) for x in per_window):
        return None
    half = t95(k - 1) * statistics.stdev(per_window) / math.sqrt(k)
    return Interval(low=centre - half, high=centre + half, windows=k)
