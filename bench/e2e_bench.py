"""End-to-end benchmark: the embedded pipeline against a plain sequential loop doing the same work.

Writes bench/results/e2e.json (also printed). Both sides train ``pipelines/dflash.yaml`` shortened (no
tracking) on the same batches with the same models:

* ``pipelined``: the DAG on the runtime, measured by ``app.profile.profile`` (a window of ``--steps``
  steps after ``WARMUP``; setup and the first steps' lazy initialisation excluded);
* ``sequential``: the same stage objects (same configs, seeds, code, torch thread settings) called one
  after another in one thread: source, bucketer, interleaver, then per batch padder -> target forward ->
  drafter step. Its window: from the start of batch ``WARMUP`` to the start of batch ``WARMUP + steps``.

Both sides train the same batches (``record_batches``: the first ``WARMUP + steps`` lines of every
run's batches.jsonl must be equal). Two thread settings: ``default`` (each stage's own ``torch_threads``: 1 per target replica, 2 for the
drafter) and ``one_thread`` (1 everywhere). Runs alternate (sequential, pipelined, sequential, ...) so that
drift on a shared machine hits both. The figures: real tokens trained per second over the window (median
over pairs), their ratio, the default pipeline against the best sequential loop, and the fraction of the
pipelined window the drafter waited for data (its ``blocked_in``). Targets on CPU: ratio >= 1.0, data wait
< 5%.

Usage: python bench/e2e_bench.py [--out FILE] [--steps 12] [--pairs 1] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from pathlib import Path
from typing import Any

import common

WARMUP = 2
LOOP_STAGES = ("source", "bucketer", "interleaver", "padder", "target", "drafter")


def stage_objects(v, out: Path, names: tuple[str, ...] = LOOP_STAGES) -> dict[str, Any]:
    """One fresh stage object per named stage, set up on this thread as its replica 0 would be."""
    from dflash_flow.app import model_services
    from dflash_flow.core.metrics import MetricSet
    from dflash_flow.core.stage import StageContext

    services = model_services(v)
    out.mkdir(parents=True, exist_ok=True)
    stages = {}
    for name in names:
        cls = v.classes[name]
        cls.preload()
        stage = copy.deepcopy(v.configs[name])
        ctx = StageContext(name=name, seed=v.graph.seed, output_dir=out, services=services, metrics=MetricSet(),
                           downstream_devices=["cpu"])
        stage.setup(ctx)
        stages[name] = stage
    return stages


def _threads(stage, force: int | None) -> None:
    """``force`` torch threads, else the stage's own setting, as its replica thread in the pipeline has it."""
    import torch

    n = force or getattr(stage, "torch_threads", None)
    if n:
        torch.set_num_threads(n)


def _loop(v, out: Path, steps: int, starts: list[float], tokens: list[int], force: int | None) -> None:
    stages = stage_objects(v, out)
    source, bucketer, interleaver, padder, target, drafter = (stages[n] for n in LOOP_STAGES)
    need = WARMUP + steps + 1
    try:
        for sample in source.produce():
            bucketer.process(sample)
        for epoch in bucketer.finish():
            for planned in interleaver.process(epoch):
                starts.append(time.perf_counter())
                tokens.append(planned.meta.real_tokens)
                if len(starts) >= need:
                    return
                (padded,) = padder.process(planned)
                _threads(target, force)
                (feats,) = target.process(padded)
                _threads(drafter, force)
                drafter.process(feats)
    finally:
        for stage in stages.values():
            stage.teardown()


def sequential(v, out: Path, steps: int, threads: int | None = None) -> dict[str, Any]:
    """The same work in one thread (not the main thread: see docs/benchmarks.md, as the stages run on
    threads of their own), each stage with its own torch thread setting; tokens/s over the window of
    ``steps`` batches after ``WARMUP``. ``threads``: the same torch threads for every stage instead."""
    import threading

    starts: list[float] = []
    tokens: list[int] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            _loop(v, out, steps, starts, tokens, threads)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    t = threading.Thread(target=body, name="e2e-sequential")
    t.start()
    t.join()
    if errors:
        raise errors[0]
    need = WARMUP + steps + 1
    if len(starts) < need:
        raise RuntimeError(f"the plan had only {len(starts)} batches; {need} needed")
    window = starts[WARMUP + steps] - starts[WARMUP]
    real = sum(tokens[WARMUP:WARMUP + steps])
    return {"batches": steps, "window_s": round(window, 3), "batches_per_s": round(steps / window, 4),
            "tokens_per_s": round(real / window, 1)}


def pipelined(v, steps: int) -> dict[str, Any]:
    from dflash_flow.app.profile import profile

    p = profile(v, steps, warmup_steps=WARMUP, interval_s=0.05)
    d = p.stage("drafter")
    return {"batches": p.batches, "window_s": round(p.window_s, 3), "batches_per_s": round(p.batches_per_s, 4),
            "tokens_per_s": round(p.tokens_per_s or 0.0, 1), "drafter_data_wait": round(d.blocked_in, 4),
            "drafter_busy": round(d.busy, 4), "bottleneck": p.bottleneck.stage if p.bottleneck else None,
            "target_busy": round(p.stage("target").busy, 4)}


def _trained(out: Path, n: int) -> list[str]:
    """The first ``n`` batches the drafter trained (``record_batches``: epoch, index, sample ids)."""
    lines = (out / "batches.jsonl").read_text().splitlines()
    if len(lines) < n:
        raise AssertionError(f"{out}: the drafter trained {len(lines)} batches, {n} expected")
    return lines[:n]


# (label, side, overrides for both the graph, torch threads forced on the sequential loop)
VARIANTS = [
    ("default", "sequential", [], None),
    ("default", "pipelined", [], None),
    ("one_thread", "sequential", [], 1),
    ("one_thread", "pipelined", ["stages.drafter.torch_threads=1"], None),
]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=common.RESULTS / "e2e.json")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="An override for both sides.")
    args = ap.parse_args(argv)
    root = common.SCRATCH / "e2e-bench"
    extra = [f"stages.interleaver.max_batches={WARMUP + args.steps + 8}", "stages.drafter.record_batches=true",
             *args.overrides]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    trained: list[list[str]] = []
    for i in range(args.pairs):
        for label, side, more, threads in VARIANTS:
            out = root / f"{label}-{side}-{i}"
            v = common.embedded_validated(out, *extra, *more)
            r = sequential(v, out, args.steps, threads) if side == "sequential" else pipelined(v, args.steps)
            runs.setdefault(label, {}).setdefault(side, []).append(r)
            trained.append(_trained(out, WARMUP + args.steps))
    if any(t != trained[0] for t in trained):
        raise AssertionError("the runs trained different batches")
    figures = {}
    for label, sides in runs.items():
        seq = statistics.median(r["tokens_per_s"] for r in sides["sequential"])
        pipe = statistics.median(r["tokens_per_s"] for r in sides["pipelined"])
        wait = statistics.median(r["drafter_data_wait"] for r in sides["pipelined"])
        figures[label] = {"sequential_tokens_per_s": seq, "pipelined_tokens_per_s": pipe,
                          "pipelined_over_sequential": round(pipe / seq, 3), "drafter_data_wait": wait}
    best_seq = max(f["sequential_tokens_per_s"] for f in figures.values())
    d = figures["default"]
    result = {
        "machine": common.machine(),
        "config": {"pipeline": "pipelines/dflash.yaml", "overrides": extra, "steps": args.steps, "warmup": WARMUP,
                   "one_thread": "every stage with torch_threads 1 (the sequential loop; the pipelined drafter)"},
        **{k: v for k, v in d.items()},
        "default_over_best_sequential": round(d["pipelined_tokens_per_s"] / best_seq, 3),
        "same_batches": True,
        "variants": figures,
        "targets": {"pipelined_over_sequential": ">= 1.0", "drafter_data_wait": "< 0.05"},
        "met": {"ratio": d["pipelined_tokens_per_s"] / best_seq >= 1.0, "data_wait": d["drafter_data_wait"] < 0.05},
        "runs": runs,
    }
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
