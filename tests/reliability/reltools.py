"""Helpers of the reliability (acceptance) tests: a fast real training pipeline, CLI runs in
subprocesses with hard timeouts, and the MLflow run status read back from the sqlite store.

Every wait here is bounded: subprocesses get a timeout (and are killed on it), polls have deadlines.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

# The tiny-qwen3-8l preset (dflash_flow/model/target.py): vocab 512. The last row is the drafter's mask.
VOCAB = 512
MASK_ID = VOCAB - 1

CLI_TIMEOUT_S = 120.0


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",
    )
    return env


def cli(args: list[str], *, cwd: Path, timeout: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`dflash-flow ARGS` in a subprocess; never waits longer than ``timeout`` (the process is killed)."""
    cmd = [sys.executable, "-m", "dflash_flow.cli", *[str(a) for a in args]]
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"`dflash-flow {' '.join(map(str, args))}` did not end within {timeout}s\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def start_cli(args: list[str], *, cwd: Path, log: Path) -> subprocess.Popen:
    """Start `dflash-flow ARGS` in the background, stdout and stderr into ``log``."""
    cmd = [sys.executable, "-m", "dflash_flow.cli", *[str(a) for a in args]]
    f = open(log, "w")  # noqa: SIM115 - closed by finish()
    proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdout=f, stderr=subprocess.STDOUT)
    proc._log_file = f  # type: ignore[attr-defined]
    return proc


def finish(proc: subprocess.Popen, timeout: float = CLI_TIMEOUT_S) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        raise AssertionError(f"process {proc.args} did not end within {timeout}s") from None
    finally:
        proc._log_file.close()  # type: ignore[attr-defined]


def kill_hard(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    finish(proc, 30)


# -- data ------------------------------------------------------------------------------------------
def write_tokenized(path: Path, n: int, seed: int = 0, *, min_len: int = 12, max_len: int = 40) -> Path:
    """Pre-tokenized JSONL for the tiny target: random ids below the mask id, a prompt/reply loss mask."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = rng.randint(min_len, max_len)
            ids = [rng.randrange(0, MASK_ID) for _ in range(length)]
            prompt = rng.randint(2, length // 2)
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (length - prompt)}) + "\n")
    return path


def write_chat(path: Path, n: int) -> Path:
    """``n`` tiny chat conversations (one user turn, one assistant reply) as JSONL."""
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"conversations": [
                {"role": "user", "content": f"What is {i} plus {i}?"},
                {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."},
            ]}) + "\n")
    return path


def train_pipeline(
    root: Path,
    *,
    data: Path,
    output_dir: Path,
    tracking: bool = True,
    every_steps: int = 2,
    epochs: int = 2,
    overrides: dict[str, dict[str, Any]] | None = None,
    runtime: dict[str, Any] | None = None,
    name: str = "reliability",
    model: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The fast real training pipeline of the issue, as a dict (write it with ``write_yaml``); ``model``
    overrides keys of its ``model:`` section."""
    stages = [
        {"name": "source", "type": "TokenizedSource",
         "config": {"paths": [str(data)], "max_length": 64, "cache_dir": None, "vocab_size": VOCAB}},
        {"name": "bucketer", "type": "Bucketer", "inputs": ["source"],
         "config": {"max_tokens": 128, "num_buckets": 2, "epochs": epochs}},
        {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"]},
        {"name": "padder", "type": "Padder", "inputs": ["interleaver"], "replicas": 2},
        {"name": "target", "type": "TargetForward", "inputs": ["padder"], "replicas": 2,
         "config": {"torch_threads": 1}},
        {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "ordered": True,
         "config": {"num_anchors": 16, "record_batches": True, "torch_threads": 1}},
        {"name": "monitor", "type": "Monitor", "inputs": ["drafter"],
         "config": {"interval_s": 0.5, "progress": False, "plots": False}},
    ]
    for spec in stages:
        for key, value in (overrides or {}).get(spec["name"], {}).items():
            if key in ("type", "replicas", "inputs", "ordered", "capacity"):
                spec[key] = value
            else:
                spec.setdefault("config", {})[key] = value
    return {
        "name": name,
        "seed": 7,
        "output_dir": str(output_dir),
        "runtime": {"capacity": 2, "stall_timeout_s": 60, "drain_timeout_s": 30, "shutdown_grace_s": 5,
                    "watchdog_interval_s": 0.2, **(runtime or {})},
        "tracking": {"enabled": tracking, "tracking_uri": str(root / "mlflow.db"), "experiment": "reliability",
                     "system_metrics": False},
        "checkpoint": {"every_steps": every_steps, "keep_last": 2},
        "model": {"target": "tiny-qwen3-8l", "num_draft_layers": 1, "block_size": 4, "mask_token_id": MASK_ID,
                  **(model or {})},
        "stages": stages,
    }


def write_yaml(path: Path, doc: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


# -- outputs ---------------------------------------------------------------------------------------
def read_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    return path.read_text().splitlines()


def count_complete_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def wait_for_lines(path: Path, n: int, proc: subprocess.Popen, timeout: float = 90.0) -> int:
    """Poll until ``path`` has ``n`` complete lines (bounded); returns the count seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = count_complete_lines(path)
        if got >= n:
            return got
        if proc.poll() is not None:
            return got
        time.sleep(0.005)
    raise AssertionError(f"{path} did not reach {n} lines within {timeout}s")


def load_weights(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(path))


def mlflow_run(db: Path, run_id: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{db}").get_run(run_id)


def mlflow_runs(db: Path, experiment: str = "reliability") -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return []
    return client.search_runs([exp.experiment_id], max_results=1000)


def summary(output_dir: Path) -> dict[str, Any]:
    return json.loads((output_dir / "summary.json").read_text())


# -- threads ---------------------------------------------------------------------------------------
def runtime_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("dflash-flow")]


def wait_threads_back(baseline: set[threading.Thread], timeout: float = 10.0) -> list[threading.Thread]:
    deadline = time.monotonic() + timeout
    while True:
        extra = [t for t in threading.enumerate() if t not in baseline and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)
