"""Bounded channels (one per consumer replica): blocking put is backpressure, the last close is end-of-stream,
errors travel as values, ``cancel`` wakes every blocked caller; and the fan-out routers (one per edge)."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from time import perf_counter
from typing import Any

import attrs


class ChannelCancelled(Exception):
    """Raised in a blocked or later put/get after the pipeline was cancelled."""


class Sentinel:
    """A marker object compared by identity, shown by its name."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


END_OF_STREAM = Sentinel("END_OF_STREAM")


@attrs.frozen
class ErrorItem:
    """An upstream failure delivered in-band; the consumer re-raises it."""

    stage: str
    replica: int
    error: BaseException


@attrs.define
class ChannelStats:
    capacity: int
    depth: int
    items_in: int
    items_out: int
    blocked_put_s: float
    blocked_get_s: float


class Channel:
    __slots__ = ("name", "capacity", "_buf", "_lock", "_not_empty", "_not_full", "_open_producers",
                 "_cancelled", "items_in", "items_out", "blocked_put_s", "blocked_get_s",
                 "_waiting_since", "_awaited", "_putters")

    def __init__(self, capacity: int, name: str = "", producers: int = 1):
        if capacity < 1:
            raise ValueError(f"channel capacity must be >= 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._buf: deque = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._open_producers = producers
        self._cancelled = False
        self.items_in = 0
        self.items_out = 0
        self.blocked_put_s = 0.0
        self.blocked_get_s = 0.0
        self._waiting_since: dict[int, float] = {}  # thread ident -> when its put or get began to wait
        self._awaited: Any = None  # the seq an ordered consumer awaits in get_seq: let in past the capacity
        self._putters = 0  # producers waiting in put

    def _full_for(self, item: Any) -> bool:
        if len(self._buf) < self.capacity:
            return False
        return not (self._awaited is not None and type(item) is tuple and len(item) == 2 and item[0] == self._awaited)

    def put(self, item: Any) -> float:
        """Append ``item``, blocking while the channel is full; returns the seconds spent blocked."""
        blocked = 0.0
        with self._not_full:
            if self._cancelled:
                raise ChannelCancelled(self.name)
            if self._full_for(item):
                t0 = perf_counter()
                me = threading.get_ident()
                self._waiting_since[me] = t0
                self._putters += 1
                self._not_empty.notify_all()  # an ordered consumer in get_seq counts the producers that wait
                try:
                    while self._full_for(item) and not self._cancelled:
                        self._not_full.wait()
                finally:
                    self._putters -= 1
                    del self._waiting_since[me]
                blocked = perf_counter() - t0
                self.blocked_put_s += blocked
                if self._cancelled:
                    raise ChannelCancelled(self.name)
            self._buf.append(item)
            self.items_in += 1
            self._not_empty.notify()
        return blocked

    def put_error(self, item: ErrorItem) -> None:
        """Deliver an error without waiting for room: a failing producer must never block."""
        with self._lock:
            self._buf.append(item)
            self._not_empty.notify()

    def get(self) -> Any:
        """Next item, or ``END_OF_STREAM`` once every producer has closed and the buffer is empty."""
        with self._not_empty:
            if not self._buf:
                t0 = perf_counter()
                me = threading.get_ident()
                self._waiting_since[me] = t0
                try:
                    while not self._buf:
                        if self._cancelled:
                            raise ChannelCancelled(self.name)
                        if self._open_producers <= 0:
                            self.blocked_get_s += perf_counter() - t0
                            return END_OF_STREAM
                        self._not_empty.wait()
                finally:
                    del self._waiting_since[me]
                self.blocked_get_s += perf_counter() - t0
            elif self._cancelled:
                raise ChannelCancelled(self.name)
            item = self._buf.popleft()
            self.items_out += 1
            self._not_full.notify()
            return item

    def get_seq(self, seq: Any, progress: Any = None, poll_s: float = 0.1) -> Any:
        """For an ordered consumer holding ``capacity`` items out of order: the envelope ``(seq, item)`` (let in past
        the capacity), an error or an unnumbered envelope, wherever it is in the buffer; None at end-of-stream. The
        oldest item is taken instead once every open producer waits in ``put``, or once ``progress()`` (None while
        upstream works) reads the same twice ``poll_s`` apart (a producer may hold ``seq`` behind one it cannot put)."""
        with self._not_empty:
            self._awaited = seq
            self._not_full.notify_all()  # a producer waiting to put `seq` may now
            t0 = perf_counter()
            me = threading.get_ident()
            self._waiting_since[me] = t0
            last = None
            try:
                while True:
                    if self._cancelled:
                        raise ChannelCancelled(self.name)
                    for i, env in enumerate(self._buf):
                        if isinstance(env, ErrorItem) or (type(env) is tuple and env[0] in (seq, None)):
                            del self._buf[i]
                            return self._taken(env)
                    if self._open_producers <= 0:
                        return None
                    if self._buf and self._putters >= self._open_producers:
                        return self._taken(self._buf.popleft())
                    if progress is None:
                        self._not_empty.wait()
                        continue
                    now = progress()
                    if self._buf and now is not None and now == last:
                        return self._taken(self._buf.popleft())
                    last = now
                    self._not_empty.wait(poll_s)
            finally:
                self._awaited = None
                del self._waiting_since[me]
                self.blocked_get_s += perf_counter() - t0

    def _taken(self, env: Any) -> Any:
        self.items_out += 1
        self._not_full.notify()
        return env

    def close(self) -> None:
        """One producer is done. The last close is end-of-stream."""
        with self._lock:
            self._open_producers -= 1
            if self._open_producers <= 0:
                self._not_empty.notify_all()

    def cancel(self) -> None:
        """Wake everyone; every later put/get raises ChannelCancelled. Idempotent."""
        with self._lock:
            self._cancelled = True
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def waiting_s(self, ident: int) -> float:
        """Seconds the thread ``ident`` has been waiting in a put or get of this channel (0: not waiting)."""
        since = self._waiting_since.get(ident)
        return max(perf_counter() - since, 0.0) if since is not None else 0.0

    @property
    def depth(self) -> int:
        return len(self._buf)

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def stats(self) -> ChannelStats:
        return ChannelStats(capacity=self.capacity, depth=len(self._buf), items_in=self.items_in,
                            items_out=self.items_out, blocked_put_s=self.blocked_put_s, blocked_get_s=self.blocked_get_s)


# -- fan-out ------------------------------------------------------------------------------------------
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "broadcast")


class Router:
    """Chooses the consumer channels an item goes to."""

    def __init__(self, channels: list[Channel]):
        self.channels = channels
        self._counter = itertools.count()  # next() is atomic under the GIL: no lock on the hot path

    def targets(self) -> list[Channel] | Channel:  # pragma: no cover - overridden
        raise NotImplementedError


class RoundRobin(Router):
    def targets(self) -> Channel:
        return self.channels[next(self._counter) % len(self.channels)]


class LeastLoaded(Router):
    def targets(self) -> Channel:
        n = len(self.channels)
        start = next(self._counter) % n  # rotate the scan start so equal depths do not always favour replica 0
        return min((self.channels[(start + i) % n] for i in range(n)), key=lambda ch: ch.depth)


class Broadcast(Router):
    def targets(self) -> list[Channel]:
        return self.channels


def make_router(policy: str, channels: list[Channel]) -> Router:
    if policy == "broadcast":
        return Broadcast(channels)
    if policy == "least_loaded" and len(channels) > 1:
        return LeastLoaded(channels)
    if policy in ("round_robin", "least_loaded") or len(channels) == 1:
        return RoundRobin(channels)
    raise ValueError(f"unknown fan-out policy {policy!r}; expected one of {', '.join(POLICIES)}")
