"""Step ordering: the run-capped, diversity-first interleaving of bucket ids (``interleave_buckets``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

import numpy as np

from .packing import PlanConfig

__all__ = ["interleave_buckets", "min_feasible_run"]

log = logging.getLogger(__name__)

_DEFAULTS = PlanConfig()

_warned: set[tuple] = set()


def _warn_once(key: tuple, message: str) -> None:
    # Plans are rebuilt every epoch (and on every rank); one warning per distinct situation is enough.
    if key not in _warned:
        _warned.add(key)
        log.warning(message)


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


def _effective_cap(counts: list[int], max_run: int) -> int:
    """``max_run``, or the smallest feasible cap when the largest bucket's share needs longer runs (said once)."""
    best = min_feasible_run(counts)
    if best <= max_run:
        return max_run
    total, top = sum(counts), max(counts)
    _warn_once(
        ("run-cap", max_run, tuple(sorted(counts))),
        f"run cap max_run={max_run} cannot hold: the largest bucket has {top} of {total} batches "
        f"({top / total:.1%} > {max_run / (max_run + 1):.1%}); ordering with the smallest feasible cap "
        f"{best} instead",
    )
    return best


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
