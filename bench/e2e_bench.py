"""End-to-end benchmark: the embedded pipeline against a plain sequential loop doing the same work.

Writes bench/results/e2e.json (also printed). Both sides train ``pipelines/dflash.yaml`` shortened (no
tracking) on the same batches with the same models:

* ``pipelined``: the DAG on the runtime, measured by ``app.profile.profile`` (a window of ``--steps``
  steps after ``WARMUP``; setup and the first steps' lazy initialisation excluded);
* ``sequential``: the same stage objects (same configs, seeds, code, torch thread settings) called one
  after another in one thread: source, bucketer, interleaver, then per batch padder -> target forward ->
  drafter step. Its window: from the start of batch ``WARMUP`` to the start of batch ``WARMUP + steps``.

Runs alternate (sequential, pipelined, sequential, ...) so that drift on a shared machine hits both. The
figures: real tokens trained per second over the window (median over pairs), their ratio, and the
fraction of the pipelined window the drafter waited for data (its ``blocked_in``). Targets on CPU:
ratio >= 1.0, data wait < 5%.

Usage: python bench/e2e_bench.py [--out FILE] [--steps 20] [--pairs 2] [--set KEY=VALUE ...]
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


def _contexts(v, out: Path) -> dict[str, Any]:
    """One fresh stage object per loop stage, set up on this thread as its replica 0 would be."""
    from dflash_flow.core.metrics import MetricSet
    from dflash_flow.core.stage import StageContext
    from dflash_flow.services import RunServices

    services = RunServices()
    out.mkdir(parents=True, exist_ok=True)
    stages = {}
    for name in LOOP_STAGES:
        cls = v.classes[name]
        cls.preload()
        stage = copy.deepcopy(v.configs[name])
        ctx = StageContext(name=name, seed=v.graph.seed, output_dir=out, services=services, metrics=MetricSet(),
                           downstream_devices=["cpu"])
        stage.setup(ctx)
        stages[name] = stage
    return stages


def _threads(stage) -> None:
    """The stage's own torch thread setting, as its replica thread in the pipeline has it."""
    import torch

    n = getattr(stage, "torch_threads", None)
    if n:
        torch.set_num_threads(n)


def _loop(v, out: Path, steps: int, starts: list[float], tokens: list[int]) -> None:
    stages = _contexts(v, out)
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
                _threads(target)
                (feats,) = target.process(padded)
                _threads(drafter)
                drafter.process(feats)
    finally:
        for stage in stages.values():
            stage.teardown()


def sequential(v, out: Path, steps: int) -> dict[str, Any]:
    """The same work in one thread (not the main thread: see docs/benchmarks.md, as the stages run on
    threads of their own), each stage with its own torch thread setting; tokens/s over the window of
    ``steps`` batches after ``WARMUP``."""
    import threading

    starts: list[float] = []
    tokens: list[int] = []
    errors: list[BaseException] = []

    def body() -> None:
        try:
            _loop(v, out, steps, starts, tokens)
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=common.RESULTS / "e2e.json")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="An override for both sides.")
    args = ap.parse_args(argv)
    root = common.SCRATCH / "e2e-bench"
    extra = [f"stages.interleaver.max_batches={WARMUP + args.steps + 8}", *args.overrides]
    seq_runs, pipe_runs = [], []
    for i in range(args.pairs):
        seq_runs.append(sequential(common.embedded_validated(root / f"seq{i}", *extra), root / f"seq{i}", args.steps))
        pipe_runs.append(pipelined(common.embedded_validated(root / f"pipe{i}", *extra), args.steps))
    seq_tps = statistics.median(r["tokens_per_s"] for r in seq_runs)
    pipe_tps = statistics.median(r["tokens_per_s"] for r in pipe_runs)
    ratios = [p["batches_per_s"] / s["batches_per_s"] for s, p in zip(seq_runs, pipe_runs, strict=True)]
    wait = statistics.median(r["drafter_data_wait"] for r in pipe_runs)
    result = {
        "machine": common.machine(),
        "config": {"pipeline": "pipelines/dflash.yaml", "overrides": extra, "steps": args.steps, "warmup": WARMUP},
        "sequential_tokens_per_s": seq_tps,
        "pipelined_tokens_per_s": pipe_tps,
        "pipelined_over_sequential": round(pipe_tps / seq_tps, 3),
        "pair_ratios_batches_per_s": [round(x, 3) for x in ratios],
        "drafter_data_wait": wait,
        "targets": {"pipelined_over_sequential": ">= 1.0", "drafter_data_wait": "< 0.05"},
        "met": {"ratio": pipe_tps / seq_tps >= 1.0, "data_wait": wait < 0.05},
        "runs": {"sequential": seq_runs, "pipelined": pipe_runs},
    }
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
