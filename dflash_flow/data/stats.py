"""Batch-quality figures: padding efficiency, same-bucket runs, window mix, per-bucket counters.

Used by the benchmark, the tests and the Interleaver/Padder stages' metrics. numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from dflash_flow.items import BatchMeta

__all__ = [
    "max_same_bucket_run",
    "padding_efficiency",
    "window_mix_max_deviation",
]


def padding_efficiency(metas: Iterable[BatchMeta]) -> float:
    """Real tokens / padded tokens over all batches (1.0 = no padding)."""
    real = padded = 0
    for m in metas:
        real += m.real_tokens
        padded += m.padded_tokens
    return real / padded if padded else 1.0


def max_same_bucket_run(buckets: Sequence[int] | np.ndarray) -> int:
    """Length of the longest run of consecutive batches from one bucket."""
    b = np.asarray(buckets)
    if b.size == 0:
        return 0
    change = np.flatnonzero(b[1:] != b[:-1]) + 1
    edges = np.concatenate(([0], change, [b.size]))
    return int(np.diff(edges).max())


def window_mix_max_deviation(buckets: Sequence[int] | np.ndarray, window: int = 32) -> float:
    """Largest |share of a bucket in a window - its share in the whole sequence|, over all windows of
    ``window`` consecutive batches and all buckets. A short sequence counts as one window."""
    b = np.asarray(buckets, dtype=np.int64)
    if b.size == 0:
        return 0.0
    w = min(window, b.size)
    n_buckets = int(b.max()) + 1
    onehot = np.zeros((b.size + 1, n_buckets), dtype=np.int64)
    onehot[np.arange(1, b.size + 1), b] = 1
    cum = np.cumsum(onehot, axis=0)
    in_window = (cum[w:] - cum[:-w]) / w
    overall = cum[-1] / b.size
    return float(np.abs(in_window - overall).max())
