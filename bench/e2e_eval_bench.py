"""The embedded default's evaluation, one prompt at a time against batched (issue 39.2): ``eval_s`` before and
after beside the acceptance, and whether every figure but the wall-clock ones is the same.

The drafter: ``--drafter DIR`` (an exported drafter of the default, e.g. ``runs/dflash-cpu/drafter``), else
this command trains one first (``dflash-flow run pipelines/dflash.yaml``, no tracking; its wall seconds are
recorded too). The evaluation is the default's own: ``SpecDecodeEval.evaluation_settings`` of the
``evaluate`` stage in ``pipelines/dflash.yaml`` (16 prompts greedy and at T = 1, the walk on 64 replies at 64
and 448 tokens), with its torch threads, run in this process with ``batch_size`` 1 (``before``: the loop
of main before batching) and the stage's ``batch_size`` (``after``: prompts decoded together, the walk's target
forwards on a second thread beside decoding), alternating, ``--pairs`` times after one untimed warm-up; the
figures are the medians (``cpu_before_over_after`` the CPU seconds' ratio: ``after`` uses the second core).
Writes ``bench/results/e2e_eval.json`` with the load average before and after.

Usage: python bench/e2e_eval_bench.py [--drafter DIR] [--pairs 2] [--set KEY=VALUE ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

#: Figures that time the run (the rest must not depend on the batch).
WALL = ("greedy_s", "spec_s", "speedup_wall")


def train_default(out: Path, sets: list[str]) -> tuple[Path, float]:
    cmd = [sys.executable, "-m", "dflash_flow", "run", str(common.DFLASH_YAML)]
    for o in common.embedded_overrides(out, *sets):
        cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"training the default failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return out / "drafter", wall


def _figures(reports) -> list[dict[str, Any]]:
    return [{"name": r.name, "temperature": r.temperature, "lossless": r.lossless,
             "metrics": {k: v for k, v in r.metrics.items() if k not in WALL}, "by_horizon": r.by_horizon}
            for r in reports]


def _acceptance(reports) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in reports:
        key = r.name if not r.temperature else f"{r.name}-T{r.temperature:g}"
        out[key] = {"tau": round(r.metrics["tau"], 4),
                    **{f"tau_h{h}": round(f["tau"], 4) for h, f in r.by_horizon.items()}}
        if r.lossless is not None:
            out[key]["lossless"] = r.lossless
    return out


def evaluate(stage, spec, drafter: Path, out: Path, batch_size: int) -> tuple[float, float, list]:
    """The stage's evaluation of ``drafter`` at ``batch_size``: wall and CPU seconds, the reports."""
    import torch

    from dflash_flow.model.evaluation import evaluate_exported

    settings = stage.evaluation_settings(spec, out) | {"batch_size": batch_size}
    torch.set_num_threads(stage.torch_threads or torch.get_num_threads())
    t0, c0 = time.perf_counter(), time.process_time()
    reports = evaluate_exported(drafter_path=drafter, seed=0, device="cpu", **settings)
    return time.perf_counter() - t0, time.process_time() - c0, reports


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--drafter", type=Path, help="an exported drafter of the default (else train one first)")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--set", dest="sets", action="append", default=[], help="override for the default's run")
    ap.add_argument("--out", type=Path, default=common.RESULTS / "e2e_eval.json")
    args = ap.parse_args(argv)
    from dflash_flow.app import model_services

    root = common.SCRATCH / "e2e-eval"
    load_start = [round(x, 2) for x in os.getloadavg()]
    run_wall = None
    drafter = args.drafter
    if drafter is None:
        drafter, run_wall = train_default(root / "run", args.sets)
    v = common.embedded_validated(root / "eval", *args.sets)
    stage, spec = v.configs["evaluate"], model_services(v).model
    after_bs = stage.batch_size
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
    figures: dict[str, Any] = {}
    evaluate(stage, spec, drafter, root / "eval", after_bs)  # warm-up, untimed: the first evaluation in a process
    # pays one-time costs (imports, kernels) that would otherwise fall on the first "before"
    for _ in range(args.pairs):
        for side, bs in (("before", 1), ("after", after_bs)):
            wall, cpu, reports = evaluate(stage, spec, drafter, root / "eval", bs)
            runs[side].append({"eval_s": round(wall, 2), "cpu_s": round(cpu, 2),
                               "load_avg": [round(x, 2) for x in os.getloadavg()]})
            figures.setdefault(side, []).append(_figures(reports))
            acceptance = _acceptance(reports)
    same = all(f == figures["before"][0] for side in figures.values() for f in side)
    before = statistics.median(r["eval_s"] for r in runs["before"])
    after = statistics.median(r["eval_s"] for r in runs["after"])
    result = {
        "bench": "e2e_eval",
        "machine": common.machine(),
        "config": {"pipeline": "pipelines/dflash.yaml", "stage": "evaluate", "batch_size_after": after_bs,
                   "drafter": str(drafter), "overrides": args.sets, "pairs": args.pairs},
        "eval_s": {"before": before, "after": after},
        "before_over_after": round(before / after, 3),
        "cpu_before_over_after": round(statistics.median(r["cpu_s"] for r in runs["before"])
                                       / statistics.median(r["cpu_s"] for r in runs["after"]), 3),
        "same_numbers": same,
        "acceptance": acceptance,
        "run_wall_s": round(run_wall, 1) if run_wall is not None else None,
        "load_avg": {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]},
        "targets": {"before_over_after": ">= 3", "same_numbers": True},
        "runs": runs,
    }
    if not same:
        result["figures"] = figures
    return common.write_result(args.out, json.loads(json.dumps(result, default=str)))


if __name__ == "__main__":
    main()
