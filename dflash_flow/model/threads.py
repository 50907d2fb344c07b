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

import attrs

from dflash_flow.core.stage import cfg


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


@attrs.frozen(kw_only=True)
class ThreadKnobs:
    """The trainer's torch intra-op threads (declared once here; DrafterStep's YAML fields, ``core.fields.include``).
    None of them changes a trained weight on a given machine: ``result=False``."""

    torch_threads: int | None = cfg(None, ge=1, result=False, doc="torch intra-op threads (CPU runs).")
    torch_threads_after_first_epoch: int | None = cfg(
        None, ge=1, result=False,
        doc="torch intra-op threads from the second epoch on (default: torch_threads): with TargetForward's "
        "cache_features the target is idle after the first epoch, and its cores can go to the drafter.",
    )
    threads_fallback: bool = cfg(
        True, result=False,
        doc="When steps after the switch to torch_threads_after_first_epoch run slower than the steps before it "
        "(another process took a core: two threads then wait on each other, up to 100x slower on a 2-core box), "
        "go back to torch_threads for the rest of the run. The step is kept in the checkpoint: a resumed run "
        "uses the threads the interrupted one used at every step.",
    )


class ThreadPolicy:
    """This thread's torch intra-op threads for each batch: ``torch_threads``, then
    ``torch_threads_after_first_epoch`` from the second epoch on, back to the first for the rest of the run once
    the watch (``ThreadSwitchWatch``) finds the switch made steps slower (``threads_fallback``). A function of
    the epoch and of the batch the threads went back at (``fallback_at``, kept in the trainer's state), so a
    resumed run computes each step with the threads the uninterrupted run used."""

    def __init__(self, knobs: ThreadKnobs, fallback_at: int | None = None) -> None:
        self.knobs = knobs
        self.fallback_at = fallback_at  # batches consumed when the threads went back
        self.threads: int | None = None  # what this thread runs with now (None: never set)
        self._initial: int | None = None  # the thread's own setting before any switch
        self._watch = ThreadSwitchWatch()

    @property
    def base(self) -> int | None:
        """The threads before any switch: ``torch_threads``, else what the thread had."""
        return self.knobs.torch_threads or self._initial

    def apply(self, epoch: int, consumed: int) -> int | None:
        """Set the threads for a batch of ``epoch`` after ``consumed`` batches of the run; returns them."""
        import torch

        if self._initial is None:
            self._initial = torch.get_num_threads()
        later = self.knobs.torch_threads_after_first_epoch
        fell_back = self.fallback_at is not None and consumed >= self.fallback_at
        want = later if later and epoch >= 1 and not fell_back else self.base
        if want and want != self.threads:
            torch.set_num_threads(want)
            if self.threads is not None:
                self._watch.switched(self.threads, want)
            self.threads = want
        return self.threads

    def observe(self, step_s: float, consumed: int) -> str | None:
        """After each step: the watch's warning, if any; with ``threads_fallback`` the warning also sends the
        rest of the run back to ``torch_threads`` (from the next batch on)."""
        warning = self._watch.observe(step_s)
        if not warning:
            return None
        k = self.knobs
        if k.threads_fallback and k.torch_threads_after_first_epoch and self.fallback_at is None:
            self.fallback_at = consumed
            back = self.base
            warning += (f"; going back to {back} torch thread{'s' if back != 1 else ''} from batch "
                        f"{consumed} on, for the rest of the run (threads_fallback)")
        return warning
