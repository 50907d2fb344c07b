"""``dflash-flow plan``: which split of N GPUs between TargetForward replicas and drafter ranks trains
fastest, predicted from a measured profile (``app.profile``).

The model. A profile gives each stage's replica-seconds of work per trained batch ``w`` (``work_s_per_
batch``). With ``r`` replicas a stage can pass at most ``r / w`` batches per second, so one rank's
pipeline passes

    X = min over stages of r_s / w_s        (batches/s; replicas assumed to scale linearly)

Data parallel: D ranks each run the whole DAG on their share of the global plan; a rank's GPUs host its
T TargetForward replicas (one GPU each) and its DrafterStep (one GPU), its Padders run on CPU. An
optimizer step of G micro-batches waits for every rank (the ranks are alike, so the max over ranks is one
rank's time) and then for the gradient all-reduce, whose exposed wait ``a(D)`` (seconds per step) adds
to the trainer's work: ``w_trainer + a(D) / G`` per batch. ``a(2)`` is measured (``bench/scale_bench.py``
records it with a DDP comm hook); it grows like a ring all-reduce, ``a(D) = a(2) * 2 (D - 1) / D``. Then

    steps/s = X / G,  samples/s = X * D * samples_per_batch,  tokens/s likewise.

Splits: every D with at least two GPUs per rank (``T = N // D - 1`` targets; leftover GPUs idle), padders
per rank just enough not to limit (``ceil(w_padder * X)``). The recommendation is the split with the most
samples/s; within 2% of it, the one using fewer GPUs, then fewer ranks (less memory, no all-reduce).
Validation against real runs: ``bench/profile_bench.py`` and ``tests/app/test_splitplan.py``.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from pathlib import Path

import attrs

from dflash_flow.app.profile import Profile, ProfileError

TARGET_TYPE = "TargetForward"
PADDER_TYPE = "Padder"
TIE = 0.02  # splits within 2% of the best count as equal


@attrs.frozen
class Prediction:
    """Predicted batches per second of one rank, the stage that sets it and every stage's own limit."""

    batches_per_s: float
    limit: str
    rates: dict[str, float]


def predict(
    profile: Profile,
    replicas: Mapping[str, int] | None = None,
    *,
    extra_work_s: Mapping[str, float] | None = None,
) -> Prediction:
    """Batches/s with ``replicas`` (stage -> count; the profiled count for stages not named), each
    stage's work per batch raised by ``extra_work_s`` (the all-reduce term)."""
    replicas = replicas or {}
    extra = extra_work_s or {}
    unknown = sorted(set(replicas) - set(profile.stages))
    if unknown:
        raise ProfileError(f"no stage named {', '.join(unknown)} in the profile of {profile.pipeline}")
    rates = {}
    for name, s in profile.stages.items():
        if s.observer:
            continue
        w = s.work_s_per_batch + float(extra.get(name, 0.0))
        rates[name] = replicas.get(name, s.replicas) / w if w > 0 else math.inf
    limit = min(rates, key=lambda n: rates[n])
    return Prediction(batches_per_s=rates[limit], limit=limit, rates=rates)


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

    @property
    def score(self) -> float:
        return self.samples_per_s if self.samples_per_s is not None else self.batches_per_s_rank * self.ranks


def stage_of_type(profile: Profile, type_name: str) -> str | None:
    names = [n for n, s in profile.stages.items() if s.type == type_name]
    return names[0] if len(names) == 1 else None


def evaluate_split(
    profile: Profile,
    ranks: int,
    targets: int,
    *,
    target_stage: str,
    padder_stage: str | None,
    allreduce_at_two: float = 0.0,
    gpus: int | None = None,
) -> Split:
    """The predicted throughput of ``ranks`` ranks with ``targets`` TargetForward replicas each."""
    trainer = profile.step_stage
    accum = profile.grad_accum
    wait = allreduce_s(ranks, allreduce_at_two)
    extra = {trainer: wait / accum}
    mix = {target_stage: targets}
    padders = None
    if padder_stage is not None:
        # Padders are CPU threads: as many as the rest of the rank can use, never fewer than one.
        rest = predict(profile, {**mix, padder_stage: 10**9}, extra_work_s=extra).batches_per_s
        w = profile.stages[padder_stage].work_s_per_batch
        padders = max(1, math.ceil(w * rest - 1e-6)) if math.isfinite(rest) else profile.stages[padder_stage].replicas
        mix[padder_stage] = padders
    pred = predict(profile, mix, extra_work_s=extra)
    x = pred.batches_per_s
    used = ranks * (targets + 1)
    return Split(
        ranks=ranks,
        targets_per_rank=targets,
        padders_per_rank=padders,
        gpus_used=used,
        idle_gpus=(gpus - used) if gpus is not None else 0,
        allreduce_s=wait,
        batches_per_s_rank=x,
        steps_per_s=x / accum,
        samples_per_s=x * ranks * profile.samples_per_batch if profile.samples_per_batch is not None else None,
        tokens_per_s=x * ranks * profile.tokens_per_batch if profile.tokens_per_batch is not None else None,
        limit=pred.limit,
    )


def plan_splits(
    profile: Profile,
    gpus: int,
    *,
    allreduce_at_two: float = 0.0,
    target_stage: str | None = None,
    padder_stage: str | None = None,
) -> list[Split]:
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
    out = []
    for ranks in range(1, gpus // 2 + 1):
        targets = gpus // ranks - 1
        out.append(evaluate_split(profile, ranks, targets, target_stage=target_stage, padder_stage=padder_stage,
                                  allreduce_at_two=allreduce_at_two, gpus=gpus))
    return out


def recommend(splits: list[Split]) -> Split:
    """The most samples/s; within ``TIE`` of it, fewer GPUs used, then fewer ranks."""
    best = max(s.score for s in splits)
    close = [s for s in splits if s.score >= best * (1 - TIE)]
    return min(close, key=lambda s: (s.gpus_used, s.ranks))


def render_plan(profile: Profile, splits: list[Split], chosen: Split, gpus: int, *, width: int = 120) -> str:
    from dflash_flow.observe.console import render_table

    rows = [
        ["*" if s == chosen else "", s.ranks, s.targets_per_rank, s.padders_per_rank, s.gpus_used, s.idle_gpus,
         s.limit, s.batches_per_s_rank, s.steps_per_s, s.samples_per_s, s.tokens_per_s, s.allreduce_s]
        for s in splits
    ]
    cols = ["", "ranks", "targets", "padders", "GPUs", "idle", "limit", "batches/s", "steps/s", "samples/s",
            "tokens/s", "all-reduce s"]
    head = (f"plan for {gpus} GPUs from the profile of {profile.pipeline} ({profile.batches} batches, "
            f"{profile.batches_per_s:.3g} batches/s measured). Each rank: its TargetForward GPUs (targets) + "
            "one DrafterStep GPU, padders on CPU; batches/s per rank, steps/s and samples/s of the job")
    pad = f", {chosen.padders_per_rank} padder(s)" if chosen.padders_per_rank is not None else ""
    tail = (f"recommended: {chosen.ranks} rank(s) x ({chosen.targets_per_rank} TargetForward + 1 DrafterStep){pad}; "
            f"limited by {chosen.limit}")
    return "\n".join([head, render_table(rows, cols, width=width), tail])


def plan_command(
    file: Path,
    v,
    *,
    gpus: int,
    profile_path: Path | None,
    allreduce_at_two: float,
    steps: int,
    target_stage: str | None,
    padder_stage: str | None,
) -> int:
    """``dflash-flow plan``: the table and the recommendation; profiles first when there is no profile
    (``--profile``, else OUTPUT/profile.json, else a new ``steps``-step profile)."""
    from dflash_flow.app.exits import EXIT_OK, EXIT_USER_ERROR
    from dflash_flow.app.profile import load_profile, profile_command

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
                             padder_stage=padder_stage)
    except ProfileError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(render_plan(prof, splits, recommend(splits), gpus))
    return EXIT_OK
