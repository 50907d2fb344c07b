"""Generic stages for exercising the runtime: a counting source, a fixed (GIL-free) service time, a sink."""

from __future__ import annotations

import time
from typing import Any

import attrs

from dflash_flow.core import Source, Stage, cfg, limits
from dflash_flow.core.metrics import Counter, stage_metric


@attrs.define(kw_only=True, eq=False)
class Range(Source):
    """Emits the integers 0..count-1, optionally spending `service_s` per item (replicas share them)."""

    output_type = int
    shards_by_replica = True

    count: int = cfg(10, ge=0, doc="How many integers to emit.")
    service_s: float = cfg(0.0, ge=0, le=limits.MAX_SECONDS, result=False, doc="Seconds of (GIL-free) work per item.")
    _next: int = attrs.field(default=0, init=False)

    def setup(self, ctx) -> None:
        # Replica r of n emits r, r+n, r+2n, ...: together the replicas emit each integer once.
        self._stride = ctx.num_replicas
        if self._next == 0:
            self._next = ctx.replica

    def produce(self):
        while self._next < self.count:
            if self.service_s:
                time.sleep(self.service_s)
            value = self._next
            self._next += self._stride
            yield value

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next}

    def set_state(self, state: dict[str, Any]) -> None:
        self._next = int(state["next"])


@attrs.define(kw_only=True, eq=False)
class Delay(Stage):
    """Passes items through after `service_s` +- `jitter_s` seconds of GIL-free work (a stand-in for a GPU kernel)."""

    service_s: float = cfg(0.0, ge=0, le=limits.MAX_SECONDS, result=False, doc="Seconds per item.")
    jitter_s: float = cfg(0.0, ge=0, le=limits.MAX_SECONDS, result=False,
                          doc="Each item's time is uniform in service_s +- jitter_s (at most service_s).")

    def setup(self, ctx) -> None:
        import random

        self._rng = random.Random(ctx.seed_for(0, "jitter"))

    def process(self, item):
        delay = self.service_s
        if self.jitter_s:
            j = min(self.jitter_s, self.service_s)
            delay += self._rng.uniform(-j, j)
        if delay > 0:
            time.sleep(delay)
        return (item,)


@attrs.define
class DiscardMetrics:
    items: Counter = stage_metric("items", "Items consumed")


@attrs.define(kw_only=True, eq=False)
class Discard(Stage):
    """Consumes items and counts them (a sink)."""

    output_type = None
    stage_metrics = (DiscardMetrics,)
    _count: int = attrs.field(default=0, init=False)

    def setup(self, ctx) -> None:
        self._m = ctx.metrics.declare(DiscardMetrics)

    def process(self, item):
        self._count += 1
        self._m.items.inc()

    def get_state(self) -> dict[str, Any]:
        return {"count": self._count}

    def set_state(self, state: dict[str, Any]) -> None:
        self._count = int(state["count"])
