"""The target on a real vLLM (issue 36), in one command (part of ``just interop``):

    python interop/engine_target_check.py [--samples 64] [--max-batches 240] [--venv DIR] [--keep]

1. vLLM's CPU build (``interop/check.py``'s lock and environment).
2. A server started from the one line ``dflash-flow serve-target pipelines/dflash1.yaml`` prints (our
   connector, layer ids mapped, chunked prefill off; fp32, ``VLLM_CPU_KVCACHE_SPACE=1``), under our launcher.
   ``EngineBackend`` reads the features of ``--samples`` embedded conversations (batches of 8, padded):
   every real position equal to transformers' fp32 forward within 1e-4 (``features_max_abs_diff``); then
   features per second through the server against the in-process forward on the same batches, both with
   one torch thread (vLLM's CPU worker runs one here).
3. The DFlash recipe (``pipelines/dflash1.yaml``, one epoch capped at ``--max-batches`` steps) trained twice on
   the same plan: in process, and fed by a server the run launches itself (``model.engine.launch``). The loss
   of every step compared (``loss_max_rel_diff``, tolerance 1e-3), the exported drafters' acceptance on the
   held-out prompts (greedy; equal), the drafter's data wait (``starved``) with each backend.

Writes ``bench/results/engine_target.json`` (vLLM version, the command, wall time, the load) and prints the
figures; exit 1 when a check fails, 2 when it cannot run.
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

from check import Failed, ensure_venv, say  # noqa: E402 - after the path setup above
from regenerate_check import free_port  # noqa: E402

RESULT = ROOT / "bench" / "results" / "engine_target.json"
PIPELINE = ROOT / "pipelines" / "dflash1.yaml"
FEATURE_TOL = 1e-4
LOSS_RTOL = 1e-3
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
TRAIN_OVERRIDES = (  # the recipe for one epoch, no tracking or checkpoints, the evaluation cut to greedy
    "tracking.enabled=false", "stages.bucketer.epochs=1", "stages.evaluate.limit=8",
    "stages.evaluate.temperatures=[0.0]", "stages.evaluate.walk_data=null", "stages.drafter.heldout_data=null",
    "stages.monitor.progress=false", "checkpoint.every_steps=0", "checkpoint.at_epoch_end=false",
    "runtime.stall_timeout_s=3600",  # a vLLM start on a busy 2-core box can outlast the recipe's 600 s
)


def vllm_version(python: Path) -> str:
    out = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('vllm-cpu'))"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def samples(n: int) -> list[list[int]]:
    """``n`` embedded held-out conversations with their replies, tokenized with the target's chat template."""
    from transformers import AutoTokenizer

    from dflash_flow.embedded.corpus import make_split
    from dflash_flow.embedded.train_target import embedded_target_path

    tok = AutoTokenizer.from_pretrained(embedded_target_path(), local_files_only=True)
    _, evals = make_split(0, n, seed=11)
    out = []
    for ex in evals:
        ids = tok.apply_chat_template(ex.conversations(with_answer=True), tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(list(ids)[:1000])
    return out


def batches(rows: list[list[int]], size: int = 8):
    import torch

    for k in range(0, len(rows), size):
        group = rows[k:k + size]
        s = max(len(r) for r in group)
        ids = torch.zeros(len(group), s, dtype=torch.long)
        mask = torch.zeros(len(group), s, dtype=torch.long)
        for i, r in enumerate(group):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        yield ids, mask, [len(r) for r in group], list(range(k, k + len(group)))


def serve_target_argv(python: Path, port: int, features_dir: Path) -> tuple[list[str], dict[str, str], str]:
    """The server command exactly as ``dflash-flow serve-target`` prints it (split back into env and argv)."""
    cmd = [sys.executable, "-m", "dflash_flow", "serve-target", str(PIPELINE), "--python", str(python), "--port",
           str(port), "--host", "127.0.0.1", "--dtype", "float32", "--max-model-len", "1024",
           "--set", f"model.engine={{servers: [http://127.0.0.1:{port}], features_dir: {features_dir}}}"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if res.returncode != 0:
        raise Failed(f"dflash-flow serve-target failed: {res.stderr.strip()[-400:]}")
    line = res.stdout.strip()
    words = shlex.split(line)
    env = {}
    while words and "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return words, env, line


def feature_check(python: Path, work: Path, n: int) -> dict:
    import torch

    from dflash_flow.embedded.train_target import embedded_target_path
    from dflash_flow.engine.backend import EngineBackend
    from dflash_flow.engine.config import engine_config_from, vllm_server_env
    from dflash_flow.engine.launch import LocalServers, ServerSpec
    from dflash_flow.model.features import TargetFeatureExtractor
    from dflash_flow.model.target import load_target

    features_dir = work / "features"
    port = free_port()
    argv, env, line = serve_target_argv(python, port, features_dir)
    url = f"http://127.0.0.1:{port}"
    say(f"vLLM from the serve-target line: {line[:160]}...")
    servers = LocalServers([ServerSpec(name="vllm", argv=argv, log_path=work / "vllm-features.log",
                                       ready_url=f"{url}/v1/models", env=vllm_server_env({**env, **CPU_ENV}),
                                       port=port)], ready_timeout_s=1800, log=say)
    rows = samples(n)
    out: dict = {"samples": len(rows), "tokens": sum(map(len, rows)), "serve_target_line": line}
    with servers:
        servers.wait_ready()
        out["vllm_start_s"] = round(servers.start_s, 1)
        cfg = engine_config_from({"servers": [url], "features_dir": str(features_dir), "check_samples": 4,
                                  "check_reference": "transformers"})
        backend = EngineBackend(cfg, layer_ids=[1, 5], hidden_size=128, depth=8, target=embedded_target_path(),
                                log=say)
        backend.setup(out_device="cpu", name="check")
        try:
            torch.set_num_threads(1)
            model = load_target(embedded_target_path(), dtype=torch.float32)
            extractor = TargetFeatureExtractor(model, [1, 5])
            worst = 0.0
            for ids, mask, lengths, sids in batches(rows):
                got = backend.features(ids, mask, lengths, sids)
                for i, n_tok in enumerate(lengths):
                    ref = extractor(ids[i : i + 1, :n_tok])[0]
                    worst = max(worst, float((got[i, :n_tok] - ref).abs().max()))
                    if n_tok < ids.shape[1]:
                        assert float(got[i, n_tok:].abs().max()) == 0.0, "padding not zero"
            out["features_max_abs_diff"] = worst
            out["start_check"] = backend.start_check.report
            # throughput: the same batches, twice each way, interleaved (the second round counts)
            timings: dict[str, float] = {"engine": 0.0, "inprocess": 0.0}
            for rnd in range(2):
                for ids, mask, lengths, sids in batches(rows):
                    t0 = time.perf_counter()
                    backend.features(ids, mask, lengths, sids)
                    t1 = time.perf_counter()
                    extractor(ids, mask)
                    t2 = time.perf_counter()
                    if rnd == 1:
                        timings["engine"] += t1 - t0
                        timings["inprocess"] += t2 - t1
            out["features_per_s_engine"] = round(len(rows) / timings["engine"], 2)
            out["features_per_s_inprocess"] = round(len(rows) / timings["inprocess"], 2)
            out["features_per_s_engine_over_inprocess"] = round(timings["inprocess"] / timings["engine"], 3)
            out["left_in_features_dir"] = len(list(features_dir.iterdir()))
        finally:
            backend.close()
    return out


def train(work: Path, name: str, extra: list[str], max_batches: int) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "dflash_flow", "run", str(PIPELINE), "--set", f"output_dir={out}",
           "--set", f"stages.interleaver.max_batches={max_batches}",
           *(a for o in (*TRAIN_OVERRIDES, *extra) for a in ("--set", o))]
    say(f"training ({name}): dflash-flow run pipelines/dflash1.yaml ... ({max_batches} steps)")
    t0 = time.perf_counter()
    with open(work / f"{name}.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=work).returncode
    if rc != 0:
        tail = (work / f"{name}.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise Failed(f"training ({name}) exited {rc}: {' | '.join(tail)[-600:]}; log {work / f'{name}.log'} (--keep)")
    history = json.loads((out / "monitor" / "history.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    evals = history.get("evals") or []
    return {"wall_s": round(time.perf_counter() - t0, 1), "steps": history["train"]["step"],
            "loss": history["train"]["loss"], "evals": evals, "stages": summary.get("stages", {}),
            "log": (work / f"{name}.log").read_text(errors="replace")}


def acceptance(evals: list) -> dict | None:
    """The last evaluation's greedy figures: {label: tau} (SpecDecodeEval's mean tokens per verify step)."""
    if not evals:
        return None
    results = evals[-1].get("results", {})
    return {label: r.get("metrics", {}).get("tau") for label, r in sorted(results.items())}


def training_check(python: Path, work: Path, max_batches: int) -> dict:
    engine = json.dumps({"launch": {"count": 1, "port": free_port(), "python": str(python), "dtype": "float32",
                                    "max_model_len": 1024, "env": CPU_ENV, "ready_timeout_s": 1800},
                         "features_dir": str(work / "run-features"), "check_samples": 4})
    inproc = train(work, "inprocess", [], max_batches)
    fed = train(work, "engine", [f"model.engine={engine}"], max_batches)
    if inproc["steps"] != fed["steps"]:
        raise Failed(f"the runs trained different steps: in process {len(inproc['steps'])}, engine {len(fed['steps'])}")
    rel = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(inproc["loss"], fed["loss"], strict=True)]
    starved = {k: r["stages"].get("drafter", {}).get("blocked_in") for k, r in (("inprocess", inproc), ("engine", fed))}
    return {
        "steps": len(rel), "loss_max_rel_diff": max(rel) if rel else None, "loss_tolerance": LOSS_RTOL,
        "loss_first_last": {"inprocess": [inproc["loss"][0], inproc["loss"][-1]],
                            "engine": [fed["loss"][0], fed["loss"][-1]]},
        "acceptance": {"inprocess": acceptance(inproc["evals"]), "engine": acceptance(fed["evals"])},
        "evals": {"inprocess": inproc["evals"], "engine": fed["evals"]},
        "drafter_starved": starved, "train_wall_s": {"inprocess": inproc["wall_s"], "engine": fed["wall_s"]},
        "engine_start_check_logged": "engine features equal transformers'" in fed["log"],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=64, help="conversations for the feature comparison (default 64)")
    ap.add_argument("--max-batches", type=int, default=240, help="training steps of each run (default 240)")
    ap.add_argument("--no-train", action="store_true", help="only the feature comparison and throughput")
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("INTEROP_VENV", ROOT / ".venv-interop")),
                    help="the vLLM environment (default $INTEROP_VENV or .venv-interop)")
    ap.add_argument("--out", type=Path, default=RESULT, help=f"result file (default {RESULT.relative_to(ROOT)})")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, runs)")
    args = ap.parse_args(argv)
    from common import machine
    from results import begin, finish

    host = machine()
    started, t0 = begin("python interop/engine_target_check.py", argv)
    os.nice(10)  # the machine is shared: this check, its servers and its training runs yield to others
    work = Path(tempfile.mkdtemp(prefix="dflash-engine-"))
    failed: list[str] = []
    try:
        python = ensure_venv(args.venv.resolve())
        figures = {"vllm": vllm_version(python), "target": "embedded (fp32)", "layers": {"ours": [1, 5], "vllm": [2, 6]},
                   "feature_tolerance": FEATURE_TOL}
        figures.update(feature_check(python, work, args.samples))
        if not figures["features_max_abs_diff"] <= FEATURE_TOL:
            failed.append(f"engine features differ from transformers' by {figures['features_max_abs_diff']:.3g} "
                          f"(tolerance {FEATURE_TOL:g})")
        if figures["left_in_features_dir"]:
            failed.append(f"{figures['left_in_features_dir']} feature files were left behind")
        say(f"features: max abs diff {figures['features_max_abs_diff']:.3g} over {figures['samples']} samples; "
            f"{figures['features_per_s_engine']} samples/s through vLLM vs {figures['features_per_s_inprocess']} "
            f"in process (x{figures['features_per_s_engine_over_inprocess']})")
        if not args.no_train:
            figures.update(training_check(python, work, args.max_batches))
            if not figures["loss_max_rel_diff"] <= LOSS_RTOL:
                failed.append(f"the engine-fed loss differs from the in-process one by {figures['loss_max_rel_diff']:.3g} "
                              f"relative at some step (tolerance {LOSS_RTOL:g})")
            acc = figures["acceptance"]
            if acc["inprocess"] is None or acc["inprocess"] != acc["engine"]:
                failed.append(f"acceptance differs: in process {acc['inprocess']}, engine-fed {acc['engine']}")
            if not figures["engine_start_check_logged"]:
                failed.append("the engine-fed run did not log its start check")
            say(f"training: {figures['steps']} steps, loss max relative difference {figures['loss_max_rel_diff']:.3g}; "
                f"acceptance {acc['inprocess']} (in process) vs {acc['engine']} (engine); drafter starved "
                f"{figures['drafter_starved']}")
    except Failed as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            say(f"work directory kept: {work}")
    return finish("engine_target_check", args.out, figures, failed, host, started, t0, say)


if __name__ == "__main__":
    sys.exit(main())
