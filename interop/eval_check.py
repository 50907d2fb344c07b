"""``dflash-flow eval --suite`` against a real vLLM server (vLLM's CPU build): the engine's acceptance equal to
ours on the same prompts, per suite and per draft position.

    python interop/eval_check.py                  # train a short DFlash drafter (~4 min), then check it
    python interop/eval_check.py --export DIR     # check an existing DFlash export (and --target DIR)

1. vLLM in its own environment (``interop/check.py``'s lock and ``ensure_venv``).
2. A DFlash (v1) export: ``--export``, or ``pipelines/dflash1.yaml`` for 2 epochs (``check.train_export``);
   vLLM's CPU runner decodes DFlash 1 only.
3. Two suites in their published formats, written here from the embedded held-out prompts: gsm8k
   (``question``/``answer``: the word problems) and mt-bench (FastChat's ``turns``: two prompts per record,
   the second asked after the target's own first reply).
4. ``dflash-flow eval --suite ... --server URL`` against a vLLM server started here (``engine.launch``) with
   ``DFlashQwen3Model._normalize_context_k`` normed per layer (``interop/vllm_serve.py``): with that one
   function fixed vLLM drafts exactly what we draft (``just interop``), so its counters must equal our count
   per suite and per position, exactly (tolerances 0). Check: exit 0, every suite's agreement, the engine's
   outputs equal ours, the counters' drafts equal the per-request figures' steps.
5. ``dflash-flow eval --suite ... --launch-vllm PYTHON``: vLLM as shipped, started and stopped by the command
   itself; its figures beside ours (the CPU k_norm bug makes its drafts differ; whether the check flags
   that depends on how far the drafter's layers drifted apart). Reported, not a failure. ``--no-as-shipped``
   skips it.

Writes ``bench/results/eval_vllm.json`` (the command, wall time, load; both runs' results) and prints the
figures; exit 1 when a check fails, 2 when it cannot run. Everything heavy runs niced.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (ROOT, ROOT / "bench", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from check import Failed, ensure_venv, say, train_export  # noqa: E402 - after the path setup above

RESULT = ROOT / "bench" / "results" / "eval_vllm.json"
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def write_suites(work: Path, limit: int) -> dict[str, Path]:
    """gsm8k and mt-bench files in their published formats, from the embedded held-out prompts."""
    from dflash_flow.embedded.corpus import make_split

    _, evals = make_split(0, 40 * limit, seed=5)
    texts = [ex.conversations(with_answer=False)[-1]["content"] for ex in evals]
    problems = [t for t in texts if t.endswith("have now?")][:limit]
    tasks = [t for t in texts if not t.endswith("have now?")][: 2 * limit]
    if len(problems) < limit or len(tasks) < 2 * limit:
        raise Failed(f"the held-out split has too few prompts for --limit {limit}")
    gsm = work / "gsm8k-test.jsonl"
    gsm.write_text("".join(json.dumps({"question": q, "answer": "#### 0"}) + "\n" for q in problems))
    mt = work / "question.jsonl"
    mt.write_text("".join(json.dumps({"question_id": 81 + i, "category": "writing", "turns": tasks[2 * i: 2 * i + 2]})
                          + "\n" for i in range(limit)))
    return {"gsm8k": gsm, "mt-bench": mt}


def run_eval(args_tail: list[str], out: Path, log_path: Path, env: dict) -> tuple[int, dict | None, float]:
    cmd = ["nice", "-n", "10", sys.executable, "-m", "dflash_flow", "eval", *args_tail, "--out", str(out), "--no-mlflow"]
    say("running: " + shlex.join(["dflash-flow", *cmd[6:]]))
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = round(time.perf_counter() - t0, 1)
    return rc, (json.loads(out.read_text()) if out.is_file() else None), wall


def figures_of(result: dict) -> dict:
    """Per suite: ours and the engine's tau (vLLM's count) and per-position rates, side by side."""
    out = {}
    for name, s in result["suites"].items():
        e = s.get("engine") or {}
        out[name] = {
            "requests": s["requests"], "verify_steps": s["verify_steps"], "lossless": s["lossless"],
            "tau_per_step_ours": s["tau_per_step"], "tau_per_request_ours": s["tau_per_request"],
            "tau_vllm_count": {"ours": s["tau_engine_count"], "engine": e.get("tau_per_step")},
            "accept_rate_per_position": {"ours": s["accept_rate_per_position"],
                                         "engine": e.get("accept_rate_per_position")},
            "engine_per_request": {k: (e.get("per_request") or {}).get(k)
                                   for k in ("tau_per_step", "tau_per_request", "tau_per_token", "steps")},
            "engine_drafts": (e.get("counters") or {}).get("drafts"),
            "engine_outputs_equal_ours": e.get("lossless_vs_ours"),
            "agreement": s.get("agreement"),
        }
    return out


def check(args, work: Path) -> tuple[dict, list[str]]:
    from dflash_flow.app.eval_engine import free_port, launch_vllm, vllm_drafter_argv
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.embedded.train_target import embedded_target_path
    from dflash_flow.engine.launch import LaunchError
    from dflash_flow.model.export_contract import check_export

    if args.limit < 1 or args.max_new_tokens < 1:
        raise Failed("--limit and --max-new-tokens must be >= 1")
    target = str(Path(args.target).resolve()) if args.target else embedded_target_path()
    if args.export is None and args.target:
        raise Failed("--target needs --export (the training here is the embedded target's)")
    python = ensure_venv(args.venv.resolve())
    t0 = time.perf_counter()
    export = args.export.resolve() if args.export else train_export(work)
    train_s = None if args.export else round(time.perf_counter() - t0, 1)
    try:
        facts = check_export(export)
    except CheckpointError as exc:
        raise Failed(str(exc).splitlines()[0] + " (run `dflash-flow export` on a checkpoint)") from None
    if facts["variant"] != "dflash":
        raise Failed(f"--export {export}: a {facts['variant']} export; vLLM's CPU runner decodes DFlash only")
    suites = write_suites(work, args.limit)
    common = ["--drafter", str(export), "--target", target, "--max-new-tokens", str(args.max_new_tokens),
              *(a for name, path in suites.items() for a in ("--suite", f"{name}={path}"))]
    env = dict(os.environ, **SERVER_ENV)
    figures: dict = {"export": str(export) if args.export else "trained here (pipelines/dflash1.yaml, 2 epochs)",
                     "target": target, "block_size": facts["block_size"], "prompts_per_suite": args.limit,
                     "max_new_tokens": args.max_new_tokens, "train_s": train_s, "runs": {}}
    failed: list[str] = []

    # 4. vLLM with the per-layer k_norm: its drafts are ours, so its counts must be ours.
    port = free_port()
    argv = vllm_drafter_argv(python=str(python), target=target, drafter=str(export), block_size=facts["block_size"],
                             port=port, dtype="float32", max_model_len=1024)
    argv = ["nice", "-n", "10", str(python), str(HERE / "vllm_serve.py"), "--per-layer-knorm", *argv[3:]]
    server_log = work / "vllm-per-layer-knorm.log"
    try:
        servers, url = launch_vllm(argv, port=port, log_path=server_log, log=say, env=env)
    except LaunchError as exc:
        raise Failed(str(exc)) from None
    try:
        try:
            servers.wait_ready()
        except LaunchError as exc:
            raise Failed(str(exc)) from None
        start_s = servers.start_s
        # Its drafts are ours, so its counts are ours exactly: the same integers, the same ratios.
        rc, result, wall = run_eval([*common, "--server", url, "--tau-tolerance", "0", "--rate-tolerance", "0"],
                                    work / "per_layer_knorm.json",
                                    work / "eval-per-layer-knorm.log", env)
    finally:
        servers.stop()
    if result is None:
        raise Failed(f"dflash-flow eval exited {rc} without results; see {work / 'eval-per-layer-knorm.log'} "
                     "(rerun with --keep)")
    figures["runs"]["per_layer_knorm"] = {"exit_code": rc, "wall_s": wall, "server_start_s": round(start_s or 0, 1),
                                          "vllm": _vllm_version(python), "suites": figures_of(result)}
    if rc != 0:
        failed.append(f"per-layer k_norm: dflash-flow eval exited {rc} (the engine disagreed with ours; "
                      f"see {work / 'eval-per-layer-knorm.log'})")
    for name, s in result["suites"].items():
        e, a = s.get("engine") or {}, s.get("agreement") or {}
        if not a.get("ok"):
            failed.append(f"per-layer k_norm, {name}: {'; '.join(a.get('problems', ['no agreement recorded']))}")
        if e.get("lossless_vs_ours") != f"{s['requests']}/{s['requests']}":
            failed.append(f"per-layer k_norm, {name}: engine outputs equal ours in {e.get('lossless_vs_ours')} requests")
        if (e.get("per_request") or {}).get("steps") != (e.get("counters") or {}).get("drafts"):
            failed.append(f"per-layer k_norm, {name}: per-request steps {(e.get('per_request') or {}).get('steps')} "
                          f"!= counter drafts {(e.get('counters') or {}).get('drafts')}")

    # 5. vLLM as shipped, started and stopped by the command itself.
    if args.as_shipped:
        rc2, result2, wall2 = run_eval([*common, "--launch-vllm", str(python)], work / "as_shipped.json",
                                       work / "eval-as-shipped.log", env)
        if result2 is None:
            failed.append(f"as shipped: dflash-flow eval --launch-vllm exited {rc2} without results; see "
                          f"{work / 'eval-as-shipped.log'}")
        else:
            figures["runs"]["as_shipped"] = {"exit_code": rc2, "wall_s": wall2, "launched": result2.get("launched"),
                                             "flagged": rc2 == 1, "suites": figures_of(result2)}
    print_figures(figures)
    return figures, failed


def _vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def _rates(x) -> str:
    return "[" + ", ".join(f"{v:.3f}" for v in x) + "]" if x else "-"


def print_figures(f: dict) -> None:
    say(f"{f['prompts_per_suite']} prompts per suite x {f['max_new_tokens']} new tokens, block {f['block_size']}")
    for run, r in f["runs"].items():
        for name, s in r["suites"].items():
            tau = s["tau_vllm_count"]
            say(f"{run} {name}: tau (vLLM's count) ours {tau['ours']:.4f}, engine "
                f"{tau['engine'] if tau['engine'] is None else format(tau['engine'], '.4f')}; per position ours "
                f"{_rates(s['accept_rate_per_position']['ours'])}, engine {_rates(s['accept_rate_per_position']['engine'])}; "
                f"outputs equal {s['engine_outputs_equal_ours']}; agrees {bool((s['agreement'] or {}).get('ok'))}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, help="a DFlash export to check (default: train one, ~4 min)")
    ap.add_argument("--target", help="the target directory (default: the embedded target)")
    ap.add_argument("--limit", type=int, default=6, help="prompts per suite (default 6)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per request (default 64)")
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("INTEROP_VENV", ROOT / ".venv-interop")),
                    help="the vLLM environment (default $INTEROP_VENV or .venv-interop)")
    ap.add_argument("--out", type=Path, default=RESULT, help=f"result file (default {RESULT.relative_to(ROOT)})")
    ap.add_argument("--no-as-shipped", dest="as_shipped", action="store_false",
                    help="skip the run against vLLM as shipped (--launch-vllm)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, results, suites)")
    args = ap.parse_args(argv)
    from common import machine
    from results import begin, finish

    host = machine()
    started, t0 = begin("python interop/eval_check.py", argv)
    work = Path(tempfile.mkdtemp(prefix="dflash-eval-check-"))
    try:
        figures, failed = check(args, work)
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"work directory kept: {work}")
    return finish("interop", args.out, figures, failed, host, started, t0, say)


if __name__ == "__main__":
    sys.exit(main())
