"""A check on a change of torch's intra-op threads mid-run (``DrafterStep.torch_threads_after_first_epoch``).

More threads pay only when the cores are free: on a 2-core machine shared with another process that also
runs parallel work, two threads of small kernels spend their time waiting for each other and a step can
take several times what it took on one (measured: 622 vs 182 ms). The thread count itself stays what the
config says (the step's rounding depends on it, and a resumed run must round as the uninterrupted one
did); this watch compares the steps just after a switch with those just before and says what to change
when the switch made them slower.
"""

from __future__ import annotations

import statistics
from collections import deque


class ThreadSwitchWatch:
    """``observe(step_s)`` after every step; ``switched(old, new)`` when the thread count changes. Returns
    a warning (once per switch) when the median of the first ``window`` steps after the switch is slower
    than the median of the last ``window`` before it by more than ``tolerance``."""

    def __init__(self, window: int = 16, tolerance: float = 0.1) -> None:
        self.window = int(window)
        self.tolerance = float(tolerance)
        self._before: deque[float] = deque(maxlen=self.window)
        self._after: list[float] | None = None
        self._change: tuple[int, int] | None = None

    def switched(self, old: int, new: int) -> None:
        self._change = (old, new)
        self._after = [] if len(self._before) == self.window else None

    def observe(self, step_s: float) -> str | None:
        if self._after is None:
            self._before.append(step_s)
            return None
        self._after.append(step_s)
        if len(self._after) < self.window:
            return None
        before, after = statistics.median(self._before), statistics.median(self._after)
        old, new = self._change or (0, 0)
        self._before.clear()
        self._before.extend(self._after)
        self._after = None
        if after <= before * (1 + self.tolerance):
            return None
        return (f"steps got slower after the switch from {old} to {new} torch threads ({before * 1e3:.0f} -> "
                f"{after * 1e3:.0f} ms median over {self.window} steps): other work is using the cores; set "
                f"torch_threads_after_first_epoch: {old} (or null) for runs on a shared machine")
