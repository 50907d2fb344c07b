"""Snapshots of a running pipeline (cumulative readings) and the runtime's one :class:`Sampler` of them."""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from .channel import ChannelStats
from .metrics import merge_values


class ReplicaState(enum.StrEnum):
    """Where a replica's thread is (string-valued: prints and compares as its name)."""

    PENDING = "pending"  # its thread has not started
    SETUP = "setup"  # in the stage's setup (and loading its resume state)
    WAITING = "waiting"  # waiting for input
    BUSY = "busy"  # in the stage's own code (process, produce, finish)
    BLOCKED = "blocked"  # waiting to put an output (backpressure)
    TEARDOWN = "teardown"
    FINISHED = "finished"
    FAILED = "failed"


@attrs.define
class ReplicaSnapshot:
    replica: int
    device: str
    state: ReplicaState
    items_in: int
    items_out: int
    busy_s: float
    blocked_in_s: float
    blocked_out_s: float
    alive_s: float
    metrics: dict[str, Any]
    channel: ChannelStats | None
    cpu_s: float | None = None  # CPU seconds its thread has run (None: the OS does not say)
    cpu_wait_s: float | None = None  # seconds its thread has waited, runnable, for a core
    setup_s: float = 0.0  # from its thread's start to the end of setup and resume state (within busy_s)


@attrs.define
class StageSnapshot:
    name: str
    type: str
    replicas: list[ReplicaSnapshot]
    metric_kinds: dict[str, str]

    def metric(self, name: str) -> Any:
        values = [r.metrics[name] for r in self.replicas if name in r.metrics]
        return merge_values(self.metric_kinds.get(name, "gauge"), values)

    def fractions(self) -> dict[str, float]:
        alive = sum(r.alive_s for r in self.replicas) or 1e-9
        return {k: sum(getattr(r, f"{k}_s") for r in self.replicas) / alive
                for k in ("busy", "blocked_in", "blocked_out")}


@attrs.define
class RuntimeSnapshot:
    time: float
    elapsed_s: float
    stages: dict[str, StageSnapshot]
    cpu_s: float | None = None  # the process's CPU seconds so far, all its threads (None: not read)


MIN_INTERVAL_S = 0.01
IDLE_WAIT_S = 0.5  # how often a sampler without subscribers looks again


@attrs.define(eq=False)
class _Subscription:
    callback: Callable[[Any], None]
    interval_s: float
    owner: str
    last: float = 0.0
    active: bool = True


class Sampler:
    """A thread that calls each subscriber with a snapshot every ``interval_s``, also while nothing moves. Callbacks
    run on its thread and must be quick; one that raises fails the run as its owner's (``on_error``)."""

    def __init__(self, snapshot: Callable[[], Any], on_error: Callable[[str, BaseException], None]) -> None:
        self._snapshot = snapshot
        self._on_error = on_error
        self._subs: list[_Subscription] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._thread: threading.Thread | None = None

    def subscribe(self, callback: Callable[[Any], None], interval_s: float, *, owner: str) -> _Subscription:
        sub = _Subscription(callback, max(float(interval_s), MIN_INTERVAL_S), owner, last=time.monotonic())
        with self._lock:
            self._subs.append(sub)
        self._wake.set()  # a shorter interval than the current wait: look again now
        return sub

    def unsubscribe(self, sub: _Subscription) -> None:
        """After this returns, ``sub``'s callback is not running and is not called again."""
        with self._lock:
            sub.active = False
            if sub in self._subs:
                self._subs.remove(sub)

    def start(self) -> None:
        if self._thread is None and not self._stopped:
            self._thread = threading.Thread(target=self._loop, name="dflash-flow:sampler", daemon=False)
            self._thread.start()

    def stop(self) -> None:
        self._stopped = True
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stopped:
            with self._lock:
                subs = list(self._subs)
            now = time.monotonic()
            wait = min((s.last + s.interval_s - now for s in subs), default=IDLE_WAIT_S)
            if wait > 0:
                self._wake.wait(wait)
                self._wake.clear()
                continue
            snap = None
            for sub in subs:
                now = time.monotonic()
                if now - sub.last < sub.interval_s:
                    continue
                sub.last = now
                with self._lock:  # unsubscribe() waits for a running callback
                    if not sub.active or self._stopped:
                        continue
                    try:
                        snap = snap if snap is not None else self._snapshot()
                        sub.callback(snap)
                    except Exception as exc:  # noqa: BLE001 - becomes the owner's failure
                        sub.active = False
                        self._subs.remove(sub)
                        self._on_error(sub.owner, exc)
