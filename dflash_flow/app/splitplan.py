"""``dflash-flow plan``: which split of N GPUs between TargetForward replicas and drafter ranks trains fastest,
predicted from a measured profile (``app.profile``). One rank passes ``X = min over stages of r_s / w_s``
batches/s, the trainer's work raised by the exposed all-reduce (``a(2) * 2 (D - 1) / D`` per step) and each
stage's by the change of its wait for a core (``contended``: the ranks' threads share ``C`` cores equally); the
90% interval is the batch-means one over the profile's parts. The model in full: docs/benchmarks.md ("Where the
time goes and which GPU split")."""

from __future__ import annotations

import functools
import json
import math
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dflash_flow.app.profile import Profile, ProfileError, load_profile, profile_command
from dflash_flow.app.profile_data import LEVEL, Interval, batch_means, t95, window_work  # noqa: F401 - t95 re-exported

TARGET_TYPE = "TargetForward"
PADDER_TYPE = "Padder"
TIE = 0.02  # splits within 2% of the best count as equal
NO_SPREAD = "no spread measured: re-profile with this version (`dflash-flow profile`) for an interval"
CPU_LIMIT = "cpu cores"  # the limit named when the ranks' CPU work fills the machine's cores
WIDE = 0.10  # an interval wider than +-10% of its figure gets a note saying how to narrow it
ITERATIONS = 4  # fixed-point passes for the waits at one rate (each wait raises the others' runnable time)
BISECTIONS = 40
TOLERANCE = 1e-4  # of the rate: where the bisection stops
MAX_CLASS = 256  # threads of one class the distribution counts one by one


@functools.lru_cache(maxsize=1024)
def _comb(n: int) -> np.ndarray:
    return np.array([math.comb(n, i) for i in range(n + 1)], dtype=np.float64)


def wait_per_cpu_s(cores: float, others: Sequence[tuple[float, int]]) -> float:
    """Seconds a thread waits for a core per CPU-second it runs on ``cores`` cores while ``count`` other threads
    of each ``(p, count)`` are each runnable with probability ``p``: ``E[max(0, (K + 1) / cores - 1)]``."""
    if sum(k for _, k in others) + 1 <= cores:
        return 0.0  # never more runnable threads than cores
    dist = np.ones(1)
    for p, count in others:
        if count > 0 and p > 0:  # each class's runnable count is binomial
            n, p = int(count), min(max(float(p), 0.0), 1.0)
            k = np.arange(n + 1)
            dist = np.convolve(dist, _comb(n) * p**k * (1.0 - p) ** (n - k))
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
    """Each stage's predicted wait at this mix minus the model's wait for the profiled run, at the fixed point
    where the pipeline's rate ``rate_of(deltas)`` meets the rate the waits were predicted at; empty when the
    profile has no thread figures or no cores."""
    threads = _threads(profile)
    if threads is None or not cores:
        return {}
    measured = {n: w for n, (_, w) in threads.items()}
    # The model's waits as profiled (one rank, this machine's cores, at the rate the measured work gives it).
    profiled = min((s.replicas / s.work_s_per_batch for n, s in profile.stages.items()
                    if n in threads and s.work_s_per_batch > 0), default=math.inf)
    if not math.isfinite(profiled):
        return {}
    base = waits(profile, {}, 1, profile.cores or cores, profiled, start=measured)

    def deltas_at(x: float) -> dict[str, float]:
        q = waits(profile, replicas, ranks, cores, x, start=measured)
        return {n: q[n] - base[n] for n in threads}

    # The rate falls as the waits grow with it: the fixed point lies between 0 and the rate with no waits.
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


@attrs.frozen
class Prediction:
    """Predicted batches per second of one rank, the stage that sets it and every stage's own limit;
    ``per_window``: the same prediction from each part of the profile's window (empty without parts)."""

    batches_per_s: float
    limit: str
    rates: dict[str, float]
    per_window: tuple[float, ...] = ()
    waits: dict[str, float] = attrs.field(factory=dict)  # stage -> predicted minus profiled core wait, s/batch

    @property
    def interval(self) -> Interval | None:
        return batch_means(self.batches_per_s, self.per_window)


def _min_rate(work: Mapping[str, float], profile: Profile, replicas: Mapping[str, int],
              extra: Mapping[str, float], cpu_cores: float | None) -> dict[str, float]:
    rates = {}
    for name, s in profile.stages.items():
        if s.observer:
            continue
        w = work[name] + float(extra.get(name, 0.0))
        rates[name] = replicas.get(name, s.replicas) / w if w > 0 else math.inf
    if cpu_cores is not None:
        rates[CPU_LIMIT] = cpu_cores
    return rates


def _cpu_rate(cpu_s: float | None, batches: float, cores: float | None, ranks: int) -> float | None:
    """Batches/s per rank that ``cores`` allow ``ranks`` ranks spending ``cpu_s`` per ``batches`` (None: unknown)."""
    if cpu_s is None or cores is None or batches <= 0:
        return None
    per_batch = cpu_s / batches
    return cores / (ranks * per_batch) if per_batch > 0 else math.inf


def predict(profile: Profile, replicas: Mapping[str, int] | None = None, *,
            extra_work_s: Mapping[str, float] | None = None, ranks: int = 1, cores: int | None = None) -> Prediction:
    """Batches/s of one rank with ``replicas`` (stage -> count; else as profiled), each stage's work raised by
    ``extra_work_s`` (the all-reduce), ``ranks`` such ranks sharing ``cores`` (default: the profiled machine's)."""
    replicas = replicas or {}
    extra = extra_work_s or {}
    unknown = sorted(set(replicas) - set(profile.stages))
    if unknown:
        raise ProfileError(f"no stage named {', '.join(unknown)} in the profile of {profile.pipeline}")
    cores = cores if cores is not None else profile.cores
    cpu = profile.cpu_s_per_batch
    cap = _cpu_rate(cpu, 1.0, cores, ranks)
    work = {n: s.work_s_per_batch for n, s in profile.stages.items()}

    def with_waits(base: Mapping[str, float], waits: Mapping[str, float]) -> dict[str, float]:
        return {n: max(w + waits.get(n, 0.0), 0.0) for n, w in base.items()}

    # Each stage's wait for a core at this mix, in place of the profiled one (``contended``).
    waits = contended(profile, replicas, ranks, cores,
                      lambda d: min(_min_rate(with_waits(work, d), profile, replicas, extra, cap).values()))
    rates = _min_rate(with_waits(work, waits), profile, replicas, extra, cap)
    limit = min(rates, key=lambda n: rates[n])
    # A part without its CPU seconds (a profile written before they were measured) uses the window's.
    per_window = tuple(min(_min_rate(with_waits(window_work(profile.stages, w), waits), profile, replicas, extra,
                                     _cpu_rate(w.cpu_s, w.batches, cores, ranks) if w.cpu_s is not None
                                     else cap).values())
                       for w in profile.windows)
    return Prediction(batches_per_s=rates[limit], limit=limit, rates=rates, per_window=per_window, waits=waits)


def allreduce_s(ranks: int, at_two: float) -> float:
    """Exposed all-reduce seconds per optimizer step with ``ranks`` ranks, from its value at two."""
    return 0.0 if ranks <= 1 else float(at_two) * 2.0 * (ranks - 1) / ranks


@attrs.frozen
class Split:
    ranks: int
    targets_per_rank: int
    padders_per_rank: int | None
    gpus_used: int
    idle_gpus: int
    allreduce_s: float
    batches_per_s_rank: float
    steps_per_s: float
    samples_per_s: float | None
    tokens_per_s: float | None
    limit: str
    per_window: tuple[float, ...] = ()  # the score (samples/s, else batches/s of the job) from each part

    @property
    def score(self) -> float:
        return self.samples_per_s if self.samples_per_s is not None else self.batches_per_s_rank * self.ranks

    @property
    def interval(self) -> Interval | None:
        """The score's ``LEVEL`` interval (None without parts)."""
        return batch_means(self.score, self.per_window)


def within_noise(a: Split, b: Split) -> bool | None:
    """Whether the interval of two splits' per-part score difference holds 0; None without parts."""
    if len(a.per_window) < 2 or len(a.per_window) != len(b.per_window):
        return None
    diff = batch_means(a.score - b.score, [x - y for x, y in zip(a.per_window, b.per_window, strict=True)])
    return None if diff is None else 0.0 in diff


def _per_window_score(profile: Profile, per_window: Sequence[float], ranks: int) -> tuple[float, ...]:
    if profile.samples_per_batch is None:
        return tuple(x * ranks for x in per_window)
    spb = [w.samples / w.batches if w.samples is not None and w.batches else profile.samples_per_batch
           for w in profile.windows]
    return tuple(x * ranks * s for x, s in zip(per_window, spb, strict=True))


def stage_of_type(profile: Profile, type_name: str) -> str | None:
    names = [n for n, s in profile.stages.items() if s.type == type_name]
    return names[0] if len(names) == 1 else None


def evaluate_split(profile: Profile, ranks: int, targets: int, *, target_stage: str, padder_stage: str | None,
                   allreduce_at_two: float = 0.0, gpus: int | None = None, cores: int | None = None) -> Split:
    """The predicted throughput of ``ranks`` ranks with ``targets`` TargetForward replicas each."""
    trainer = profile.step_stage
    accum = profile.grad_accum
    wait = allreduce_s(ranks, allreduce_at_two)
    extra = {trainer: wait / accum}
    mix = {target_stage: targets}
    padders = None
    if padder_stage is not None:
        # Padders are CPU threads: as many as the rest of the rank can use, never fewer than one.
        rest = predict(profile, {**mix, padder_stage: 10**9}, extra_work_s=extra, ranks=ranks, cores=cores).batches_per_s
        w = profile.stages[padder_stage].work_s_per_batch
        padders = max(1, math.ceil(w * rest - 1e-6)) if math.isfinite(rest) else profile.stages[padder_stage].replicas
        mix[padder_stage] = padders
    pred = predict(profile, mix, extra_work_s=extra, ranks=ranks, cores=cores)
    x = pred.batches_per_s
    used = ranks * (targets + 1)
    return Split(ranks=ranks, targets_per_rank=targets, padders_per_rank=padders, gpus_used=used,
                 idle_gpus=(gpus - used) if gpus is not None else 0, allreduce_s=wait, batches_per_s_rank=x,
                 steps_per_s=x / accum,
                 samples_per_s=x * ranks * profile.samples_per_batch if profile.samples_per_batch is not None else None,
                 tokens_per_s=x * ranks * profile.tokens_per_batch if profile.tokens_per_batch is not None else None,
                 limit=pred.limit, per_window=_per_window_score(profile, pred.per_window, ranks))


def plan_splits(profile: Profile, gpus: int, *, allreduce_at_two: float = 0.0, target_stage: str | None = None,
                padder_stage: str | None = None, cores: int | None = None) -> list[Split]:
    """Every split of ``gpus`` GPUs into ranks of (targets + one drafter GPU), fewest ranks first."""
    if gpus < 2:
        raise ProfileError(f"--gpus must be at least 2 (one TargetForward and one DrafterStep GPU), got {gpus}")
    target_stage = target_stage or stage_of_type(profile, TARGET_TYPE)
    if target_stage is None or target_stage not in profile.stages:
        raise ProfileError(f"the profile of {profile.pipeline} has no single {TARGET_TYPE} stage; name it with --target-stage")
    if padder_stage is None:
        padder_stage = stage_of_type(profile, PADDER_TYPE)
    elif padder_stage not in profile.stages:
        raise ProfileError(f"--padder-stage: no stage named '{padder_stage}' in the profile")
    return [evaluate_split(profile, ranks, gpus // ranks - 1, target_stage=target_stage, padder_stage=padder_stage,
                           allreduce_at_two=allreduce_at_two, gpus=gpus, cores=cores)
            for ranks in range(1, gpus // 2 + 1)]


def recommend(splits: list[Split]) -> Split:
    """The most samples/s; within ``TIE`` of it, fewer GPUs used, then fewer ranks."""
    best = max(s.score for s in splits)
    close = [s for s in splits if s.score >= best * (1 - TIE)]
    return min(close, key=lambda s: (s.gpus_used, s.ranks))


def _num(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _name(s: Split) -> str:
    return f"{s.ranks} x {s.targets_per_rank}"


def unit(profile: Profile) -> str:
    """What a split's score counts: samples/s of the job, else batches/s of all its ranks together."""
    return "samples/s" if profile.samples_per_batch is not None else "batches/s (all ranks)"


def confidence(profile: Profile, s: Split) -> str:
    """``312 samples/s, 90% interval 290-335, from 6 windows`` (or the no-spread note)."""
    iv = s.interval
    head = f"{_num(s.score)} {unit(profile)}"
    if iv is None:
        return f"{head}; " + (NO_SPREAD if len(profile.windows) < 2 else "no interval (a stage costs nothing)")
    pct = 100 * iv.half_width / s.score if s.score else math.inf
    return f"{head}, {iv.level:.0%} interval {_num(iv.low)}-{_num(iv.high)} (+-{pct:.0f}%), from {iv.windows} windows"


def noise_notes(profile: Profile, splits: list[Split], chosen: Split) -> list[str]:
    """The splits the parts cannot rank apart from the recommended one."""
    close = [s for s in splits if s != chosen and within_noise(chosen, s)]
    if not close:
        return []
    names = ", ".join(f"{_name(s)} ({_num(s.score)})" for s in close)
    return [f"within the noise: splits {_name(chosen)} and {names} cannot be ranked apart "
            f"(the {LEVEL:.0%} interval of their difference over the windows holds 0); profile longer to tell "
            "(`dflash-flow profile --precision 0.05`)"]


def notes(profile: Profile, splits: list[Split], chosen: Split, cores: int | None = None) -> list[str]:
    """``noise_notes``; the recommendation's interval when wider than ``WIDE`` of its figure; the splits the
    machine's cores limit, with what each rank spends and what would lift it."""
    out = noise_notes(profile, splits, chosen)
    iv = chosen.interval
    if iv is not None and chosen.score and iv.half_width > WIDE * chosen.score:
        out.append(f"the interval is wider than +-{WIDE:.0%}: profile until it is narrower (`dflash-flow profile "
                   "--precision 0.05`, or more --steps), on a machine with nothing else running, for a figure good "
                   "to 10% (the interval covers the profiled run; a change in the machine's load moves a later run)")
    limited = [s for s in splits if s.limit == CPU_LIMIT]
    if limited and profile.cpu_s_per_batch is not None:
        n = cores if cores is not None else profile.cores
        out.append(f"the CPU limits {', '.join(_name(s) for s in limited)}: each rank spends "
                   f"{profile.cpu_s_per_batch:.3g} CPU-seconds per batch (every thread of the profiled process) and "
                   f"the ranks share {n} cores; on a node with more cores pass --cores, or move CPU work off the "
                   "ranks (fewer padders, torch_threads)")
    return out


def render_plan(profile: Profile, splits: list[Split], chosen: Split, gpus: int, *, width: int = 120,
                cores: int | None = None) -> str:
    from dflash_flow.observe.console import render_table

    def iv(s: Split) -> str:
        i = s.interval
        return f"{_num(i.low)}-{_num(i.high)}" if i is not None else "-"

    rows = [["*" if s == chosen else "", _name(s), s.padders_per_rank, s.gpus_used, s.idle_gpus, s.limit,
             s.batches_per_s_rank, s.steps_per_s, s.samples_per_s, iv(s), s.tokens_per_s, s.allreduce_s] for s in splits]
    cols = ["", "ranks x targets", "padders", "GPUs", "idle", "limit", "batches/s", "steps/s", "samples/s",
            f"{LEVEL:.0%} interval", "tokens/s", "all-reduce s"]
    head = (f"plan for {gpus} GPUs from the profile of {profile.pipeline} ({profile.batches} batches, "
            f"{profile.batches_per_s:.3g} batches/s measured). Each rank: its TargetForward GPUs (targets) + "
            "one DrafterStep GPU, padders on CPU; batches/s per rank, steps/s and samples/s of the job; "
            f"the {LEVEL:.0%} interval of the job's {unit(profile)}")
    pad = f", {chosen.padders_per_rank} padder(s)" if chosen.padders_per_rank is not None else ""
    tail = (f"recommended: {chosen.ranks} rank(s) x ({chosen.targets_per_rank} TargetForward + 1 DrafterStep){pad}; "
            f"limited by {chosen.limit}; {confidence(profile, chosen)}")
    return "\n".join([head, render_table(rows, cols, width=width), tail, *notes(profile, splits, chosen, cores)])


def plan_to_json(profile: Profile, splits: list[Split], chosen: Split, gpus: int,
                 cores: int | None = None) -> dict[str, Any]:
    """The plan as data: every split with its interval, the recommendation and the notes."""

    def one(s: Split) -> dict[str, Any]:
        i = s.interval
        out = {k: v for k, v in attrs.asdict(s).items() if k != "per_window"}
        out.update(score=s.score, unit=unit(profile), interval=None if i is None else attrs.asdict(i),
                   within_noise_of_recommended=None if s == chosen else within_noise(chosen, s))
        return out

    return {"gpus": gpus, "pipeline": profile.pipeline, "profile_version": profile.version,
            "windows": len(profile.windows), "splits": [one(s) for s in splits], "recommended": one(chosen),
            "summary": confidence(profile, chosen), "cores": cores if cores is not None else profile.cores,
            "cpu_s_per_batch": profile.cpu_s_per_batch,
            "notes": notes(profile, splits, chosen, cores)}


def plan_command(file: Path, v, *, gpus: int, profile_path: Path | None, allreduce_at_two: float, steps: int,
                 target_stage: str | None, padder_stage: str | None, out: Path | None = None,
                 cores: int | None = None) -> int:
    """``dflash-flow plan`` from ``--profile``, else OUTPUT/profile.json, else a new ``steps``-step profile."""
    from dflash_flow.app.exits import EXIT_OK, EXIT_USER_ERROR

    out_dir = v.graph.run_dir
    path = profile_path or out_dir / "profile.json"
    if profile_path is None and not path.is_file():
        print(f"no profile at {path}: profiling {steps} steps first", file=sys.stderr)
        code = profile_command(file, v, steps=steps, warmup_steps=1, interval_s=0.1, step_stage=None,
                               tracking=False, out=path)
        if code != EXIT_OK:
            return code
    try:
        prof = load_profile(path)
        splits = plan_splits(prof, gpus, allreduce_at_two=allreduce_at_two, target_stage=target_stage,
                             padder_stage=padder_stage, cores=cores)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    chosen = recommend(splits)
    print(render_plan(prof, splits, chosen, gpus, cores=cores))
    if out is not None:
        from dflash_flow.util import atomic_write_text

        atomic_write_text(out, json.dumps(plan_to_json(prof, splits, chosen, gpus, cores), indent=1) + "\n")
        print(f"wrote {out}", file=sys.stderr)
    return EXIT_OK
