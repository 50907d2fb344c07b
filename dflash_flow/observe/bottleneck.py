"""Which stage holds the others back, and how many replicas would fix it (pure functions), from per-stage
``busy``/``blocked_in``/``blocked_out`` fractions of one window (``StageWindow``). In steady state every stage
passes the same items/s, so the busiest saturates first (ties: the waiting around it, then less blocked on
output, then a sink); ``replicas_needed = max(r + 1, ceil(r * u / max(u2, min_util)))``, ``u2`` the
next-busiest load. A stage in ``fixed`` keeps its count; the sentence names another lever.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from dflash_flow.core.snapshot import ReplicaSnapshot, StageSnapshot

from .console import pct
from .schema import metric


@attrs.frozen
class StageLoad:
    """One stage's load over a window (fractions averaged over its replicas)."""

    name: str
    replicas: int
    busy: float
    blocked_in: float = 0.0
    blocked_out: float = 0.0


@attrs.frozen
class Bottleneck:
    """The verdict (``bottleneck/*`` metrics; the stage's name and the sentence are text)."""

    stage: str
    busy: float = metric("busy", reduce="max", doc="Busy fraction of the bottleneck stage")
    replicas: int = metric("replicas", reduce="max", doc="Its replicas")
    replicas_needed: int = metric("replicas_needed", reduce="max", doc="Replicas that would make it stop being the bottleneck")
    next_stage: str | None = None
    next_busy: float = metric("next_busy", reduce="max", default=0.0, doc="Busy fraction of the next-busiest stage")
    is_sink: bool = False
    replicable: bool = metric("replicable", reduce="min", default=True, doc="1 when more replicas of it are possible (0: a singleton, ordered or non-sharding source; grow it by ranks or make it cheaper)")
    saturated: bool = metric("saturated", reduce="max", default=False, doc="1 when its busy fraction is at least `saturation`")
    sentence: str = ""
    loads: dict[str, StageLoad] = attrs.field(factory=dict, repr=False)


def _clip(x: float) -> float:
    x = float(x)
    return 0.0 if math.isnan(x) else min(1.0, max(0.0, x))


def _waiting_evidence(name: str, loads: Mapping[str, StageLoad], edges: Mapping[str, Sequence[str]] | None) -> float:
    """How much its neighbours wait for ``name``: producers blocked on output + consumers blocked on input."""
    if not edges:
        return 0.0
    starved = [loads[c].blocked_in for c in edges.get(name, ()) if c in loads]
    blocked = [loads[p].blocked_out for p, cs in edges.items() if name in cs and p in loads]
    return 0.0 + (sum(starved) / len(starved) if starved else 0.0) + (sum(blocked) / len(blocked) if blocked else 0.0)


def replicas_needed(replicas: int, busy: float, next_busy: float, *, min_util: float = 0.05) -> int:
    """``max(r + 1, ceil(r * busy / max(next_busy, min_util)))`` -- see the module docstring."""
    r = max(1, int(replicas))
    target = max(float(next_busy), float(min_util))
    # The small epsilon keeps float noise (0.9 / 0.45 = 2.0000000000000004) from adding a replica.
    return max(r + 1, math.ceil(r * float(busy) / target - 1e-9))


def find_bottleneck(stages: Mapping[str, Mapping[str, float]] | Mapping[str, StageLoad],
                    sinks: Iterable[str] = (), *, edges: Mapping[str, Sequence[str]] | None = None,
                    tie_tolerance: float = 0.02, saturation: float = 0.8, min_util: float = 0.05,
                    fixed: Iterable[str] = ()) -> Bottleneck | None:
    """The bottleneck stage, the replicas it needs and a sentence (None: no stages). ``sinks``: stages meant
    to be the bottleneck; ``edges``: ``{stage: [downstream]}``, for tie-breaks."""
    if not stages:
        return None
    loads = dict(stages) if isinstance(next(iter(stages.values())), StageLoad) else {  # type: ignore[arg-type]
        name: StageLoad(name, max(1, int(d.get("replicas", 1))), _clip(d.get("busy", 0.0)),
                        _clip(d.get("blocked_in", 0.0)), _clip(d.get("blocked_out", 0.0)))
        for name, d in stages.items()}
    sinks = set(sinks)
    top = max(ld.busy for ld in loads.values())
    contenders = [ld for ld in loads.values() if ld.busy >= top - tie_tolerance]

    def rank(ld: StageLoad):
        return (_waiting_evidence(ld.name, loads, edges), -ld.blocked_out, ld.name in sinks, ld.busy)

    best = max(contenders, key=rank)
    others = [ld for ld in loads.values() if ld.name != best.name]
    nxt = max(others, key=lambda ld: ld.busy) if others else None
    next_busy = nxt.busy if nxt else 0.0
    replicable, saturated, is_sink = best.name not in set(fixed), best.busy >= saturation, best.name in sinks
    need = replicas_needed(best.replicas, best.busy, next_busy, min_util=min_util) if replicable else best.replicas
    sentence = _sentence(best, nxt, need, is_sink, saturated, loads, min_util, replicable)
    return Bottleneck(best.name, best.busy, best.replicas, need, nxt.name if nxt else None, next_busy, is_sink,
                      replicable, saturated, sentence, loads)


def _sentence(b: StageLoad, nxt: StageLoad | None, need: int, is_sink: bool, saturated: bool,
              loads: Mapping[str, StageLoad], min_util: float, replicable: bool = True) -> str:
    reps = f"{b.replicas} replica" + ("s" if b.replicas != 1 else "")
    waiting = sorted((ld for ld in loads.values() if ld.name != b.name and max(ld.blocked_in, ld.blocked_out) >= 0.2),
                     key=lambda ld: -max(ld.blocked_in, ld.blocked_out))
    wait_txt = ""
    if waiting:
        parts = [f"{ld.name} {pct(ld.blocked_out)} blocked on output" if ld.blocked_out >= ld.blocked_in
                 else f"{ld.name} {pct(ld.blocked_in)} starved" for ld in waiting[:3]]
        wait_txt = " (" + ", ".join(parts) + ")"
    if not saturated:
        return (
            f"No stage is saturated: the busiest, {b.name}, is busy {pct(b.busy)} of the time on {reps}; "
            f"the pipeline is limited by latency or by its source, not by one stage's capacity."
        )
    if is_sink:
        lever = "" if replicable else (" To go faster, add data-parallel ranks (`--nproc N`): it cannot be "
                                       "replicated within a rank.")
        return (
            f"{b.name} is the bottleneck, busy {pct(b.busy)} on {reps}{wait_txt}: the input pipeline keeps it fed, "
            f"which is the goal.{lever}"
        )
    if nxt is None:
        return f"{b.name} is the only stage, busy {pct(b.busy)} on {reps}."
    if not replicable:
        return (
            f"{b.name} is the bottleneck: busy {pct(b.busy)} on {reps}{wait_txt}. It cannot be replicated "
            f"within a rank: make its work cheaper, or add data-parallel ranks (`--nproc N`), each with its own {b.name}."
        )
    nb = max(nxt.busy, min_util)
    return (
        f"{b.name} is the bottleneck: busy {pct(b.busy)} on {reps}{wait_txt}. "
        f"With {need} replicas it would drop to about {pct(b.replicas * b.busy / need)} busy, "
        f"no more than the next-busiest stage, {nxt.name} ({pct(nb)})."
    )


# ------------------------------------------------------------------------------------------ windows
# A window: the difference of two snapshots of the runtime's cumulative readings (``prev=None``: from the
# start), the one delta code of the Monitor (``observe.sample``), the profiler and the analysis above.


def number(value: object) -> float | None:
    """``value`` as a finite float (None: not a number, a bool, or not finite)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    x = float(value)
    return x if math.isfinite(x) else None


def counter(st: StageSnapshot | None, name: str) -> float | None:
    """The stage's counter ``name`` (None: no such counter)."""
    return None if st is None or st.metric_kinds.get(name) != "counter" else number(st.metric(name))


def counter_delta(cur: StageSnapshot, prev: StageSnapshot | None, name: str) -> float | None:
    """What counter ``name`` added from ``prev`` to ``cur`` (from 0 where ``prev`` lacks it)."""
    a = counter(cur, name)
    return None if a is None else a - (counter(prev, name) or 0.0)


def delta(cur: float | None, prev: float | None) -> float | None:
    """``cur - prev`` of two optional readings (None where either is missing)."""
    return cur - prev if cur is not None and prev is not None else None


def fraction(seconds: float, span: float) -> float:
    """``seconds`` over ``span``, clipped to [0, 1] (0 for an empty span or a non-finite ratio)."""
    x = seconds / span if span > 0 else 0.0
    return min(1.0, max(0.0, x)) if math.isfinite(x) else 0.0


@attrs.frozen
class ReplicaWindow:
    """One replica over a window: seconds (never negative), items, and its thread's CPU and core-wait
    seconds (None where a snapshot did not read them; a replica that started inside the window counts from 0)."""

    replica: int
    busy_s: float
    blocked_in_s: float
    blocked_out_s: float
    alive_s: float
    items_in: int
    items_out: int
    cpu_s: float | None = None
    cpu_wait_s: float | None = None

    @classmethod
    def between(cls, cur: ReplicaSnapshot, prev: ReplicaSnapshot | None) -> ReplicaWindow:
        """The window from ``prev`` to ``cur`` (``prev=None``: from the replica's start)."""
        sched = None not in (cur.cpu_s, cur.cpu_wait_s) and (prev is None or None not in (prev.cpu_s, prev.cpu_wait_s))

        def d(name: str, clip: bool = True) -> Any:  # seconds never go negative; items are as counted
            x = getattr(cur, name) - (getattr(prev, name) if prev is not None else 0)
            return max(x, 0.0) if clip and prev is not None else x

        return cls(cur.replica, d("busy_s"), d("blocked_in_s"), d("blocked_out_s"), d("alive_s"),
                   d("items_in", False), d("items_out", False), d("cpu_s") if sched else None,
                   d("cpu_wait_s") if sched else None)

    def handled(self, is_source: bool) -> int:
        """Items it handled: emitted for a source, taken otherwise."""
        return self.items_out if is_source else self.items_in

    def busy(self, span: float) -> float:
        return fraction(self.busy_s, span)

    def blocked_in(self, span: float) -> float:
        return fraction(self.blocked_in_s, span)

    def blocked_out(self, span: float) -> float:
        return fraction(self.blocked_out_s, span)


@attrs.frozen
class StageWindow:
    """A stage's replicas over one window of ``span_s`` seconds (fractions: means over replicas;
    ``span_s=None``: each replica's fractions of its own life, the whole-run view)."""

    name: str
    replicas: tuple[ReplicaWindow, ...]
    span_s: float | None

    @classmethod
    def between(cls, cur: StageSnapshot, prev: StageSnapshot | None, span_s: float | None) -> StageWindow:
        before = {r.replica: r for r in prev.replicas} if prev is not None else {}
        return cls(cur.name, tuple(ReplicaWindow.between(r, before.get(r.replica)) for r in cur.replicas), span_s)

    def span_of(self, r: ReplicaWindow) -> float:
        return r.alive_s if self.span_s is None else self.span_s

    def _mean(self, seconds: str) -> float:
        return sum(fraction(getattr(r, seconds), self.span_of(r)) for r in self.replicas) / max(1, len(self.replicas))

    busy = property(lambda self: self._mean("busy_s"))
    blocked_in = property(lambda self: self._mean("blocked_in_s"))
    blocked_out = property(lambda self: self._mean("blocked_out_s"))
    busy_s = property(lambda self: sum(r.busy_s for r in self.replicas))
    items_in = property(lambda self: sum(r.items_in for r in self.replicas))
    items_out = property(lambda self: sum(r.items_out for r in self.replicas))

    def handled(self, is_source: bool) -> int:
        return sum(r.handled(is_source) for r in self.replicas)

    def alive(self, window: float) -> float:
        """The fraction of ``window`` its replicas were alive (started, not yet ended), mean over replicas."""
        if window <= 0 or not self.replicas:
            return 0.0
        return min(1.0, sum(r.alive_s for r in self.replicas) / len(self.replicas) / window)

    def load(self) -> StageLoad:
        return StageLoad(self.name, len(self.replicas), self.busy, self.blocked_in, self.blocked_out)
