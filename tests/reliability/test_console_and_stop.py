"""A real `dflash-flow run` process and its console: Ctrl-C stops it within seconds with a checkpoint at
exactly the last step trained; a reader that goes away (`dflash-flow run ... | head`) never fails the run
(issue 22.1)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reltools import (
    cli_env,
    count_complete_lines,
    finish,
    mlflow_runs,
    read_lines,
    start_cli,
    summary,
    train_pipeline,
    wait_for_lines,
    write_tokenized,
    write_yaml,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _pipeline(root: Path, *, n: int, epochs: int, progress: bool = False, **runtime) -> Path:
    data = write_tokenized(root / "data.jsonl", n, seed=5)
    doc = train_pipeline(root, data=data, output_dir=root / "out", every_steps=0, epochs=epochs, runtime=runtime)
    if progress:
        monitor = next(s for s in doc["stages"] if s["name"] == "monitor")
        monitor["config"].update(progress=True, interval_s=0.2, progress_interval_s=0.2)
    return write_yaml(root / "pipeline.yaml", doc)


def test_ctrl_c_stops_within_seconds_with_a_checkpoint_at_the_last_step_trained(tmp_path):
    # Queues of 8 in front of two padders, two targets and the drafter: a drain that trains every queued
    # batch would train a dozen more steps after the signal. No periodic checkpoint (every_steps 0), so the
    # checkpoint found is the stop's.
    path = _pipeline(tmp_path, n=96, epochs=2, capacity=8)
    out = tmp_path / "out"
    proc = start_cli(["run", path], cwd=tmp_path, log=tmp_path / "run.log")
    wait_for_lines(out / "batches.jsonl", 4, proc)
    assert proc.poll() is None, "the run ended before the signal"
    trained_at_signal = count_complete_lines(out / "batches.jsonl")
    t0 = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    code = finish(proc, 120)
    took = time.monotonic() - t0
    log = (tmp_path / "run.log").read_text()
    assert code == 130, log[-3000:]
    assert took < 30, f"the stop took {took:.1f}s\n{log[-3000:]}"
    assert "Traceback" not in log, log[-3000:]
    # Said at once, before the drain and the checkpoint (issue 40.23).
    notice = "stopping after the batch in flight (Ctrl-C again to force)"
    assert notice in log and log.index(notice) < log.index("checkpoint saved to"), log[-3000:]

    trained = read_lines(out / "batches.jsonl")
    # At most the step in flight when the signal landed (and one more that may start before it is seen).
    assert len(trained) <= trained_at_signal + 2, (trained_at_signal, len(trained))
    ckdir = out / "checkpoints"
    latest = ckdir / (ckdir / "latest").read_text().strip()
    state = json.loads((latest / "state.json").read_text())
    assert state["step"] == len(trained) == state["data_position"]["total"], "the checkpoint is the last step trained"
    assert latest.name == f"step-{len(trained):08d}"
    assert re.search(rf"checkpoint saved to \S*{latest.name}", log), log[-3000:]

    [run] = mlflow_runs(tmp_path / "mlflow.db")
    assert run.info.status == "KILLED"
    assert summary(out)["status"] == "KILLED"
    from mlflow import MlflowClient

    history = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}").get_metric_history(run.info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, len(trained) + 1)), "each step logged once"


def test_a_reader_that_goes_away_never_fails_the_run(tmp_path):
    """`dflash-flow run ... 2>&1 | head -2`: stdout and stderr into a pipe whose reader closes after two
    lines; printing stops, training goes on, exit 0, MLflow FINISHED, the drafter exported."""
    path = _pipeline(tmp_path, n=32, epochs=2, progress=True)
    cmd = [sys.executable, "-m", "dflash_flow.cli", "run", str(path)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        head = [proc.stdout.readline() for _ in range(2)]
        assert all(head), f"the run printed less than two lines: {head}"
        proc.stdout.close()  # head exits: every later write meets a closed pipe
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    out = tmp_path / "out"
    assert code == 0, summary(out).get("error") if (out / "summary.json").exists() else code
    assert summary(out)["status"] == "FINISHED"
    [run] = mlflow_runs(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
    assert (out / "drafter" / "model.safetensors").is_file()
    assert len(read_lines(out / "batches.jsonl")) >= 14  # both epochs trained
