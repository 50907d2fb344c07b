"""``just bench``: every benchmark, one after another, each in its own process; what each needs is fetched
or installed first (``bench/peers.py``: the SpecForge wheel by hash, the torchdata extra), or the command
fails at once naming the one command that would (never a silent skip, never 15 minutes in).

    python bench/run_all.py            # the default set, ~15 min on our 2-core box
    python bench/run_all.py --long     # also the long comparisons (~1 h more): same-data training against
                                       # SpecForge, the DFlash / DFlash 2 / variable-prefix variants, data at
                                       # scale and the 1M-conversation pipeline
    python bench/run_all.py --only peer_step,e2e

Each benchmark writes ``bench/results/NAME.json``; this driver adds to every file it wrote a ``run`` entry:
the command, its wall seconds, and the machine's load average (1, 5, 15 min) before and after it (figures
measured under load are ratios in one process; the load says how far to trust them). The whole run's
record goes to ``bench/results/bench_run.json``. Exit status 1 when a benchmark failed (the others still run).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import attrs

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


@attrs.frozen
class Bench:
    name: str
    args: tuple[str, ...]  # script and its arguments, relative to bench/
    results: tuple[str, ...]  # the files under bench/results/ it writes
    minutes: float  # about, on our 2-core box
    long: bool = False
    needs: tuple[str, ...] = ()  # "specforge", "torchdata"


# Order matters: scale before profile (the split plan reads the all-reduce wait scale.json measured).
#: Result files under bench/results written by other commands than these benchmarks (and who writes them).
WRITTEN_ELSEWHERE = {"interop.json": "interop/check.py (just interop)",
                     "regenerate_vllm.json": "interop/regenerate_check.py (just interop)",
                     "engine_target.json": "interop/engine_target_check.py (just interop)",
                     "eval_vllm.json": "interop/eval_check.py (just interop)"}

BENCHES = (
    Bench("runtime", ("runtime_bench.py",), ("runtime.json",), 0.3),
    Bench("batching", ("batching_bench.py",), ("batching.json",), 0.1),
    Bench("model", ("model_bench.py",), ("model.json",), 3),
    Bench("monitor", ("monitor_bench.py",), ("monitor.json",), 0.7),
    # One intra-op thread: the figures the README quotes (two threads swing by 2-10x on a shared box).
    Bench("peer_step", ("peer_step.py", "--threads", "1"), ("peer_step.json",), 3, needs=("specforge",)),
    Bench("scale", ("scale_bench.py",), ("scale.json",), 2.5),
    Bench("profile", ("profile_bench.py",), ("profile.json",), 2),
    Bench("e2e", ("e2e_bench.py",), ("e2e.json",), 1.5),
    Bench("fanout", ("fanout_bench.py",), ("fanout.json",), 1),
    Bench("torchdata", ("torchdata_bench.py",), ("torchdata.json",), 0.6, needs=("torchdata",)),
    Bench("anchors_cost", ("anchors_cost.py",), ("anchors_cost.json",), 1),
    # The store read against the disk, bytes per token, offline == online, a 100k-sample build by 2 ranks (long
    # only while the default set's 16-minute cap has no room: tests/bench/test_bench_driver.py).
    Bench("feature_store", ("feature_store_bench.py",), ("feature_store.json",), 4, long=True),
    Bench("peer_step_compile", ("peer_step.py", "--threads", "1", "--compile", "--out",
                                "bench/results/peer_step_compile.json"), ("peer_step_compile.json",), 6,
          long=True, needs=("specforge",)),
    Bench("data_scale", ("data_scale_bench.py",), ("data_scale.json",), 7, long=True),
    Bench("data_scale_pipeline", ("data_scale_bench.py", "--pipeline", "1000000"), ("data_scale_pipeline.json",), 25,
          long=True),
    Bench("peer_train", ("peer_train.py",), ("peer_train.json",), 15, long=True, needs=("specforge",)),
    Bench("variants", ("variants_bench.py",), ("variants.json",), 13, long=True),
    # bf16 / fp8 stores against fp32 in acceptance, hybrid against the in-memory cache (the embedded default, 6 runs).
    Bench("feature_store_tau", ("feature_store_bench.py", "--tau"), ("feature_store_tau.json",), 20, long=True),
    # In-process regeneration: batched replies/s over one at a time, the same replies (issue 39.1).
    Bench("regen", ("regen_bench.py",), ("regen.json",), 12, long=True),
    # The default trained, then its evaluation one prompt at a time against batched (issue 39.2).
    Bench("e2e_eval", ("e2e_eval_bench.py",), ("e2e_eval.json",), 5, long=True),
    # The default trained, then z-lab's decoder on fresh held-out prompts (issue 39.4).
    Bench("heldout_zlab", ("heldout_zlab.py", "--train"), ("heldout_zlab.json",), 4, long=True),
)


def load_avg() -> list[float] | None:
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None


def selected(long: bool, only: str | None) -> list[Bench]:
    if only:
        names = [n.strip() for n in only.split(",") if n.strip()]
        known = {b.name for b in BENCHES}
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SystemExit(f"run_all: unknown benchmark(s) {unknown}; known: {sorted(known)}")
        return [b for b in BENCHES if b.name in names]
    return [b for b in BENCHES if long or not b.long]


def prepare(benches: list[Bench]) -> dict[str, str]:
    """Fetch / install what the selected benchmarks need, before any of them runs."""
    import peers

    ready = {}
    needs = {n for b in benches for n in b.needs}
    if "specforge" in needs:
        ready["specforge"] = str(peers.ensure_specforge())
    if "torchdata" in needs:
        ready["torchdata"] = peers.ensure_torchdata()
    return ready


def stamp(path: Path, run: dict) -> bool:
    """Add ``run`` to a result file written by this command (False when it was not written now)."""
    if not path.is_file() or path.stat().st_mtime < run["started_unix"]:
        return False
    data = json.loads(path.read_text())
    data["run"] = run
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return True


def run_one(b: Bench) -> dict:
    cmd = [sys.executable, *(str(HERE / b.args[0]),), *b.args[1:]]
    shown = "python bench/" + " ".join(shlex.quote(a) for a in b.args)
    print(f"\n=== {b.name}: {shown} (~{b.minutes:g} min)", flush=True)
    run = {"command": shown, "started_unix": int(time.time()), "load_avg_before": load_avg()}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=HERE.parent)
    run.update(wall_s=round(time.perf_counter() - t0, 1), load_avg_after=load_avg(), returncode=proc.returncode)
    written = [name for name in b.results if stamp(RESULTS / name, run)]
    ok = proc.returncode == 0 and len(written) == len(b.results)
    missing = sorted(set(b.results) - set(written))
    if proc.returncode == 0 and missing:
        print(f"run_all: {b.name} exited 0 but did not write {missing}", file=sys.stderr)
    return {"name": b.name, **run, "ok": ok, "written": written}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--long", action="store_true", help="also the long comparisons (~1 h more)")
    ap.add_argument("--only", help="comma-separated benchmark names (default: the default set, or all with --long)")
    ap.add_argument("--list", action="store_true", help="print the benchmarks and exit")
    args = ap.parse_args(argv)
    benches = selected(args.long, args.only)
    if args.list:
        for b in BENCHES:
            print(f"{b.name:20} ~{b.minutes:>4g} min  {'long' if b.long else 'default':7}  bench/{' '.join(b.args)}")
        return 0
    import peers

    try:
        ready = prepare(benches)
    except peers.Missing as exc:
        print(f"run_all: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    record = {"long": args.long, "only": args.only, "peers": ready, "load_avg_at_start": load_avg(), "benches": []}
    for b in benches:
        record["benches"].append(run_one(b))
    record.update(wall_s=round(time.perf_counter() - t0, 1), load_avg_at_end=load_avg())
    failed = [r["name"] for r in record["benches"] if not r["ok"]]
    record["failed"] = failed
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "bench_run.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nrun_all: {len(benches) - len(failed)}/{len(benches)} benchmarks ok in {record['wall_s'] / 60:.1f} min"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
