"""One window of the runtime's cumulative readings: what the Monitor (``observe.sample``), the profiler
(``app.profile_data``) and the bottleneck analysis (``StageLoad``) all start from.

Snapshots carry cumulative seconds and counts per replica (busy, blocked on input and on output, alive,
items in and out, the thread's CPU and core-wait seconds); a window is the difference of two of them, taken
here once (:meth:`ReplicaWindow.between`) and read as typed fields: seconds, items, fractions of a span.
``prev=None`` is the window from the start (the readings themselves).
"""

from __future__ import annotations

import math

import attrs

from dflash_flow.core.snapshot import ReplicaSnapshot, StageSnapshot

from .bottleneck import StageLoad


def fraction(seconds: float, span: float) -> float:
    """``seconds`` over ``span``, clipped to [0, 1] (0 for an empty span or a non-finite ratio)."""
    x = seconds / span if span > 0 else 0.0
    return min(1.0, max(0.0, x)) if math.isfinite(x) else 0.0


@attrs.frozen
class ReplicaWindow:
    """One replica over a window: seconds busy, blocked on input, blocked on output and alive (never
    negative), items taken and emitted, and its thread's CPU and core-wait seconds (None where a snapshot
    did not read them; a replica that started inside the window counts from zero)."""

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
        if prev is None:
            return cls(cur.replica, cur.busy_s, cur.blocked_in_s, cur.blocked_out_s, cur.alive_s, cur.items_in,
                       cur.items_out, cur.cpu_s if cur.cpu_wait_s is not None else None,
                       cur.cpu_wait_s if cur.cpu_s is not None else None)
        sched = None not in (cur.cpu_s, cur.cpu_wait_s, prev.cpu_s, prev.cpu_wait_s)
        return cls(
            cur.replica,
            max(cur.busy_s - prev.busy_s, 0.0),
            max(cur.blocked_in_s - prev.blocked_in_s, 0.0),
            max(cur.blocked_out_s - prev.blocked_out_s, 0.0),
            max(cur.alive_s - prev.alive_s, 0.0),
            cur.items_in - prev.items_in,
            cur.items_out - prev.items_out,
            max(cur.cpu_s - prev.cpu_s, 0.0) if sched else None,  # type: ignore[operator]
            max(cur.cpu_wait_s - prev.cpu_wait_s, 0.0) if sched else None,  # type: ignore[operator]
        )

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
    """A stage's replicas over one window of ``span_s`` seconds: their windows, and the stage's figures
    (fractions are means over replicas; ``span_s=None``: each replica's fractions of its own life, the
    whole-run view)."""

    name: str
    replicas: tuple[ReplicaWindow, ...]
    span_s: float | None

    @classmethod
    def between(cls, cur: StageSnapshot, prev: StageSnapshot | None, span_s: float | None) -> StageWindow:
        before = {r.replica: r for r in prev.replicas} if prev is not None else {}
        return cls(cur.name, tuple(ReplicaWindow.between(r, before.get(r.replica)) for r in cur.replicas), span_s)

    def span_of(self, r: ReplicaWindow) -> float:
        return r.alive_s if self.span_s is None else self.span_s

    def _mean(self, values: list[float]) -> float:
        return sum(values) / max(1, len(values))

    @property
    def busy(self) -> float:
        return self._mean([r.busy(self.span_of(r)) for r in self.replicas])

    @property
    def blocked_in(self) -> float:
        return self._mean([r.blocked_in(self.span_of(r)) for r in self.replicas])

    @property
    def blocked_out(self) -> float:
        return self._mean([r.blocked_out(self.span_of(r)) for r in self.replicas])

    @property
    def busy_s(self) -> float:
        return sum(r.busy_s for r in self.replicas)

    @property
    def items_in(self) -> int:
        return sum(r.items_in for r in self.replicas)

    @property
    def items_out(self) -> int:
        return sum(r.items_out for r in self.replicas)

    def handled(self, is_source: bool) -> int:
        return sum(r.handled(is_source) for r in self.replicas)

    def alive(self, window: float) -> float:
        """The fraction of ``window`` its replicas were alive (started, not yet ended), mean over replicas:
        ``alive_s`` stops growing when a replica ends."""
        if window <= 0 or not self.replicas:
            return 0.0
        return min(1.0, sum(r.alive_s for r in self.replicas) / len(self.replicas) / window)

    def load(self) -> StageLoad:
        """What the bottleneck analysis reads of it."""
        return StageLoad(self.name, len(self.replicas), self.busy, self.blocked_in, self.blocked_out)
