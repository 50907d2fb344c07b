"""The 90% intervals of ``dflash-flow profile`` and ``plan``: batch means over the equal parts of a
measured window (the spread of k per-part values, Student's t with k - 1 degrees of freedom)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import attrs

LEVEL = 0.90  # the intervals' confidence
# Student's t, one-sided 0.95 quantile (a two-sided 90% interval), 1..30 degrees of freedom.
_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)


def t95(df: int) -> float:
    """The 0.95 quantile of Student's t with ``df`` degrees of freedom (past 30: a one-term expansion)."""
    if df < 1:
        raise ValueError("df must be >= 1")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.6449
    return z + (z**3 + z) / (4 * df)


@attrs.frozen
class Interval:
    """A ``LEVEL`` interval from ``windows`` parts of the profile's window."""

    low: float
    high: float
    windows: int
    level: float = LEVEL

    def __contains__(self, x: float) -> bool:
        return self.low <= x <= self.high

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def batch_means(centre: float, per_window: Sequence[float]) -> Interval | None:
    """``centre +- t(0.95, k-1) * sd / sqrt(k)`` over the ``k`` per-part values; None below two parts or
    when a value is not finite."""
    k = len(per_window)
    if k < 2 or not math.isfinite(centre) or not all(math.isfinite(x) for x in per_window):
        return None
    half = t95(k - 1) * statistics.stdev(per_window) / math.sqrt(k)
    return Interval(low=centre - half, high=centre + half, windows=k)
