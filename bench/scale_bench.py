"""Scale benchmark: the embedded pipeline with 1 and 2 data-parallel ranks on CPU, same global batch.

Writes bench/results/scale.json (also printed). Two real runs of ``dflash-flow run pipelines/dflash.yaml``:

* ``one``: one process, ``grad_accum`` 2, ``2 N`` batches: N optimizer steps of 2 micro-batches;
* ``two``: ``--nproc 2`` (torchrun, gloo), ``grad_accum`` 1, N batches per rank: N steps of the same 2
  batches (one per rank). Each rank has 1 TargetForward replica (``one`` has 2), so both run the same
  target threads in all.

Both give the drafter ``torch_threads`` 1: with 2 intra-op threads on two shared cores the drafter's step
was 3-10x slower on a loaded machine (bench/e2e_bench.py measures it), which would make the comparison
one of thread settings. So ``one`` trains on one drafter thread, ``two`` on two (one per rank).

Steps/s is the steady rate between the Monitor's samples (``monitor/history.json``: step and time of each
sample) after ``WARMUP`` steps. The all-reduce wait is the trainer's ``allreduce_wait_s`` step metric:
a DDP comm hook around the default all-reduce (``model.optim.timed_allreduce_hook``) notes when the
last gradient bucket was handed over and when the last all-reduce completed; their difference is the
wait the step could not hide behind compute (the slower rank's lag included). The Monitor reduces it over
ranks with ``max`` (the slowest rank's wait sets the step). On two shared cores two ranks are not faster:
the ratio is reported as measured.

Usage: python bench/scale_bench.py [--out FILE] [--steps 12]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

WARMUP = 3
# The workload the figures in docs/benchmarks.md were measured on: 2,048-token micro-batches (the shipped
# recipe now trains 1,024-token ones, whose steps are too short for 0.5 s Monitor samples to time).
SHORT_EVAL = ["stages.evaluate.limit=1", "stages.evaluate.max_new_tokens=8", "stages.evaluate.baseline=false",
              "stages.evaluate.walk_data=null", "stages.evaluate.temperatures=[0.0]",
              "stages.bucketer.max_tokens=2048", "stages.monitor.interval_s=0.5"]


def steady_rate(samples: list[dict[str, Any]], warmup: int) -> float:
    """Steps per second between the first Monitor sample at or after ``warmup`` steps and the first one at
    the last step (later samples at that step are the end of the run: evaluation, wind-down)."""
    first: dict[int, float] = {}
    for s in samples:
        if not s.get("whole_run") and s["step"] >= warmup:
            first.setdefault(s["step"], s["elapsed_s"])
    points = sorted(first.items())
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        raise RuntimeError(f"too few Monitor samples after step {warmup} to measure a rate: {points}")
    (s0, t0), (s1, t1) = points[0], points[-1]
    return (s1 - s0) / (t1 - t0)


def run_one(out: Path, steps: int, nproc: int | None, extra: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "dflash_flow.cli", "run", str(common.DFLASH_YAML)]
    if nproc:
        cmd += ["--nproc", str(nproc)]
    for item in common.embedded_overrides(out, *SHORT_EVAL, *extra):
        cmd += ["--set", item]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    history = json.loads((out / "monitor" / "history.json").read_text())
    train = history["train"]
    wait = [x for s, x in zip(train["step"], train.get("allreduce_wait_s", []), strict=False)
            if s > WARMUP and x is not None and math.isfinite(x)]
    rate = steady_rate(history["samples"], WARMUP)
    return {
        "steps": int(max(train["step"])),
        "steps_per_s": round(rate, 4),
        "wall_s": round(wall, 1),
        "allreduce_wait_s_per_step": round(statistics.fmean(wait), 4) if wait else None,
        "allreduce_wait_frac": round(statistics.fmean(wait) * rate, 4) if wait else None,
        "overrides": extra,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=common.RESULTS / "scale.json")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    n = args.steps
    root = common.SCRATCH / "scale-bench"
    one = run_one(root / "one", n, None, [f"stages.interleaver.max_batches={2 * n}", "stages.drafter.grad_accum=2",
                                           "stages.drafter.torch_threads=1"])
    two = run_one(root / "two", n, 2, [f"stages.interleaver.max_batches={n}", "stages.drafter.grad_accum=1",
                                        "stages.target.replicas=1", "stages.padder.replicas=1",
                                        "stages.drafter.torch_threads=1"])
    result = {
        "machine": common.machine(),
        "global_batch": "2 micro-batches per optimizer step (one process x grad_accum 2, or 2 ranks x 1)",
        "one_process": one,
        "two_ranks": two,
        "two_over_one": round(two["steps_per_s"] / one["steps_per_s"], 3),
        "allreduce_wait_s_per_step": two["allreduce_wait_s_per_step"],
    }
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
