"""CPU contention in ``plan``'s model: the threads of the ranks on one machine share its cores. A profile
measures each replica thread's CPU seconds and its seconds waiting, runnable, for a core
(``ReplicaSnapshot.cpu_wait_s``); this module predicts that wait for another mix of replicas or ranks.

The model: ``C`` cores shared equally by the runnable threads, runnable independently. A thread of stage
``s`` runs ``c_s`` CPU-seconds per trained batch and is runnable ``rho = X (c_s + q_s) / r_s`` of the time
at ``X`` batches/s; with ``K`` others runnable it progresses at ``C / (K + 1)``, so per CPU-second it waits
``E[max(0, (K + 1) / C - 1)]`` (K Poisson-binomial over the other threads, other ranks' included). A
stage's work per batch is its measured work plus the change of its predicted wait from the profiled mix
to the asked one (what the model leaves out, another process's load, stays as measured). The process's
CPU that no replica thread ran counts as background threads. The GIL and correlated threads are left out.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

ITERATIONS = 4  # fixed-point passes for the waits at one rate (each wait raises the others' runnable time)
BISECTIONS = 40
TOLERANCE = 1e-4  # of the rate: where the bisection stops
MAX_CLASS = 256  # threads of one class the distribution counts one by one


@functools.lru_cache(maxsize=1024)
def _comb(n: int) -> np.ndarray:
    return np.array([math.comb(n, i) for i in range(n + 1)], dtype=np.float64)


def _binomial(n: int, p: float) -> np.ndarray:
    k = np.arange(n + 1)
    return _comb(n) * p**k * (1.0 - p) ** (n - k)


def wait_per_cpu_s(cores: float, others: Sequence[tuple[float, int]]) -> float:
    """Seconds a thread waits for a core per CPU-second it runs while ``count`` other threads of each
    ``(p, count)`` are each runnable with probability ``p``, independently, on ``cores`` cores shared
    equally: ``E[max(0, (K + 1) / cores - 1)]``, K the number of others runnable."""
    if sum(k for _, k in others) + 1 <= cores:
        return 0.0  # never more runnable threads than cores
    dist = np.ones(1)
    for p, count in others:
        if count > 0 and p > 0:
            dist = np.convolve(dist, _binomial(int(count), min(max(float(p), 0.0), 1.0)))
    k = np.arange(dist.size)
    return float(np.sum(dist * np.maximum(0.0, (k + 1) / cores - 1.0)))


def _capped(name: str, p: float, count: int) -> tuple[str, float, int]:
    """A class of more than ``MAX_CLASS`` threads as ``MAX_CLASS`` threads with the same runnable total
    (a binomial that wide is as good as its Poisson limit; e.g. the padders the planner sizes as unbounded)."""
    if count <= MAX_CLASS:
        return name, p, count
    return name, min(1.0, p * count / MAX_CLASS), MAX_CLASS


def _threads(profile: Any) -> dict[str, tuple[float, float]] | None:
    """Stage -> (CPU seconds, core-wait seconds) per trained batch, for the stages with threads that work
    (observers' sampling left out); None when the profile did not measure them."""
    active = {name: s for name, s in profile.stages.items() if not s.observer}
    if any(s.cpu_s_per_batch is None or s.cpu_wait_s_per_batch is None for s in active.values()):
        return None
    return {name: (s.cpu_s_per_batch, s.cpu_wait_s_per_batch) for name, s in active.items()}


def waits(profile: Any, replicas: Mapping[str, int], ranks: int, cores: float, rate: float,
          start: Mapping[str, float] | None = None) -> dict[str, float]:
    """Each stage's predicted core-wait seconds per trained batch at ``rate`` batches/s of each of ``ranks``
    ranks with ``replicas`` (stage -> count; the profiled count for stages not named)."""
    threads = _threads(profile) or {}
    counts = {n: max(1, int(replicas.get(n, profile.stages[n].replicas))) for n in threads}
    background = (0.0 if profile.cpu_s_per_batch is None else
                  max(0.0, profile.cpu_s_per_batch - sum(c for c, _ in threads.values())))
    q = {n: float((start or {}).get(n, w)) for n, (_, w) in threads.items()}
    for _ in range(ITERATIONS):
        rho = {n: min(1.0, rate * (c + q[n]) / counts[n]) for n, (c, _) in threads.items()}
        busy_bg = rate * background
        n_bg = math.ceil(busy_bg - 1e-9) if busy_bg > 0 else 0
        population = [_capped(n, rho[n], counts[n] * ranks) for n in threads]
        if n_bg:
            population.append(_capped("", min(1.0, busy_bg / n_bg), n_bg * ranks))
        q = {n: c * wait_per_cpu_s(cores, [(p, k - (1 if m == n else 0)) for m, p, k in population]) if c > 0 else 0.0
             for n, (c, _) in threads.items()}
    return q


def contended(profile: Any, replicas: Mapping[str, int], ranks: int, cores: float | None,
              rate_of: Any) -> dict[str, float]:
    """The change in each stage's work per batch (the wait predicted at this mix minus the wait the model
    gives the profiled run) at the rate where the pipeline's rate ``rate_of(deltas)`` (the model's min
    over stages, with these changes) meets the rate the waits were predicted at; empty when the profile
    has no thread figures or no cores. At the profiled mix on one rank the change is nil."""
    threads = _threads(profile)
    if threads is None or not cores:
        return {}
    measured = {n: w for n, (_, w) in threads.items()}
    # The model's waits as profiled (this mix, one rank, this machine's cores, at the rate the measured
    # work gives it): what the model leaves out (another process's load, correlated threads) stays in the
    # work as measured, and the profiled mix predicts what it would without this module.
    profiled = min((s.replicas / s.work_s_per_batch for n, s in profile.stages.items()
                    if n in threads and s.work_s_per_batch > 0), default=math.inf)
    if not math.isfinite(profiled):
        return {}
    base = waits(profile, {}, 1, profile.cores or cores, profiled, start=measured)

    def deltas_at(x: float) -> dict[str, float]:
        q = waits(profile, replicas, ranks, cores, x, start=measured)
        return {n: q[n] - base[n] for n in threads}

    # The pipeline's rate falls as the waits grow with the rate: the fixed point lies between 0 and the
    # rate with none of the modelled waits.
    high = rate_of({n: -w for n, w in base.items()})
    if not math.isfinite(high) or high <= 0:
        return {}
    if rate_of(deltas_at(high)) >= high:
        return deltas_at(high)
    low = 0.0
    for _ in range(BISECTIONS):
        if high - low <= TOLERANCE * high:
            break
        mid = (low + high) / 2
        if rate_of(deltas_at(mid)) >= mid:
            low = mid
        else:
            high = mid
    return deltas_at(low)
