"""DFlash, DFlash 2 and the variable-prefix objective on the embedded setup: same data, batches, steps,
schedule and seed; held-out acceptance at T = 0 and T = 1 and the drafter's step time.

Each variant is one ``dflash-flow run pipelines/dflash1.yaml`` (the DFlash recipe; no tracking, evaluation included, the
recipe as shipped unless ``--set`` changes it), one after another in this command. From each run's
``monitor/summary.json`` and ``monitor/history.json``: real speculative decoding of the trained drafter on
the held-out prompts (greedy, lossless-checked, and sampled at T = 1), the teacher-forced walk at its
horizons, and seconds per optimizer step over the steady part of training (Monitor samples after the first
10% of the steps). ``default`` is ``pipelines/dflash.yaml`` as shipped (the DFlash 2 default: the README's
"embedded default" row, its acceptance and whole-run wall). Writes ``bench/results/variants.json``.

Usage: python bench/variants_bench.py [--variants dflash,dflash2,variable_prefix,default] [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

VARIANTS: dict[str, list[str]] = {
    "dflash": [],
    "dflash2": ["stages.drafter.variant=dflash2"],
    "variable_prefix": ["stages.drafter.objective=variable_prefix"],
}
#: Variants of another pipeline than the DFlash recipe: the embedded default as shipped (DFlash 2, 5 epochs of 32 anchors).
PIPELINES = {"default": common.DFLASH_YAML}
VARIANTS["default"] = []


def step_seconds(history: dict[str, Any]) -> float | None:
    samples = [s for s in history.get("samples", []) if not s.get("whole_run") and s.get("step")]
    if len(samples) < 3:
        return None
    last = samples[-1]
    first = next((s for s in samples if s["step"] >= 0.1 * last["step"]), samples[0])
    if last["step"] <= first["step"]:
        return None
    return (last["elapsed_s"] - first["elapsed_s"]) / (last["step"] - first["step"])


def run_variant(name: str, extra: list[str], sets: list[str]) -> dict[str, Any]:
    out = common.SCRATCH / "variants" / name
    overrides = [*common.embedded_overrides(out), *extra, *sets]
    cmd = [sys.executable, "-m", "dflash_flow", "run", str(PIPELINES.get(name, common.DFLASH1_YAML))]
    for o in overrides:
        cmd += ["--set", o]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"variant": name, "error": proc.stderr[-3000:]}
    summary = json.loads((out / "monitor" / "summary.json").read_text())
    history = json.loads((out / "monitor" / "history.json").read_text())
    evals = summary.get("eval") or {}
    # summary.json holds each evaluation typed: facts as fields, figures per horizon under "by_horizon".
    def pick(res: dict[str, Any]) -> dict[str, Any]:
        out = {m: res["metrics"][m] for m in ("tau", "speedup_forwards") if m in res.get("metrics", {})}
        out.update({f"tau_h{h}": f["tau"] for h, f in res.get("by_horizon", {}).items() if h in ("64", "448")})
        return out | ({"lossless": res["lossless"]} if "lossless" in res else {})

    return {
        "variant": name,
        "overrides": extra,
        "wall_s": round(wall, 1),
        "steps": summary.get("step"),
        "s_per_step": round(step_seconds(history) or float("nan"), 4),
        "eval": {k: pick(res) for k, res in evals.items()},
        "final_epoch_mean": {
            k: round(v, 4) for k, v in (summary.get("epoch_mean_train_metrics") or {}).items()
            if k in ("loss", "accuracy", "sim_accept_len", "sim_accept_len_prefix1")
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--set", action="append", default=[], help="pipeline override KEY=VALUE (all variants)")
    parser.add_argument("--out", default=str(common.RESULTS / "variants.json"))
    args = parser.parse_args(argv)
    results = [run_variant(n, VARIANTS[n], args.set) for n in args.variants.split(",")]
    return common.write_result(Path(args.out), {
        "bench": "variants", "machine": common.machine(), "overrides": args.set, "results": results,
    })


if __name__ == "__main__":
    main()
