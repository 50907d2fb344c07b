"""The runtime's one sampler: a supervisor-owned thread that takes a ``RuntimeSnapshot`` on a clock and hands
it to its subscribers (the Monitor, ``dflash-flow profile``), whether or not items are flowing -- a stalled
pipeline is sampled like a busy one. Each subscriber has its own interval; one snapshot serves every
subscriber due at the same tick. A subscriber that raises ends the run as its owner's failure (the
supervisor's ``on_error``). The thread is not a daemon: ``stop()`` (idempotent) wakes and joins it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

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
    """``subscribe(callback, interval_s, owner=...)`` before or while the pipeline runs; the callbacks run
    on the sampler's thread and get the snapshot (they must be quick: a store write belongs on a writer)."""

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
