"""Small stages for the core runtime tests. Registered under ``Test...`` names.

Stages that record what they saw write into ``ctx.services`` (a dict passed to ``Pipeline(services=...)``),
so a test can inspect every replica's view after the run without globals.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import attrs

from dflash_flow.core import Source, Stage, cfg, register_stage

PHASES = ("setup", "process", "finish", "teardown")


def _log(ctx, key: str) -> list:
    # dict.setdefault is atomic under the GIL, so replicas racing here share one list.
    return ctx.services.setdefault(key, [])


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestSource(Source):
    """Emits (name, replica, k) for k < count, with an optional seeded random delay per item."""

    shards_by_replica = True  # items are tagged with the replica, so replicas never repeat each other

    count: int = cfg(10, ge=0, doc="Items per replica.")
    max_delay_s: float = cfg(0.0, ge=0, doc="Random delay per item, uniform in [0, max_delay_s].")
    fail_at: int = cfg(-1, doc="Raise while producing item k (replica 0); -1: never.")
    plain: bool = cfg(False, doc="Emit plain integers k instead of tuples.")
    _next: int = attrs.field(default=0, init=False)

    def setup(self, ctx) -> None:
        self._ctx = ctx
        self._rng = random.Random(ctx.seed_for(0, ctx.replica))

    def produce(self):
        ctx = self._ctx
        while self._next < self.count:
            k = self._next
            if self.fail_at == k and ctx.replica == 0:
                raise RuntimeError(f"source failed at item {k}")
            if self.max_delay_s:
                time.sleep(self._rng.uniform(0, self.max_delay_s))
            self._next += 1
            yield k if self.plain else (ctx.name, ctx.replica, k)

    def get_state(self) -> dict[str, Any]:
        return {"next": self._next}


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestInfiniteSource(Source):
    """Emits 0, 1, 2, ... until stopped, sleeping ``period_s`` per item. Sets the ``started`` service event."""

    period_s: float = cfg(0.001, ge=0)

    def setup(self, ctx) -> None:
        self._ctx = ctx

    def produce(self):
        started = self._ctx.services.get("started")
        k = 0
        while True:
            if started is not None and k == 1:
                started.set()
            if self.period_s:
                time.sleep(self.period_s)
            yield k
            k += 1


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestPass(Stage):
    """1:1 pass-through with a small seeded random delay; records (replica, item) under ``seen:NAME``."""

    max_delay_s: float = cfg(0.0, ge=0)

    def setup(self, ctx) -> None:
        self._name = ctx.name
        self._replica = ctx.replica
        self._seen = _log(ctx, f"seen:{ctx.name}")
        self._rng = random.Random(ctx.seed_for(0, ctx.replica))

    def process(self, item):
        self._seen.append((self._replica, item))
        if self.max_delay_s:
            time.sleep(self._rng.uniform(0, self.max_delay_s))
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestDrop(Stage):
    """1:1 filter: drops integers divisible by ``every`` (0: keeps all), after a seeded random delay."""

    input_type = int
    output_type = int

    every: int = cfg(3, ge=0)
    max_delay_s: float = cfg(0.0, ge=0)

    def setup(self, ctx) -> None:
        self._rng = random.Random(ctx.seed_for(0, ctx.replica))

    def process(self, item):
        if self.max_delay_s:
            time.sleep(self._rng.uniform(0, self.max_delay_s))
        if self.every and item % self.every == 0:
            return None
        return [item]


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestSplit(Stage):
    """1:n: emits ``n`` items (item, j) per input; records (replica, item) under ``seen:NAME``."""

    cardinality = "1:n"
    n: int = cfg(2, ge=0)

    def setup(self, ctx) -> None:
        self._replica = ctx.replica
        self._seen = _log(ctx, f"seen:{ctx.name}")

    def process(self, item):
        self._seen.append((self._replica, item))
        for j in range(self.n):
            yield (item, j)


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestSink(Stage):
    """Records (replica, item) under ``sink:NAME``; counts lifecycle calls under ``life:NAME``."""

    output_type = None

    def setup(self, ctx) -> None:
        self._replica = ctx.replica
        self._items = _log(ctx, f"sink:{ctx.name}")
        self._life = _log(ctx, f"life:{ctx.name}")
        self._life.append(("setup", ctx.replica, threading.current_thread().name))
        self._counter = ctx.metrics.counter("seen", "items", "Items seen")

    def process(self, item):
        self._items.append((self._replica, item))
        self._counter.inc()
        return None

    def finish(self):
        self._life.append(("finish", self._replica))
        return None

    def teardown(self) -> None:
        self._life.append(("teardown", self._replica))


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestFail(Stage):
    """Passes items through, but raises in ``phase`` on replica ``replica`` (process: at its ``at``-th item).

    With ``shared: true`` the process failure happens at the stage's ``at``-th item over all replicas.
    Records lifecycle calls under ``life:NAME``.
    """

    phase: str = cfg("process", choices=PHASES)
    at: int = cfg(0, ge=0, doc="Item index (0-based) at which process() raises.")
    replica: int = cfg(0, ge=0, doc="Which replica fails (ignored with shared).")
    shared: bool = cfg(False)
    _n: int = attrs.field(default=0, init=False)

    def setup(self, ctx) -> None:
        self._ctx = ctx
        self._life = _log(ctx, f"life:{ctx.name}")
        self._life.append(("setup", ctx.replica))
        self._global = ctx.services.setdefault(f"count:{ctx.name}", _AtomicCounter())
        if self.phase == "setup" and self._mine():
            raise ValueError(f"boom in setup of {ctx.name}[{ctx.replica}]")

    def _mine(self) -> bool:
        return self.shared or self._ctx.replica == self.replica

    def process(self, item):
        if self.phase == "process":
            k = self._global.next() if self.shared else self._n
            self._n += 1
            if k == self.at and self._mine():
                raise ValueError(f"boom at item {k} in {self._ctx.name}[{self._ctx.replica}]")
        return (item,)

    def finish(self):
        self._life.append(("finish", self._ctx.replica))
        if self.phase == "finish" and self._mine():
            raise ValueError("boom in finish")
        return None

    def teardown(self) -> None:
        self._life.append(("teardown", self._ctx.replica))
        if self.phase == "teardown" and self._mine():
            raise ValueError("boom in teardown")


class _AtomicCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def next(self) -> int:
        with self._lock:
            n = self._n
            self._n += 1
            return n


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestHang(Stage):
    """Blocks in process (outside any channel) for up to ``hold_s``, or until the pipeline stops."""

    hold_s: float = cfg(60.0, ge=0)
    at: int = cfg(0, ge=0, doc="Hang on this item index (per replica).")
    _n: int = attrs.field(default=0, init=False)

    def setup(self, ctx) -> None:
        self._stop = ctx.stop_requested

    def process(self, item):
        if self._n == self.at:
            self._stop.wait(self.hold_s)
        self._n += 1
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestBlock(Stage):
    """Blocks in process on the ``release`` service event, deaf to stop requests (like a stuck library call).

    Sets the ``blocked`` service event when it starts blocking.
    """

    def setup(self, ctx) -> None:
        self._release = ctx.services["release"]
        self._blocked = ctx.services["blocked"]

    def process(self, item):
        self._blocked.set()
        self._release.wait(60)
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestSleep(Stage):
    """Sleeps a fixed ``service_s`` per item (GIL-free) and passes it on."""

    service_s: float = cfg(0.001, ge=0)

    def process(self, item):
        time.sleep(self.service_s)
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestIntOnly(Stage):
    """Accepts only str items (to provoke a type mismatch)."""

    input_type = str
    output_type = str

    def process(self, item):
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class TestTyped(Stage):
    """Config of every supported field type (for validation tests)."""

    size: int = cfg(1, ge=1)
    rate: float = cfg(0.5, le=1.0)
    label: str = cfg("x")
    flag: bool = cfg(False)
    sizes: list[int] = cfg(factory=list)
    mode: str = cfg("a", choices=("a", "b"))
    required: int = cfg()

    def process(self, item):
        return (item,)


# -- helpers shared by the test modules ------------------------------------------------------------
def runtime_threads() -> list[threading.Thread]:
    """Live threads started by the runtime (replicas, supervisor, drain timer)."""
    return [t for t in threading.enumerate() if t.name.startswith("dflash-flow")]


def wait_threads_back(baseline: set[threading.Thread], timeout: float = 5.0) -> list[threading.Thread]:
    """Threads not in ``baseline`` still alive after up to ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        extra = [t for t in threading.enumerate() if t not in baseline and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)


def fast_runtime(**overrides):
    """Runtime options that keep failure paths quick in tests."""
    from dflash_flow.core import RuntimeOptions

    opts = dict(
        capacity=4, stall_timeout_s=20.0, drain_timeout_s=5.0, shutdown_grace_s=5.0, watchdog_interval_s=0.05
    )
    opts.update(overrides)
    return RuntimeOptions(**opts)
