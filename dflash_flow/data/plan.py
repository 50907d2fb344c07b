"""The epoch batch plan: BatchPlanner, over packing (buckets, packing, run cap) and epoch (ranks, resume); and
the batch-quality figures (padding efficiency, same-bucket runs, window mix) the benchmarks and tests read.

A pure function of (sample lengths, `PlanConfig`, run seed, epoch), numpy only: every rank builds the same
global plan and takes its share (`EpochPlan.rank_positions`); a resume rebuilds it and skips what was consumed.

1. Buckets: lengths grouped by upper boundaries (explicit, or quantiles of the data, so ids are stable).
2. Packing (fairseq style): each bucket's samples ordered by a length key jittered per epoch, packed greedily
   under ``max_tokens`` padded tokens and ``max_batch_size``; the first batch takes a random share of its
   capacity, which moves every later cut point.
3. Interleaving: bucket ids drawn step by step, weighted towards the buckets furthest behind their share,
   penalising a repeat, among the choices after which the rest can still be ordered within ``max_run``
   (``packing._run_cap_ok``); with ``world_size > 1``, global steps of one batch per rank."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs
import numpy as np

from dflash_flow.items import BatchMeta

from .epoch import EpochPlan, order_packed
from .packing import (
    PackedEpoch,
    PlanConfig,
    assign_buckets,
    bucket_boundaries,
    epoch_rng,
    pack_bucket,
    padded_lengths,
)

__all__ = ["BatchPlanner", "max_same_bucket_run", "padding_efficiency", "window_mix_max_deviation"]

# Salts that keep the generators of the plan's steps independent of each other (data.epoch has the others).
_SALT_PACK = 0x5041434B
_SALT_SHUFFLE = 0x53485546


@attrs.define(eq=False)
class BatchPlanner:
    """Plans epochs for a fixed set of samples: ``BatchPlanner(lengths, config, seed).plan(epoch)``."""

    lengths: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64))
    config: PlanConfig = attrs.field(factory=PlanConfig)
    seed: int = 0
    sample_ids: np.ndarray | None = attrs.field(default=None,
                                                converter=lambda v: None if v is None else np.asarray(v, dtype=np.int64))
    boundaries: np.ndarray = attrs.field(init=False)
    bucket_of: np.ndarray = attrs.field(init=False)
    _padded: np.ndarray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.lengths.ndim != 1:
            raise ValueError("lengths must be one-dimensional")
        if self.lengths.size and self.lengths.min() < 1:
            raise ValueError(f"sample lengths must be >= 1, found {int(self.lengths.min())}")
        if self.sample_ids is None:
            self.sample_ids = np.arange(self.lengths.size, dtype=np.int64)
        elif self.sample_ids.shape != self.lengths.shape:
            raise ValueError("sample_ids and lengths must have the same length")
        self.boundaries = bucket_boundaries(self.lengths, self.config)
        self.bucket_of = assign_buckets(self.lengths, self.boundaries)
        self._padded = padded_lengths(self.lengths, self.config.pad_to_multiple)

    @property
    def num_buckets(self) -> int:
        return int(self.boundaries.size) + 1

    def pack(self, epoch: int) -> PackedEpoch:
        """The epoch's batches per bucket (the Bucketer's half of the plan), not yet interleaved."""
        cfg = self.config
        pack_rng = epoch_rng(self.seed, epoch, _SALT_PACK)
        shuffle_rng = epoch_rng(self.seed, epoch, _SALT_SHUFFLE)
        per_bucket: list[list[np.ndarray]] = []
        # One stable sort groups positions by bucket instead of one mask pass per bucket.
        by_bucket = np.argsort(self.bucket_of, kind="stable")
        cuts = np.searchsorted(self.bucket_of[by_bucket], np.arange(self.num_buckets + 1), side="left")
        for b in range(self.num_buckets):
            idx = by_bucket[cuts[b] : cuts[b + 1]]
            batches = pack_bucket(idx, self._padded[idx], max_tokens=cfg.max_tokens, max_batch_size=cfg.max_batch_size,
                                  rng=pack_rng, length_jitter=cfg.length_jitter)
            # Packing runs short to long; draw each bucket's batches in random order so lengths do not
            # drift monotonically through the epoch.
            perm = shuffle_rng.permutation(len(batches))
            per_bucket.append([batches[i] for i in perm])
        return PackedEpoch(epoch=epoch, seed=self.seed, per_bucket=per_bucket, lengths=self.lengths, padded=self._padded,
                           sample_ids=self.sample_ids, boundaries=self.boundaries)

    def plan(self, epoch: int, world_size: int = 1) -> EpochPlan:
        """The epoch's plan: `pack` then `order_packed` with this planner's interleaving settings."""
        cfg = self.config
        return order_packed(self.pack(epoch), max_run=cfg.max_run, repeat_penalty=cfg.repeat_penalty,
                            evenness=cfg.evenness, world_size=world_size)


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
