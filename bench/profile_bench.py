"""Profile and split-plan benchmark: how well ``app.splitplan.predict`` foresees real runs.

Writes bench/results/profile.json (also printed):

* ``sleep``: a pipeline of sleep stages with known costs (``common.sleep_graph``: src 2 ms -> a 30 ms ->
  b 12 ms -> sink, a's and b's sleeps jittered uniformly by +-``--sleep-jitter`` of their cost, seeded)
  is profiled at one replica mix; the profile predicts the batches/s of other mixes, each of which is then
  run and profiled; error = predicted / measured - 1.

Every prediction comes with the plan's 90% interval (``app.splitplan``: batch means over the profile's
``--windows`` parts) and every row says whether the measured rate falls inside it (``measured_in_interval``)
and whether the measured run's own interval overlaps it (``intervals_overlap``; the fairer test, as a
short measured run has a sampling error of its own, about as large as the profile's): the interval is for
the steady state of the profiled run, so a later run's drift in the machine's load can fall outside it.
* ``contention``: threads that outnumber the cores (GIL-free hashing stages pinned to two cores), predicted
  with and without the profile's CPU figures, then run (``contention_check``).
* ``noise_floor``: the machine's own drift, first: one thread's fixed matrix products timed in 1-s chunks
  for ``--noise-s`` seconds (the spread of chunks and of 5-chunk means): no prediction of a run on this
  machine can be closer than that.
* ``embedded``: ``pipelines/dflash.yaml`` shortened (drafter ``torch_threads`` 1), with 1 and 2
  TargetForward replicas, alternating, ``--embedded-reps`` runs each; each setting's profiles predict the
  other's throughput (and its own); means over the runs, each cross error with its own 90% interval (the
  two means' intervals combined), and every single profile against every single other run (``pairs``).
* ``data_parallel``: the two-rank run of bench/scale_bench.py (results/scale.json, if there) predicted
  from the one-process profile with 1 target and the all-reduce wait that run measured;
* ``profile``: the embedded profile itself (2 TargetForward replicas), and ``plan``: the split table
  for 8 GPUs it gives (CPU costs, so only the shape of the table carries over to a GPU machine).

Usage: python bench/profile_bench.py [--out FILE] [--sleep-steps 150] [--sleep-jitter 0.5] [--windows 6]
       [--embedded-steps 25] [--embedded-reps 4] [--noise-s 10] [--no-embedded]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path
from typing import Any

import common

COSTS = {"src": 0.002, "a": 0.030, "b": 0.012}
BASE_MIX = {"a": 1, "b": 1}
MIXES = [{"a": 2, "b": 1}, {"a": 3, "b": 1}, {"a": 3, "b": 2}, {"a": 4, "b": 3}]
TARGET = "target"
# One torch thread for the drafter (each target has one already): the model assumes a stage's work per
# batch does not depend on the others, which holds on a CPU only while the busy threads fit the cores
# (with the default 2 drafter threads, 1 vs 2 busy targets on 2 shared cores changed the drafter's step
# time by 50%: see docs/benchmarks.md).
# 2,048-token micro-batches: the workload of scale_bench, whose two-rank run the data-parallel row predicts.
EMBEDDED_THREADS = ("stages.drafter.torch_threads=1", "stages.bucketer.max_tokens=2048")
WINDOWS = 6
JITTER = 0.5


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0


def noise_floor(seconds: float = 20.0, chunk_s: float = 1.0) -> dict[str, Any]:
    """The machine's own drift: one thread multiplies the same 512 x 512 matrices for ``seconds``, timed in
    chunks of about ``chunk_s``; the spread of the chunks' (and of 5-chunk means') speed is what no
    prediction of a run on this machine can beat (nothing else of ours runs meanwhile)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        t0 = time.perf_counter()
        for _ in range(5):
            a @ b
        per = max(1, round(chunk_s / max((time.perf_counter() - t0) / 5, 1e-6)))
        chunks, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            for _ in range(per):
                a @ b
            chunks.append(per / (time.perf_counter() - t))
    finally:
        torch.set_num_threads(threads)

    def spread(xs: list[float]) -> dict[str, float] | None:
        if len(xs) < 2:
            return None
        m = statistics.fmean(xs)
        return {"sd_pct": round(100 * statistics.stdev(xs) / m, 1), "min_over_mean": round(min(xs) / m, 3),
                "max_over_mean": round(max(xs) / m, 3), "n": len(xs)}

    fives = [statistics.fmean(chunks[i:i + 5]) for i in range(0, len(chunks) - 4, 5)]
    return {"seconds": seconds, "chunk_s": chunk_s, "chunks": spread(chunks), "five_chunk_means": spread(fives)}


def _plain(prof):
    """``prof`` without its CPU figures: what the model predicted before it knew of the cores."""
    import attrs

    stages = {n: attrs.evolve(st, cpu_s_per_batch=None, cpu_wait_s_per_batch=None) for n, st in prof.stages.items()}
    return attrs.evolve(prof, stages=stages, cpu_s_per_batch=None)


def _mean_interval(xs: list[float]) -> float | None:
    """The relative half-width of the 90% interval of the mean of ``xs`` (None below two)."""
    from dflash_flow.app.splitplan import t95

    if len(xs) < 2:
        return None
    return t95(len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)) / statistics.fmean(xs)


def _profile(v, steps: int, warmup: int = 1, interval_s: float = 0.05, windows: int = WINDOWS):
    from dflash_flow.app.profile import profile

    return profile(v, steps, warmup_steps=warmup, interval_s=interval_s, windows=windows)


def _iv(interval) -> list[float] | None:
    return None if interval is None else [round(interval.low, 4), round(interval.high, 4)]


def _check(pred, measured) -> dict[str, Any]:
    """The prediction's interval against a measured profile: the measured rate inside it, and the measured
    run's own interval (its rate predicted for its own mix) overlapping it."""
    from dflash_flow.app.splitplan import predict

    iv, own = pred.interval, predict(measured).interval
    return {
        "predicted_interval": _iv(iv),
        "interval_half_width": round(iv.half_width / pred.batches_per_s, 4) if iv is not None else None,
        "measured_interval": _iv(own),
        "measured_in_interval": None if iv is None else measured.batches_per_s in iv,
        "intervals_overlap": None if iv is None or own is None else (iv.low <= own.high and own.low <= iv.high),
    }


def _inside(rows: list[dict[str, Any]], key: str = "measured_in_interval") -> str:
    got = [r[key] for r in rows if r.get(key) is not None]
    return f"{sum(got)} of {len(got)}"


def validate_sleep(steps: int, mixes: list[dict[str, int]] | None = None, base: dict[str, int] | None = None,
                   *, jitter: float = JITTER, windows: int = WINDOWS) -> dict[str, Any]:
    """Profile ``base``, predict every mix, run every mix: rows of predicted (with the interval) vs
    measured batches/s."""
    from dflash_flow.app.splitplan import predict
    from dflash_flow.core import validated

    base = base or BASE_MIX
    prof = _profile(validated(common.sleep_graph(base, COSTS, name="sleep-base", jitter=jitter, seed=0)), steps,
                    warmup=5, windows=windows)
    rows = []
    for i, mix in enumerate([base, *(mixes or MIXES)]):
        pred = predict(prof, mix)
        measured = _profile(validated(common.sleep_graph(mix, COSTS, name="sleep-mix", jitter=jitter, seed=i + 1)),
                            steps, warmup=5, windows=windows)
        rows.append({
            "mix": dict(mix),
            "predicted_batches_per_s": round(pred.batches_per_s, 3),
            "limited_by": pred.limit,
            "measured_batches_per_s": round(measured.batches_per_s, 3),
            "measured_bottleneck": measured.bottleneck.stage if measured.bottleneck else None,
            "error": round(_error(pred.batches_per_s, measured.batches_per_s), 4),
            **_check(pred, measured),
        })
    return {
        "costs_s": COSTS,
        "jitter": jitter,
        "windows": windows,
        "base_mix": base,
        "work_s_per_batch": {n: round(s.work_s_per_batch, 5) for n, s in prof.stages.items()},
        "work_s_sd": {n: round(s.work_s_sd, 5) if s.work_s_sd is not None else None for n, s in prof.stages.items()},
        "rows": rows,
        "max_abs_error": max(abs(r["error"]) for r in rows),
        "measured_in_interval": _inside(rows),
        "intervals_overlap": _inside(rows, "intervals_overlap"),
    }


def validate_embedded(steps: int, root: Path, reps: int = 2, windows: int = WINDOWS) -> tuple[dict[str, Any], dict[int, Any]]:
    """Profiles of the embedded pipeline with 1 and 2 target replicas, ``reps`` each, alternating (the
    load of a shared machine drifts between runs); each setting's profiles predict both settings, and
    predictions and measurements are means over the runs; ``pairs``: every single profile's prediction
    with its interval against every single measured run."""
    from dflash_flow.app.splitplan import evaluate_split, predict

    profiles: dict[int, list[Any]] = {2: [], 1: []}
    for rep in range(reps):
        for n in (2, 1):
            v = common.embedded_validated(root / f"targets{n}-{rep}", f"stages.{TARGET}.replicas={n}", *EMBEDDED_THREADS)
            profiles[n].append(_profile(v, steps, warmup=2, interval_s=0.1, windows=windows))
    rows, pairs = [], []
    for source, profs in profiles.items():
        for n, measured in profiles.items():
            preds = [predict(p, {TARGET: n}) for p in profs]
            pred = statistics.fmean(x.batches_per_s for x in preds)
            plain = statistics.fmean(predict(_plain(p), {TARGET: n}).batches_per_s for p in profs)
            meas = statistics.fmean(p.batches_per_s for p in measured)
            # The error's own 90% interval: both means' relative intervals, combined (runs independent).
            ip, im = _mean_interval([x.batches_per_s for x in preds]), _mean_interval([p.batches_per_s for p in measured])
            rows.append({
                "profiled_with_targets": source,
                "predicted_for_targets": n,
                "predicted_batches_per_s": round(pred, 4),
                "limited_by": preds[0].limit,
                "measured_batches_per_s": round(meas, 4),
                "measured_runs": [round(p.batches_per_s, 4) for p in measured],
                "error": round(_error(pred, meas), 4),
                "error_without_cpu_figures": round(_error(plain, meas), 4),
                "error_interval_half_width": None if ip is None or im is None or source == n else round(
                    math.hypot(ip, im), 4),
            })
            for i, (p_, pr) in enumerate(zip(profs, preds, strict=True)):
                for j, m in enumerate(measured):
                    if p_ is m:
                        continue  # a profile always holds its own rate
                    # samples/s, the plan's own figure: each part's rate times that part's samples per batch
                    split = evaluate_split(p_, 1, n, target_stage=TARGET, padder_stage="padder")
                    own = evaluate_split(m, 1, n, target_stage=TARGET, padder_stage="padder").interval
                    iv = split.interval
                    pairs.append({
                        "profiled_with_targets": source, "profile_run": i, "predicted_for_targets": n, "measured_run": j,
                        "predicted_batches_per_s": round(pr.batches_per_s, 4),
                        "measured_batches_per_s": round(m.batches_per_s, 4),
                        "error": round(_error(pr.batches_per_s, m.batches_per_s), 4),
                        **_check(pr, m),
                        "predicted_samples_per_s": round(split.samples_per_s, 3),
                        "predicted_samples_interval": _iv(iv),
                        "measured_samples_per_s": round(m.samples_per_s, 3),
                        "samples_error": round(_error(split.samples_per_s, m.samples_per_s), 4),
                        "samples_in_interval": None if iv is None else m.samples_per_s in iv,
                        "samples_intervals_overlap": None if iv is None or own is None else (
                            iv.low <= own.high and own.low <= iv.high),
                    })
    summary = {
        n: {
            "batches_per_s": [round(p.batches_per_s, 4) for p in profs],
            "tokens_per_s": [round(p.tokens_per_s or 0.0, 1) for p in profs],
            "bottleneck": [p.bottleneck.stage if p.bottleneck else None for p in profs],
            "work_s_per_batch": {k: round(statistics.fmean(p.stages[k].work_s_per_batch for p in profs), 4)
                                 for k, s in profs[0].stages.items() if not s.observer},
            "busy": {k: round(statistics.fmean(p.stages[k].busy for p in profs), 3)
                     for k, s in profs[0].stages.items() if not s.observer},
        }
        for n, profs in profiles.items()
    }
    cross = [r for r in rows if r["profiled_with_targets"] != r["predicted_for_targets"]]
    return {
        "steps": steps,
        "reps": reps,
        "windows": windows,
        "overrides": list(EMBEDDED_THREADS),
        "rows": rows,
        "pairs": pairs,
        "measured_in_interval": _inside(pairs),
        "samples_in_interval": _inside(pairs, "samples_in_interval"),
        "intervals_overlap": _inside(pairs, "intervals_overlap"),
        "samples_intervals_overlap": _inside(pairs, "samples_intervals_overlap"),
        "max_abs_pair_error": max((abs(r["error"]) for r in pairs), default=None),
        "pairs_within_10pct": f"{sum(abs(r['error']) <= 0.10 for r in pairs)} of {len(pairs)}",
        "median_interval_half_width": statistics.median(r["interval_half_width"] for r in pairs) if pairs else None,
        "settings": summary,
        "max_abs_error": max(abs(r["error"]) for r in rows),
        "max_abs_cross_error": max(abs(r["error"]) for r in cross),
    }, {n: profs[-1] for n, profs in profiles.items()}


def _scale() -> dict[str, Any] | None:
    import json

    try:
        data = json.loads((common.RESULTS / "scale.json").read_text())
        float(data["allreduce_wait_s_per_step"])
        return data
    except (OSError, ValueError, KeyError, TypeError):
        return None


def data_parallel_check(prof, scale: dict[str, Any]) -> dict[str, Any]:
    """The two-rank run of bench/scale_bench.py (1 target and 1 drafter thread per rank, grad_accum 1)
    predicted from the one-process profile with 1 target and the all-reduce wait that run measured."""
    from dflash_flow.app.splitplan import evaluate_split

    at_two = float(scale["allreduce_wait_s_per_step"])
    split = evaluate_split(prof, 2, 1, target_stage=TARGET, padder_stage="padder", allreduce_at_two=at_two)
    plain = evaluate_split(_plain(prof), 2, 1, target_stage=TARGET, padder_stage="padder", allreduce_at_two=at_two)
    measured = float(scale["two_ranks"]["steps_per_s"])
    return {"predicted_steps_per_s": round(split.steps_per_s, 4), "measured_steps_per_s": measured,
            "error": round(_error(split.steps_per_s, measured), 4), "limited_by": split.limit,
            "error_without_cpu_figures": round(_error(plain.steps_per_s, measured), 4),
            "one_process_steps_per_s": round(prof.steps_per_s, 4)}


def contention_check(out: Path, cores: int = 2, steps: int = 150) -> dict[str, Any]:
    """Threads that outnumber the cores (``common.hash_graph``, pinned to ``cores``): profiled with one replica
    of ``a``, the run with ``cores`` replicas predicted with and without the profile's CPU figures, then run;
    error = predicted / measured - 1 (on the idle 2-core box: +5% to +25% with them, +40% to +80% without).
    It needs a quiet machine, which is why it is here and not in the unit tests."""
    import os

    import attrs

    from dflash_flow.app.profile import profile
    from dflash_flow.app.splitplan import predict
    from dflash_flow.core import validated

    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, sorted(before)[:cores])
    try:
        one = profile(validated(common.hash_graph(out, 1, cores, 4)), steps, warmup_steps=5, interval_s=0.02)
        pred = predict(one, {"a": cores})
        plain_stages = {n: attrs.evolve(st, cpu_s_per_batch=None, cpu_wait_s_per_batch=None) for n, st in one.stages.items()}
        plain = predict(attrs.evolve(one, stages=plain_stages, cpu_s_per_batch=None), {"a": cores})
        two = profile(validated(common.hash_graph(out, cores, cores, 4)), steps, warmup_steps=5, interval_s=0.02)
    finally:
        os.sched_setaffinity(0, before)
    return {"cores": cores, "measured_batches_per_s": two.batches_per_s, "predicted": pred.batches_per_s,
            "predicted_without_cpu_figures": plain.batches_per_s,
            "error": _error(pred.batches_per_s, two.batches_per_s),
            "error_without_cpu_figures": _error(plain.batches_per_s, two.batches_per_s)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from dflash_flow.app.profile import to_json
    from dflash_flow.app.splitplan import confidence, noise_notes, plan_splits, recommend

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=common.RESULTS / "profile.json")
    ap.add_argument("--sleep-steps", type=int, default=150)
    ap.add_argument("--sleep-jitter", type=float, default=JITTER, help="a's and b's sleeps uniform in cost * (1 +- this)")
    ap.add_argument("--windows", type=int, default=WINDOWS, help="Parts of each profile's window (the interval's)")
    ap.add_argument("--embedded-steps", type=int, default=25)
    ap.add_argument("--embedded-reps", type=int, default=4, help="Runs of each setting, alternating")
    ap.add_argument("--noise-s", type=float, default=10.0, help="Seconds of the machine's noise floor (0: none)")
    ap.add_argument("--no-embedded", action="store_true", help="Only the sleep-stage validation.")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"machine": common.machine()}
    if args.noise_s > 0:
        result["noise_floor"] = noise_floor(args.noise_s)
    result["sleep"] = validate_sleep(args.sleep_steps, jitter=args.sleep_jitter, windows=args.windows)
    result["contention"] = contention_check(common.SCRATCH / "profile-bench-hash")
    if not args.no_embedded:
        embedded, profiles = validate_embedded(args.embedded_steps, common.SCRATCH / "profile-bench", args.embedded_reps,
                                               args.windows)
        result["embedded"] = embedded
        prof = profiles[2]
        scale = _scale()
        allreduce = float(scale["allreduce_wait_s_per_step"]) if scale else 0.0
        if scale is not None:
            result["data_parallel"] = data_parallel_check(profiles[1], scale)
        splits = plan_splits(prof, 8, allreduce_at_two=allreduce)
        chosen = recommend(splits)
        result["plan"] = {
            "gpus": 8,
            "allreduce_s_at_two": allreduce,
            "rows": [{**{k: getattr(s, k) for k in ("ranks", "targets_per_rank", "padders_per_rank", "gpus_used",
                                                     "limit", "steps_per_s", "samples_per_s")},
                      "samples_per_s_interval": _iv(s.interval)} for s in splits],
            "recommended": {"ranks": chosen.ranks, "targets_per_rank": chosen.targets_per_rank},
            "recommended_with_confidence": confidence(prof, chosen),
            "notes": noise_notes(prof, splits, chosen),
        }
        prof_json = to_json(prof)
        prof_json.pop("queues", None)  # the series is long; `dflash-flow profile` writes it
        result["profile"] = prof_json
    result["seconds"] = round(time.perf_counter() - t0, 1)
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
