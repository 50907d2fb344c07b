"""The epoch batch plan: length buckets, token-budget packing, diversity-first interleaving.

The plan for an epoch is a pure function of (sample lengths, `PlanConfig`, run seed, epoch). Every rank
builds the same global plan and takes its share of it (`EpochPlan.batches_for_rank`); resuming means
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

import hashlib
import logging
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import attrs
import numpy as np

from dflash_flow.core.stage import cfg
from dflash_flow.items import BatchMeta

__all__ = [
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
]

log = logging.getLogger(__name__)

# Salts that keep the generators of the plan's steps independent of each other.
_SALT_PACK = 0x5041434B
_SALT_SHUFFLE = 0x53485546
_SALT_INTERLEAVE = 0x494E5452
_SALT_REDEAL = 0x5245444C

_warned: set[tuple] = set()


def _warn_once(key: tuple, message: str) -> None:
    # Plans are rebuilt every epoch (and on every rank); one warning per distinct situation is enough.
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


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


_DEFAULTS = PlanConfig()


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


# --------------------------------------------------------------------------------------------------
# interleaving


def min_feasible_run(counts: Sequence[int] | np.ndarray) -> int:
    """The smallest cap on same-bucket runs that any order of these batch counts can meet."""
    counts = np.asarray(counts, dtype=np.int64)
    total = int(counts.sum())
    if total == 0:
        return 1
    top = int(counts.max())
    return max(1, math.ceil(top / (total - top + 1)))


def _run_cap_ok(rem: list[int], total: int, last: int, run: int, cap: int) -> bool:
    """Whether ``rem`` (batches left per bucket, ``total`` of them) can follow a run of ``run`` batches
    of bucket ``last`` without any run longer than ``cap``.

    Bucket b's remaining batches fall into at most ``total - rem[b] + 1`` groups separated by other
    batches; each group holds at most ``cap``, and the group that continues the current run (when b is
    ``last``) only ``cap - run``. So it is necessary that for every b:
    ``rem[b] * (cap + 1) <= cap * (total + 1) - run * [b == last]``. It is also sufficient (the tests
    check this against exhaustive search), which lets the interleaver keep the cap by looking one step
    ahead (`interleave_buckets` evaluates the same inequalities incrementally).
    """
    limit = cap * (total + 1)
    for b, r in enumerate(rem):
        if r * (cap + 1) > limit - (run if b == last else 0):
            return False
    return True


def interleave_buckets(
    counts: Sequence[int] | np.ndarray,
    *,
    max_run: int,
    rng: np.random.Generator,
    repeat_penalty: float = _DEFAULTS.repeat_penalty,
    evenness: float = _DEFAULTS.evenness,
) -> tuple[np.ndarray, int]:
    """Order ``counts[b]`` batches of each bucket b; returns (bucket id per position, effective cap).

    The effective cap is ``max_run`` when the mix allows it (largest share <= max_run/(max_run+1)),
    otherwise the smallest feasible cap (a warning is logged once).
    """
    counts = [int(c) for c in counts]
    if any(c < 0 for c in counts):
        raise ValueError(f"negative batch count in {counts}")
    total = sum(counts)
    n_buckets = len(counts)
    best = min_feasible_run(counts)
    cap = max_run
    if best > max_run:
        cap = best
        top = max(counts)
        _warn_once(
            ("run-cap", max_run, tuple(sorted(counts))),
            f"run cap max_run={max_run} cannot hold: the largest bucket has {top} of {total} batches "
            f"({top / total:.1%} > {max_run / (max_run + 1):.1%}); ordering with the smallest feasible cap "
            f"{cap} instead",
        )
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


# --------------------------------------------------------------------------------------------------
# the plan


FILLER = -1  # the position of a filler batch in a rank's schedule


@attrs.define(eq=False)
class EpochPlan:
    """The ordered batches of one epoch. Positions are global (all ranks together).

    ``order[offsets[i]:offsets[i+1]]`` are the sample positions (indices into the planner's lengths) of
    batch ``i``; ``sample_ids`` maps a position to the sample's id. With ``world_size`` W, global step s is
    positions ``s*W .. s*W+W-1`` (rank r takes ``s*W + r``); a last step with fewer batches than ranks
    gives the short ranks filler batches (``FILLER``), which train nothing. ``chain`` records the
    segments of the epoch consumed before this plan was re-dealt (``redeal``): ``((W0, p0), ...)``.
    """

    epoch: int
    seed: int
    order: np.ndarray
    offsets: np.ndarray
    buckets: np.ndarray
    padded_lens: np.ndarray
    lengths: np.ndarray
    sample_ids: np.ndarray
    boundaries: np.ndarray
    max_run: int  # the cap that was enforced (on consecutive global steps of one bucket)
    run_cap_feasible: bool  # False when the configured cap was impossible for this bucket mix
    world_size: int = 1  # the world size the order was made for
    padded: np.ndarray | None = None  # padded length of every sample (for re-dealing)
    chain: tuple[tuple[int, int], ...] = ()
    interleave: tuple[int, float, float] = (3, 0.5, 3.0)  # max_run, repeat_penalty, evenness
    _fingerprint: str | None = attrs.field(default=None, init=False, repr=False)
    _longest: int | None = attrs.field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return int(self.buckets.size)

    @property
    def num_buckets(self) -> int:
        return int(self.boundaries.size) + 1

    @property
    def steps(self) -> int:
        """Global steps of this plan (every rank takes this many batches, fillers included)."""
        return -(-len(self) // self.world_size)

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """The sample lengths bucket ``bucket`` holds, ``(shortest, longest)``: above the previous boundary
        up to its own (``assign_buckets``); the last bucket up to the longest sample of the plan."""
        lo = int(self.boundaries[bucket - 1]) + 1 if bucket > 0 else 1
        if bucket < self.boundaries.size:
            return lo, max(lo, int(self.boundaries[bucket]))
        if self._longest is None:
            self._longest = int(self.lengths.max(initial=lo))
        return lo, max(lo, self._longest)

    def batch(self, position: int) -> np.ndarray:
        """Sample positions of the batch at ``position``."""
        if not 0 <= position < len(self):
            raise IndexError(f"batch position {position} outside the epoch's {len(self)} batches")
        return self.order[self.offsets[position] : self.offsets[position + 1]]

    def meta(self, position: int) -> BatchMeta:
        """What the batch at ``position`` is (``FILLER``: a filler batch with no samples)."""
        if position == FILLER:
            return BatchMeta(epoch=self.epoch, index=FILLER, bucket=-1, lengths=[], real_tokens=0, padded_tokens=0,
                             num_samples=0, filler=True)
        idx = self.batch(position)
        lens = self.lengths[idx]
        padded_len = int(self.padded_lens[position])
        bucket = int(self.buckets[position])
        return BatchMeta(
            epoch=self.epoch,
            index=position,
            bucket=bucket,
            bucket_range=self.bucket_range(bucket),
            lengths=lens.tolist(),
            real_tokens=int(lens.sum()),
            padded_tokens=padded_len * int(idx.size),
            num_samples=int(idx.size),
            sample_ids=self.sample_ids[idx].tolist(),
            padded_len=padded_len,
        )

    def metas(self, start: int = 0) -> Iterator[BatchMeta]:
        """Batches from global position ``start`` on: resuming mid-epoch is ``plan.metas(consumed)``."""
        if not 0 <= start <= len(self):
            raise ValueError(f"resume position {start} outside 0..{len(self)}")
        for p in range(start, len(self)):
            yield self.meta(p)

    resume = metas

    def rank_positions(
        self, rank: int, world_size: int | None = None, *, start: int = 0, tail: Literal["filler", "drop"] = "filler"
    ) -> np.ndarray:
        """Global positions that ``rank`` consumes, step by step, from global position ``start`` on.

        At step s rank r takes position ``start + s*W + r``; every rank takes the same number of steps,
        so collectives never wait on a rank that ran out. ``tail="filler"`` (default) gives the short
        ranks of the last step ``FILLER`` entries (batches that train nothing); ``tail="drop"`` leaves the
        last partial step out. ``start`` is counted in global batches and must be a step boundary.
        """
        world_size = self.world_size if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if tail not in ("filler", "drop"):
            raise ValueError(f"tail must be 'filler' or 'drop', got {tail!r}")
        n = len(self)
        if not 0 <= start <= n:
            raise ValueError(f"start position {start} outside 0..{n}")
        left = n - start
        steps = -(-left // world_size) if tail == "filler" else left // world_size
        pos = start + rank + world_size * np.arange(steps, dtype=np.int64)
        return np.where(pos < n, pos, FILLER)

    def batches_for_rank(
        self, rank: int, world_size: int | None = None, *, start: int = 0, tail: Literal["filler", "drop"] = "filler"
    ) -> list[BatchMeta]:
        """This rank's share of the epoch as `BatchMeta` (see `rank_positions`)."""
        return [self.meta(int(p)) for p in self.rank_positions(rank, world_size, start=start, tail=tail)]

    def redeal(self, start: int, world_size: int) -> EpochPlan:
        """The rest of the epoch, from global position ``start`` on, ordered into global steps of
        ``world_size`` (an elastic resume: the batches not yet trained, each exactly once, for the new
        number of ranks). The result's ``chain`` records this plan's segment."""
        if not 0 <= start <= len(self):
            raise ValueError(f"re-deal position {start} outside 0..{len(self)}")
        if self.padded is None:
            raise ValueError("this plan cannot be re-dealt (it carries no padded lengths)")
        rest = list(range(start, len(self)))
        batches = [self.batch(p) for p in rest]
        labels = self.buckets[start:]
        max_run, repeat_penalty, evenness = self.interleave
        if world_size == 1 or not rest:
            perm, cap = np.arange(len(rest), dtype=np.int64), self.max_run
        else:
            rng = epoch_rng(self.seed, self.epoch, _SALT_REDEAL, len(self.chain), start, world_size)
            perm, cap = _step_groups(labels, world_size, rng, max_run=max_run, repeat_penalty=repeat_penalty,
                                     evenness=evenness)
        plan = _plan_from_batches(
            batches, labels, perm, like=self, epoch=self.epoch, seed=self.seed, cap=cap, max_run=max_run,
            world_size=world_size, chain=(*self.chain, (self.world_size, int(start))),
        )
        plan.interleave = self.interleave
        return plan

    def fingerprint(self) -> str:
        """Hash of the plan's content: equal plans on every rank and across resumes, or a bug. Computed
        once per plan (a plan is not changed after it is made; every batch's state carries it)."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.blake2b(digest_size=16)
        for arr in (self.order, self.offsets, self.buckets, self.padded_lens, self.sample_ids):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        h.update(f"{self.epoch}|{self.seed}|{self.world_size}|{list(self.chain)}".encode())
        self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self, position: int) -> dict:
        """Resume state after ``position`` global batches of this plan were consumed."""
        return {
            "version": 2,
            "epoch": self.epoch,
            "chain": [list(c) for c in self.chain] + [[self.world_size, int(position)]],
            "fingerprint": self.fingerprint(),
        }

    def check_state(self, state: dict) -> int:
        """Validate a `state_dict` of this very plan; returns the position to resume from."""
        if state.get("version") != 2:
            raise ValueError(f"unsupported plan state version {state.get('version')!r}")
        if state.get("epoch") != self.epoch:
            raise ValueError(f"plan state is for epoch {state.get('epoch')}, this plan is epoch {self.epoch}")
        chain = [tuple(c) for c in state.get("chain") or [(self.world_size, 0)]]
        if tuple(chain[:-1]) != self.chain or chain[-1][0] != self.world_size:
            raise ValueError(
                f"plan state belongs to a plan dealt as {chain}, this one is {[*self.chain, (self.world_size, '?')]}: "
                "rebuild it with resume_plan()"
            )
        fp = state.get("fingerprint")
        if fp is not None and fp != self.fingerprint():
            raise ValueError(
                "the rebuilt epoch plan differs from the one the checkpoint was taken from "
                "(data, plan config or seed changed); resuming would repeat or skip samples"
            )
        pos = int(chain[-1][1])
        if not 0 <= pos <= len(self):
            raise ValueError(f"plan state position {pos} outside 0..{len(self)}")
        return pos


MAX_POSITION = 2**53  # no real plan holds more batches (or epochs, or ranks) than this


def plan_state_problem(state: object) -> str | None:
    """What is wrong with the shape of an ``EpochPlan.state_dict`` read back from a file (None: nothing):
    the types and ranges ``resume_plan`` relies on, checked before anything is rebuilt from it. Whether it
    fits the rebuilt plan (its fingerprint) is ``check_state``'s question."""
    def count(v: object, lo: int = 0) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_POSITION

    if not isinstance(state, dict):
        return f"must be an object, got {type(state).__name__}"
    if state.get("version") != 2:
        return f"plan state version {state.get('version')!r:.40} is not supported (2 is)"
    if not count(state.get("epoch")):
        return f"'epoch' must be a non-negative integer, got {state.get('epoch')!r:.40}"
    chain = state.get("chain")
    if chain is not None:
        if not isinstance(chain, list) or not chain:
            return f"'chain' must be a non-empty list of [ranks, position] pairs, got {chain!r:.60}"
        for seg in chain:
            if not (isinstance(seg, list) and len(seg) == 2 and count(seg[0], 1) and count(seg[1])):
                return f"'chain' must hold [ranks >= 1, position >= 0] pairs of integers, got {seg!r:.60}"
    fp = state.get("fingerprint")
    if fp is not None and not isinstance(fp, str):
        return f"'fingerprint' must be a string, got {type(fp).__name__}"
    return None


def resume_plan(base: EpochPlan, state: dict, world_size: int) -> tuple[EpochPlan, int]:
    """The plan to continue an epoch with ``world_size`` ranks, and the global position to start from.

    ``base`` is the epoch's plan for the world size it started with; ``state`` is an `EpochPlan.state_dict`
    of the plan the checkpointed run was consuming: its ``chain`` lists the segments consumed so far,
    ``[[W0, p0], [W1, p1], ...]`` (a world size and the global batches consumed of that segment's plan),
    and its fingerprint must match the rebuilt segment (same data, config and seed). Every segment but
    the last was re-dealt at its position; the last continues as is when ``world_size`` equals its own,
    else it is re-dealt too. So a run may change its number of ranks any number of times and still
    trains every batch of the epoch exactly once.
    """
    chain = [(int(w), int(p)) for w, p in state.get("chain") or []] or [(base.world_size, 0)]
    if chain[0][0] != base.world_size:
        raise ValueError(f"the epoch started with {chain[0][0]} ranks but the base plan is for {base.world_size}")
    plan = base
    for (_w, p), (w_next, _p) in zip(chain[:-1], chain[1:], strict=True):
        plan = plan.redeal(p, w_next)
    position = plan.check_state({**state, "version": 2, "epoch": plan.epoch, "chain": [list(c) for c in chain]})
    if plan.world_size == world_size:
        return plan, position
    return plan.redeal(position, world_size), 0


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


def _step_groups(
    labels: np.ndarray,
    world_size: int,
    rng: np.random.Generator,
    *,
    max_run: int,
    repeat_penalty: float,
    evenness: float,
) -> tuple[np.ndarray, int]:
    """Order items (batches, whose buckets are ``labels``) into global steps of ``world_size``.

    A global step is the batches the ranks train on together; it waits for its slowest rank, so its
    batches should have similar lengths. Each bucket's batches are cut into groups of ``world_size``
    (one step each, one bucket); what is left of each bucket is pooled in bucket order (neighbouring
    buckets have neighbouring lengths) and cut into mixed steps. Steps are then interleaved with the run
    cap on consecutive steps of one bucket, the partial step (fewer batches than ranks: the short ranks
    get filler batches) last. Returns (item indices in plan order, the enforced cap).
    """
    w = world_size
    groups: list[tuple[int, list[int]]] = []
    leftovers: list[int] = []
    for b in range(int(labels.max()) + 1 if labels.size else 0):
        items = np.flatnonzero(labels == b).tolist()
        full = len(items) // w
        groups += [(b, items[g * w : (g + 1) * w]) for g in range(full)]
        leftovers += items[full * w :]
    partial: list[int] = []
    for j in range(0, len(leftovers), w):
        chunk = leftovers[j : j + w]
        if len(chunk) == w:
            groups.append((int(labels[chunk[0]]), chunk))
        else:
            partial = chunk
    n_labels = int(labels.max()) + 1 if labels.size else 0
    counts = [0] * n_labels
    queues: list[list[list[int]]] = [[] for _ in range(n_labels)]
    for label, members in groups:
        counts[label] += 1
        queues[label].append(members)
    seq, cap = interleave_buckets(
        counts, max_run=max_run, rng=rng, repeat_penalty=repeat_penalty, evenness=evenness
    )
    cursor = [0] * n_labels
    order: list[int] = []
    for label in seq.tolist():
        order += queues[label][cursor[label]]
        cursor[label] += 1
    order += partial
    return np.asarray(order, dtype=np.int64), cap


def _plan_from_batches(
    batches: list[np.ndarray],
    buckets: np.ndarray,
    perm: np.ndarray,
    *,
    like: PackedEpoch | EpochPlan,
    epoch: int,
    seed: int,
    cap: int,
    max_run: int,
    world_size: int,
    chain: tuple[tuple[int, int], ...] = (),
) -> EpochPlan:
    ordered = [batches[i] for i in perm.tolist()]
    sizes = np.fromiter((a.size for a in ordered), dtype=np.int64, count=len(ordered))
    offsets = np.zeros(len(ordered) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    order = np.concatenate(ordered) if ordered else np.zeros(0, dtype=np.int64)
    padded = like.padded
    padded_max = np.maximum.reduceat(padded[order], offsets[:-1]) if ordered else np.zeros(0, dtype=np.int64)
    return EpochPlan(
        epoch=epoch,
        seed=seed,
        order=order,
        offsets=offsets,
        buckets=np.asarray(buckets, dtype=np.int64)[perm] if perm.size else np.zeros(0, dtype=np.int64),
        padded_lens=padded_max.astype(np.int64),
        lengths=like.lengths,
        sample_ids=like.sample_ids,
        boundaries=like.boundaries,
        max_run=cap,
        run_cap_feasible=cap == max_run,
        world_size=world_size,
        padded=padded,
        chain=chain,
    )


def order_packed(
    packed: PackedEpoch,
    *,
    max_run: int = _DEFAULTS.max_run,
    repeat_penalty: float = _DEFAULTS.repeat_penalty,
    evenness: float = _DEFAULTS.evenness,
    world_size: int = 1,
) -> EpochPlan:
    """Interleave a packed epoch into its `EpochPlan` (the Interleaver's half of the plan).

    With ``world_size`` ranks the plan is a sequence of global steps of ``world_size`` batches
    (``_step_groups``): rank r trains position ``s * world_size + r`` at step s. The batches are the same
    for every world size, their order is not; a resume with another world size re-deals the rest of the
    epoch (`EpochPlan.redeal`).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_run < 1:
        raise ValueError(f"max_run must be >= 1, got {max_run}")
    counts = packed.counts
    batches = [b for bucket in packed.per_bucket for b in bucket]
    buckets = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    if world_size == 1:
        seq, cap = interleave_buckets(
            counts,
            max_run=max_run,
            rng=epoch_rng(packed.seed, packed.epoch, _SALT_INTERLEAVE),
            repeat_penalty=repeat_penalty,
            evenness=evenness,
        )
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if counts else np.zeros(0, np.int64)
        cursor = [0] * len(counts)
        perm_list = []
        for b in seq.tolist():
            perm_list.append(int(starts[b]) + cursor[b])
            cursor[b] += 1
        perm = np.asarray(perm_list, dtype=np.int64)
    else:
        perm, cap = _step_groups(
            buckets,
            world_size,
            epoch_rng(packed.seed, packed.epoch, _SALT_INTERLEAVE, world_size),
            max_run=max_run,
            repeat_penalty=repeat_penalty,
            evenness=evenness,
        )
    plan = _plan_from_batches(
        batches, buckets, perm, like=packed, epoch=packed.epoch, seed=packed.seed, cap=cap, max_run=max_run,
        world_size=world_size,
    )
    plan.interleave = (max_run, repeat_penalty, evenness)
    return plan
