"""A check on a change of torch's intra-op threads mid-run (``DrafterStep.torch_threads_after_first_epoch``).

More threads pay only when the cores are free: on a 2-core machine shared with another process that also
runs parallel work, two threads of small kernels spend their time waiting for each other and a step can
take several times what it took on one (measured: 622 vs 182 ms). The thread count itself stays what the
config says (the step's rounding depends on it, and a resumed run must round as the uninterrupted one
did); this watch compares the steps after a switch, window by window for the rest of the run, with
those just before it and says what to change when the switch made them slower.
"""

from __future__ import annotations

import statistics
from collections import deque


class ThreadSwitchWatch:
    """``observe(step_s)`` after every step; ``switched(old, new)`` when the thread count changes. Returns
    a warning (once per switch) when the median of a window of ``window`` steps after the switch, the
    first or any later one, is slower than the median of the last ``window`` before it by more than
    ``tolerance``: the cores may be free at the switch and taken later (measured on the 2-core box: a
    second process started mid-run made two-thread steps up to 100x slower; one thread merely shares).
    The default 0.5 leaves room for windows of costlier batches (a batch's cost varies ~3x with its
    rows' length); what a taken core does is far beyond it."""

    def __init__(self, window: int = 16, tolerance: float = 0.5, streak: int = 3, spike: float = 3.0) -> None:
        self.window = int(window)
        self.tolerance = float(tolerance)
        # Sooner when it is bad: ``streak`` steps in a row each ``spike`` times the median before the
        # switch (a taken core made steps 50-100x slower; waiting for a whole window cost minutes).
        self.streak = int(streak)
        self.spike = float(spike)
        self._run = 0
        self._before: deque[float] = deque(maxlen=self.window)
        self._reference: float | None = None  # the median before the switch
        self._after: list[float] = []
        self._change: tuple[int, int] | None = None

    def switched(self, old: int, new: int) -> None:
        self._change = (old, new)
        self._reference = statistics.median(self._before) if len(self._before) == self.window else None
        self._before.clear()
        self._after, self._run = [], 0

    def observe(self, step_s: float) -> str | None:
        if self._reference is None:
            self._before.append(step_s)
            return None
        self._after.append(step_s)
        self._run = self._run + 1 if step_s > self._reference * self.spike else 0
        if self._run >= self.streak:
            before, after = self._reference, statistics.median(self._after[-self.streak:])
            n = self.streak
        elif len(self._after) < self.window:
            return None
        else:
            before, after, n = self._reference, statistics.median(self._after), self.window
            if after <= before * (1 + self.tolerance):
                self._after = []
                return None
        self._after, self._run = [], 0
        old, new = self._change or (0, 0)
        self._reference = None  # said once for this switch
        return (f"steps got slower after the switch from {old} to {new} torch threads ({before * 1e3:.0f} -> "
                f"{after * 1e3:.0f} ms median over {n} steps): other work is using the cores; set "
                f"torch_threads_after_first_epoch: {old} (or null) for runs on a shared machine")
