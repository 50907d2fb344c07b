"""Fan-out policies of an edge into a replicated stage.

One router object exists per edge and is shared by every producer replica of that edge, so the
round-robin counter is a single counter: the items sent to any two consumer replicas never differ by more
than one, however many producers there are.
"""

from __future__ import annotations

import itertools
from typing import Literal

from .channel import Channel

Policy = Literal["round_robin", "least_loaded", "broadcast"]
POLICIES: tuple[str, ...] = ("round_robin", "least_loaded", "broadcast")


class Router:
    """Chooses the consumer channels an item goes to."""

    policy: str = ""

    def __init__(self, channels: list[Channel]):
        self.channels = channels

    def targets(self) -> list[Channel] | Channel:  # pragma: no cover - overridden
        raise NotImplementedError


class RoundRobin(Router):
    policy = "round_robin"

    def __init__(self, channels: list[Channel]):
        super().__init__(channels)
        # itertools.count.__next__ runs in C under the GIL, so concurrent producers never get the same
        # number and never skip one: no lock needed on the hot path.
        self._counter = itertools.count()
        self._n = len(channels)

    def targets(self) -> Channel:
        return self.channels[next(self._counter) % self._n]


class LeastLoaded(Router):
    policy = "least_loaded"

    def __init__(self, channels: list[Channel]):
        super().__init__(channels)
        self._tiebreak = itertools.count()

    def targets(self) -> Channel:
        n = len(self.channels)
        start = next(self._tiebreak) % n
        best = None
        best_depth = None
        # Rotate the scan start so equal depths do not always favour replica 0.
        for i in range(n):
            ch = self.channels[(start + i) % n]
            d = ch.depth
            if best_depth is None or d < best_depth:
                best, best_depth = ch, d
        return best


class Broadcast(Router):
    policy = "broadcast"

    def targets(self) -> list[Channel]:
        return self.channels


def make_router(policy: str, channels: list[Channel]) -> Router:
    if len(channels) == 1 and policy != "broadcast":
        return RoundRobin(channels)
    if policy == "round_robin":
        return RoundRobin(channels)
    if policy == "least_loaded":
        return LeastLoaded(channels)
    if policy == "broadcast":
        return Broadcast(channels)
    raise ValueError(f"unknown fan-out policy {policy!r}; expected one of {', '.join(POLICIES)}")
