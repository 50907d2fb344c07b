"""The epoch batch plan: BatchPlanner, over packing (buckets), interleave (run cap) and epoch (ranks, resume).

The plan for an epoch is a pure function of (sample lengths, `PlanConfig`, run seed, epoch). Every rank
builds the same global plan and takes its share of it (`EpochPlan.rank_positions`); resuming means
rebuilding the plan and skipping the batches already consumed. numpy only: no torch here.

Three steps:

1. Buckets. Lengths are grouped by upper boundaries (explicit, or quantiles of the data). The
   boundaries depend on the data and the config only, never on the epoch, so bucket ids are stable.
2. Packing (fairseq style). Inside each bucket the samples are ordered by a jittered length key (the
   jitter is seeded by run seed and epoch, so batch composition changes every epoch while neighbours
   stay close in length), then packed greedily: a batch is charged ``n * padded_max_len`` tokens
   (padded, not real, tokens) and may not exceed ``max_tokens`` nor ``max_batch_size``. The first batch
   of a bucket takes a random share of its capacity, which moves every later cut point as well.
3. Interleaving. The sequence of bucket ids is drawn step by step, weighted towards the buckets that are
   furthest behind their share of the epoch so far, with a penalty for repeating the last bucket.
   Candidates are restricted to choices after which the rest of the epoch can still be ordered
   without a run longer than ``max_run`` (an exact feasibility test, see `_run_cap_ok`), so the cap
   holds to the very last batch instead of breaking when the small buckets run out. With
   ``world_size > 1`` each rank's strided share is ordered this way instead, since a rank consumes
   every W-th batch of the global order and would otherwise see long runs.
"""
from __future__ import annotations

import attrs
import numpy as np

from .epoch import FILLER, MAX_POSITION, EpochPlan, order_packed, plan_state_problem, resume_plan
from .interleave import interleave_buckets, min_feasible_run
from .packing import (
    PackedEpoch,
    PlanConfig,
    assign_buckets,
    bucket_boundaries,
    epoch_rng,
    pack_bucket,
    padded_lengths,
    plan_field,
)

# The plan's names keep this module as their documented home; each is defined in the module named above.
__all__ = [
    "FILLER",
    "MAX_POSITION",
    "BatchPlanner",
    "EpochPlan",
    "PackedEpoch",
    "PlanConfig",
    "assign_buckets",
    "bucket_boundaries",
    "epoch_rng",
    "interleave_buckets",
    "min_feasible_run",
    "order_packed",
    "pack_bucket",
    "padded_lengths",
    "plan_field",
    "plan_state_problem",
    "resume_plan",
]

# Salts that keep the generators of the plan's steps independent of each other (data.epoch has the others).
_SALT_PACK = 0x5041434B
_SALT_SHUFFLE = 0x53485546


@attrs.define(eq=False)
class BatchPlanner:
    """Plans epochs for a fixed set of samples: ``BatchPlanner(lengths, config, seed).plan(epoch)``."""

    lengths: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64))
    config: PlanConfig = attrs.field(factory=PlanConfig)
    seed: int = 0
    sample_ids: np.ndarray | None = attrs.field(
        default=None, converter=lambda v: None if v is None else np.asarray(v, dtype=np.int64)
    )
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
            batches = pack_bucket(
                idx,
                self._padded[idx],
                max_tokens=cfg.max_tokens,
                max_batch_size=cfg.max_batch_size,
                rng=pack_rng,
                length_jitter=cfg.length_jitter,
            )
            # Packing runs short to long; draw each bucket's batches in random order so lengths do not
            # drift monotonically through the epoch.
            perm = shuffle_rng.permutation(len(batches))
            per_bucket.append([batches[i] for i in perm])
        return PackedEpoch(
            epoch=epoch,
            seed=self.seed,
            per_bucket=per_bucket,
            lengths=self.lengths,
            padded=self._padded,
            sample_ids=self.sample_ids,
            boundaries=self.boundaries,
        )

    def plan(self, epoch: int, world_size: int = 1) -> EpochPlan:
        """The epoch's plan: `pack` then `order_packed` with this planner's interleaving settings."""
        cfg = self.config
        return order_packed(
            self.pack(epoch),
            max_run=cfg.max_run,
            repeat_penalty=cfg.repeat_penalty,
            evenness=cfg.evenness,
            world_size=world_size,
        )
