"""Bounded channels: blocking put is the backpressure, close is end-of-stream, errors travel as values.

A channel is the input queue of exactly one consumer replica; any number of producer replicas put into it.
It is closed (end-of-stream) once every producer has closed it. ``cancel`` wakes every blocked caller,
which is how the supervisor stops a pipeline without polling.
"""

from __future__ import annotations

import threading
from collections import deque
from time import perf_counter
from typing import Any

import attrs


class ChannelCancelled(Exception):
    """Raised in a blocked or later put/get after the pipeline was cancelled."""


class _EndOfStream:
    __slots__ = ()

    def __repr__(self) -> str:
        return "END_OF_STREAM"


END_OF_STREAM = _EndOfStream()


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
    __slots__ = (
        "name",
        "capacity",
        "_buf",
        "_lock",
        "_not_empty",
        "_not_full",
        "_open_producers",
        "_cancelled",
        "items_in",
        "items_out",
        "blocked_put_s",
        "blocked_get_s",
        "_waiting_since",
    )

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
        # thread ident -> perf_counter() when its put or get began to wait: a reading taken during a long
        # wait counts it so far (the totals above grow only when a wait ends)
        self._waiting_since: dict[int, float] = {}

    def put(self, item: Any) -> float:
        """Append ``item``, blocking while the channel is full. Returns the seconds spent blocked."""
        blocked = 0.0
        with self._not_full:
            if self._cancelled:
                raise ChannelCancelled(self.name)
            if len(self._buf) >= self.capacity:
                t0 = perf_counter()
                me = threading.get_ident()
                self._waiting_since[me] = t0
                try:
                    while len(self._buf) >= self.capacity and not self._cancelled:
                        self._not_full.wait()
                finally:
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
        return ChannelStats(
            capacity=self.capacity,
            depth=len(self._buf),
            items_in=self.items_in,
            items_out=self.items_out,
            blocked_put_s=self.blocked_put_s,
            blocked_get_s=self.blocked_get_s,
        )
