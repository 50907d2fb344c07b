"""Buckets and token-budget packing: PlanConfig, the epoch's generators, bucket boundaries, pack_bucket."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from dflash_flow.core.stage import cfg

__all__ = [
    "PackedEpoch",
    "PlanConfig",
    "assign_buckets",
    "bucket_boundaries",
    "epoch_rng",
    "pack_bucket",
    "padded_lengths",
    "plan_field",
]


def epoch_rng(seed: int, epoch: int, *salt: int) -> np.random.Generator:
    """A generator determined by (run seed, epoch, salt), independent across salts."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), *map(int, salt)]))
    )


def _boundaries_ok(_inst, _attr, value) -> None:
    if value is None:
        return
    vals = list(value)
    if any(not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1 for v in vals):
        raise ValueError(f"boundaries must be positive integers, got {vals}")
    if any(b <= a for a, b in zip(vals, vals[1:], strict=False)):
        raise ValueError(f"boundaries must be strictly increasing, got {vals}")


@attrs.define(frozen=True, kw_only=True)
class PlanConfig:
    """How an epoch is bucketed, packed and ordered. The Bucketer and Interleaver stages take their
    config fields from these (``plan_field``): defaults, bounds and docs live here only."""

    max_tokens: int = cfg(65536, ge=1, doc="Budget per batch in padded tokens (num_samples x padded length).")
    max_batch_size: int | None = cfg(None, ge=1, doc="Cap on samples per batch (null: budget only).")
    pad_to_multiple: int = cfg(1, ge=1, doc="Padded length is a multiple of this (give the Padder the same).")
    boundaries: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else tuple(v),
        validator=_boundaries_ok,
        metadata={"config": True, "doc": "Inclusive upper bounds of the buckets but the last, e.g. [512, 1024, "
                  "2048] gives 4 buckets; null: quantile boundaries."},
    )
    num_buckets: int = cfg(6, ge=1, doc="Quantile buckets when boundaries is null (fewer when lengths repeat).")
    max_run: int = cfg(3, ge=1, doc="Hard cap on consecutive batches from one bucket (when the mix allows).")
    length_jitter: float = cfg(
        0.02, ge=0, le=1, doc="Relative jitter of the packing order: varies batches per epoch (0: strictly by length)."
    )
    repeat_penalty: float = cfg(0.5, gt=0, le=1, doc="Weight factor for repeating the previous bucket.")
    evenness: float = cfg(3.0, ge=0, le=100, doc="How strongly the bucket furthest behind its share is preferred.")


def plan_field(name: str) -> Any:
    """A stage config field that is ``PlanConfig.<name>``: same default, validator and doc."""
    f = attrs.fields_dict(PlanConfig)[name]
    return attrs.field(default=f.default, validator=f.validator, metadata=dict(f.metadata), kw_only=True)


# --------------------------------------------------------------------------------------------------
# buckets


def padded_lengths(lengths: np.ndarray, pad_to_multiple: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if pad_to_multiple <= 1:
        return lengths
    return -(-lengths // pad_to_multiple) * pad_to_multiple


def bucket_boundaries(lengths: Sequence[int] | np.ndarray, config: PlanConfig) -> np.ndarray:
    """Inclusive upper bounds of all buckets but the last (bucket ids are 0..len(result))."""
    if config.boundaries is not None:
        return np.asarray(config.boundaries, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size == 0 or config.num_buckets == 1:
        return np.zeros(0, dtype=np.int64)
    qs = np.arange(1, config.num_buckets) / config.num_buckets
    # 'inverted_cdf' returns observed lengths, so a boundary is a real length and "<=" splits at it.
    cuts = np.quantile(lengths, qs, method="inverted_cdf").astype(np.int64)
    cuts = np.unique(cuts)
    # A boundary at the maximum would leave the last bucket empty.
    return cuts[cuts < lengths.max()]


def assign_buckets(lengths: Sequence[int] | np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Bucket id per length: the first bucket whose upper bound is >= the length."""
    return np.searchsorted(
        np.asarray(boundaries, dtype=np.int64), np.asarray(lengths, dtype=np.int64), side="left"
    )


# --------------------------------------------------------------------------------------------------
# packing


def pack_bucket(
    indices: np.ndarray,
    padded: np.ndarray,
    *,
    max_tokens: int,
    max_batch_size: int | None,
    rng: np.random.Generator,
    length_jitter: float,
) -> list[np.ndarray]:
    """Pack one bucket's samples into batches under the padded-token budget.

    ``indices`` are sample positions, ``padded`` their padded lengths (same order). Returns a list of
    index arrays in packing order (short to long).
    """
    n = indices.size
    if n == 0:
        return []
    # Jitter in log space: neighbours differ by at most ~length_jitter relative length, so padding stays
    # bounded while the cut points between batches move every epoch.
    key = np.log(padded.astype(np.float64))
    if length_jitter > 0:
        key = key + rng.uniform(0.0, length_jitter, size=n)
    else:
        key = key + rng.uniform(0.0, 1e-9, size=n)  # random order among equal lengths only
    order = np.argsort(key, kind="stable")
    idx = indices[order]
    lens = padded[order]

    too_long = lens > max_tokens
    if too_long.any():
        j = int(np.flatnonzero(too_long)[0])
        raise ValueError(
            f"sample at position {int(idx[j])} has padded length {int(lens[j])} > max_tokens={max_tokens}: "
            "raise max_tokens or lower the sources' max_length"
        )

    # Starting the first batch at a random fraction of its capacity shifts all later cut points too,
    # which varies composition even where lengths leave no room for jitter (e.g. one long tail bucket).
    batches: list[np.ndarray] = []
    cap_limit = max_batch_size or n
    start = 0
    first = True
    min_len = int(lens.min())
    while start < n:
        width = min(n - start, cap_limit, max_tokens // max(min_len, 1))
        window = lens[start : start + width]
        run_max = np.maximum.accumulate(window)
        cost = run_max * np.arange(1, width + 1, dtype=np.int64)
        # cost is non-decreasing, so the fitting prefix is found by bisection.
        take = int(np.searchsorted(cost, max_tokens, side="right"))
        take = max(take, 1)
        if first:
            first = False
            if take > 1:
                take = int(rng.integers(1, take + 1))
        batches.append(idx[start : start + take])
        start += take
    return batches


@attrs.define(eq=False)
class PackedEpoch:
    """One epoch's packed batches grouped by bucket, with what ordering them needs."""

    epoch: int
    seed: int
    per_bucket: list[list[np.ndarray]]  # sample positions of each batch, per bucket
    lengths: np.ndarray
    padded: np.ndarray
    sample_ids: np.ndarray
    boundaries: np.ndarray

    @property
    def counts(self) -> list[int]:
        return [len(bs) for bs in self.per_bucket]
