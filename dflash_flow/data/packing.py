"""Buckets, token-budget packing and step ordering: PlanConfig, the epoch's generators, bucket boundaries,
pack_bucket, and the run-capped, diversity-first interleaving of bucket ids (``interleave_buckets``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from dflash_flow.core.stage import cfg

__all__ = ["PackedEpoch", "PlanConfig", "assign_buckets", "bucket_boundaries", "epoch_rng", "interleave_buckets",
           "min_feasible_run", "pack_bucket", "padded_lengths", "plan_field"]


def epoch_rng(seed: int, epoch: int, *salt: int) -> np.random.Generator:
    """A generator determined by (run seed, epoch, salt), independent across salts."""
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed and epoch must be >= 0, got seed={seed}, epoch={epoch}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([int(seed), int(epoch), *map(int, salt)])))


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
        default=None, converter=lambda v: None if v is None else tuple(v), validator=_boundaries_ok,
        metadata={"config": True, "doc": "Inclusive upper bounds of the buckets but the last, e.g. [512, 1024, "
                  "2048] gives 4 buckets; null: quantile boundaries."})
    num_buckets: int = cfg(6, ge=1, doc="Quantile buckets when boundaries is null (fewer when lengths repeat).")
    max_run: int = cfg(3, ge=1, doc="Hard cap on consecutive batches from one bucket (when the mix allows).")
    length_jitter: float = cfg(0.02, ge=0, le=1, doc="Relative jitter of the packing order: varies batches per epoch "
                               "(0: strictly by length).")
    repeat_penalty: float = cfg(0.5, gt=0, le=1, doc="Weight factor for repeating the previous bucket.")
    evenness: float = cfg(3.0, ge=0, le=100, doc="How strongly the bucket furthest behind its share is preferred.")


def plan_field(name: str) -> Any:
    """A stage config field that is ``PlanConfig.<name>``: same default, validator and doc."""
    f = attrs.fields_dict(PlanConfig)[name]
    return attrs.field(default=f.default, validator=f.validator, metadata=dict(f.metadata), kw_only=True)


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
    cuts = np.unique(np.quantile(lengths, qs, method="inverted_cdf").astype(np.int64))
    # A boundary at the maximum would leave the last bucket empty.
    return cuts[cuts < lengths.max()]


def assign_buckets(lengths: Sequence[int] | np.ndarray, boundaries: np.ndarray) -> np.ndarray:
    """Bucket id per length: the first bucket whose upper bound is >= the length."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), np.asarray(lengths, dtype=np.int64), side="left")


def pack_bucket(indices: np.ndarray, padded: np.ndarray, *, max_tokens: int, max_batch_size: int | None,
                rng: np.random.Generator, length_jitter: float) -> list[np.ndarray]:
    """Pack one bucket's samples (positions ``indices``, padded lengths ``padded``) into batches under the
    padded-token budget; index arrays in packing order (short to long)."""
    n = indices.size
    if n == 0:
        return []
    # Jitter in log space: neighbours differ by at most ~length_jitter relative length, so padding stays
    # bounded while the cut points between batches move every epoch.
    key = np.log(padded.astype(np.float64))
    key = key + rng.uniform(0.0, length_jitter or 1e-9, size=n)  # 0: random order among equal lengths only
    order = np.argsort(key, kind="stable")
    idx = indices[order]
    lens = padded[order]

    too_long = lens > max_tokens
    if too_long.any():
        j = int(np.flatnonzero(too_long)[0])
        raise ValueError(f"sample at position {int(idx[j])} has padded length {int(lens[j])} > max_tokens={max_tokens}: "
                         "raise max_tokens or lower the sources' max_length")

    # Starting the first batch at a random fraction of its capacity shifts all later cut points too,
    # which varies composition even where lengths leave no room for jitter (e.g. one long tail bucket).
    batches: list[np.ndarray] = []
    cap_limit = max_batch_size or n
    start = 0
    min_len = int(lens.min())
    while start < n:
        width = min(n - start, cap_limit, max_tokens // max(min_len, 1))
        cost = np.maximum.accumulate(lens[start : start + width]) * np.arange(1, width + 1, dtype=np.int64)
        # cost is non-decreasing, so the fitting prefix is found by bisection.
        take = max(int(np.searchsorted(cost, max_tokens, side="right")), 1)
        if start == 0 and take > 1:
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


_DEFAULTS = PlanConfig()

log = logging.getLogger(__name__)

_warned: set[tuple] = set()  # plans are rebuilt every epoch (and on every rank): one warning per situation


def min_feasible_run(counts: Sequence[int] | np.ndarray) -> int:
    """The smallest cap on same-bucket runs that any order of these batch counts can meet."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return 1
    top = int(counts.max())
    return max(1, math.ceil(top / (total - top + 1)))


def _run_cap_ok(rem: list[int], total: int, last: int, run: int, cap: int) -> bool:
    """Whether ``rem`` (batches left per bucket) can follow a run of ``run`` of bucket ``last`` with no run
    over ``cap``: ``rem[b] * (cap + 1) <= cap * (total + 1) - run * [b == last]`` for every b, necessary and
    (tested exhaustively) sufficient: the interleaver looks one step ahead."""
    limit = cap * (total + 1)
    return all(r * (cap + 1) <= limit - (run if b == last else 0) for b, r in enumerate(rem))


def _effective_cap(counts: list[int], max_run: int) -> int:
    """``max_run``, or the smallest feasible cap when the largest bucket's share needs longer runs (said once)."""
    best = min_feasible_run(counts)
    if best <= max_run:
        return max_run
    total, top = sum(counts), max(counts)
    key = (max_run, tuple(sorted(counts)))
    if key not in _warned:
        _warned.add(key)
        log.warning(f"run cap max_run={max_run} cannot hold: the largest bucket has {top} of {total} batches "
                    f"({top / total:.1%} > {max_run / (max_run + 1):.1%}); ordering with the smallest feasible cap "
                    f"{best} instead")
    return best


def interleave_buckets(counts: Sequence[int] | np.ndarray, *, max_run: int, rng: np.random.Generator,
                       repeat_penalty: float = _DEFAULTS.repeat_penalty,
                       evenness: float = _DEFAULTS.evenness) -> tuple[np.ndarray, int]:
    """Order ``counts[b]`` batches of each bucket b: (bucket id per position, effective cap), the cap being
    ``max_run`` when the mix allows it, else the smallest feasible one (a warning is logged once)."""
    counts = [int(c) for c in counts]
    if any(c < 0 for c in counts):
        raise ValueError(f"negative batch count in {counts}")
    total = sum(counts)
    n_buckets = len(counts)
    cap = _effective_cap(counts, max_run)
    if total == 0:
        return np.zeros(0, dtype=np.int64), cap

    share = [c / total for c in counts]
    rem = list(counts)
    emitted = [0] * n_buckets
    out = np.empty(total, dtype=np.int64)
    u = rng.random(total)
    last, run = -1, 0
    left = total
    exp = math.exp
    for t in range(total):
        # _run_cap_ok for "choose b next", in O(1) per candidate: after the choice only b carries a run,
        # so every other bucket faces the same limit and only the largest of them matters.
        top1 = top2 = -1
        top1_b = -1
        for b in range(n_buckets):
            r = rem[b]
            if r > top1:
                top2, top1, top1_b = top1, r, b
            elif r > top2:
                top2 = r
        limit = cap * left  # cap * ((left - 1) + 1)
        cand: list[int] = []
        weights: list[float] = []
        for b in range(n_buckets):
            if rem[b] == 0:
                continue
            nrun = run + 1 if b == last else 1
            if nrun > cap:
                continue
            other = top2 if b == top1_b else top1
            if other * (cap + 1) > limit or (rem[b] - 1) * (cap + 1) > limit - nrun:
                continue
            # Deficit: how far bucket b is behind an even spread of its share over the epoch.
            deficit = share[b] * (t + 1) - emitted[b]
            w = exp(evenness * min(deficit, 20.0))
            if b == last:
                w *= repeat_penalty
            cand.append(b)
            weights.append(w)
        if not cand:  # unreachable while _run_cap_ok is exact; kept as a loud guard
            raise RuntimeError(f"interleaver dead end at step {t} with remaining {rem}, cap {cap}")
        # Inverse-CDF draw from one pre-drawn uniform per step keeps the rng stream independent of
        # how many candidates each step had.
        x = u[t] * sum(weights)
        pick = cand[-1]
        acc = 0.0
        for b, w in zip(cand, weights, strict=False):
            acc += w
            if x < acc:
                pick = b
                break
        out[t] = pick
        rem[pick] -= 1
        emitted[pick] += 1
        left -= 1
        run = run + 1 if pick == last else 1
        last = pick
    return out, cap
