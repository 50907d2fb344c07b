"""Batch-quality figures: padding efficiency, same-bucket runs, window mix, per-bucket counters.

Used by the benchmark, the tests and the Interleaver/Padder stages' metrics. numpy only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from dflash_flow.items import BatchMeta

__all__ = [
    "BatchStats",
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


@attrs.define(eq=False)
class BatchStats:
    """Running counters over dispatched batches (one writer)."""

    batches: int = 0
    samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    max_seq_len: int = 0
    max_batch_size: int = 0
    per_bucket: dict[int, int] = attrs.field(factory=dict)
    _last_bucket: int = -1
    _run: int = 0
    max_run: int = 0

    def observe(self, meta: BatchMeta) -> None:
        self.batches += 1
        self.samples += meta.num_samples
        self.real_tokens += meta.real_tokens
        self.padded_tokens += meta.padded_tokens
        if meta.lengths:
            self.max_seq_len = max(self.max_seq_len, max(meta.lengths))
        self.max_batch_size = max(self.max_batch_size, meta.num_samples)
        self.per_bucket[meta.bucket] = self.per_bucket.get(meta.bucket, 0) + 1
        self._run = self._run + 1 if meta.bucket == self._last_bucket else 1
        self._last_bucket = meta.bucket
        self.max_run = max(self.max_run, self._run)

    @property
    def mean_seq_len(self) -> float:
        return self.real_tokens / self.samples if self.samples else 0.0

    @property
    def mean_batch_size(self) -> float:
        return self.samples / self.batches if self.batches else 0.0

    @property
    def padding_efficiency(self) -> float:
        return self.real_tokens / self.padded_tokens if self.padded_tokens else 1.0

    def as_dict(self) -> dict[str, float]:
        out: dict[str, float] = {
            "batches": self.batches,
            "samples": self.samples,
            "real_tokens": self.real_tokens,
            "padded_tokens": self.padded_tokens,
            "padding_efficiency": self.padding_efficiency,
            "seq_len_mean": self.mean_seq_len,
            "seq_len_max": self.max_seq_len,
            "batch_size_mean": self.mean_batch_size,
            "batch_size_max": self.max_batch_size,
            "max_same_bucket_run": self.max_run,
        }
        for b in sorted(self.per_bucket):
            out[f"bucket_{b}_batches"] = self.per_bucket[b]
        return out
