"""The whole pipeline as a 2-rank torchrun job on CPU (gloo): every sample trained exactly once per
epoch across the ranks, one MLflow run (rank 0's) with reduced and per-rank metrics, checkpoints written
once, an elastic resume with another world size, and a rank killed mid-run taking the job down."""

from __future__ import annotations

import json
import os
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from reltools import cli, finish, mlflow_runs, start_cli, train_pipeline, write_tokenized, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

N_SAMPLES = 48
EPOCHS = 2


def batch_log(output_dir: Path, world: int) -> list[list[dict]]:
    names = ["batches.jsonl"] if world == 1 else [f"batches.rank{r}.jsonl" for r in range(world)]
    return [[json.loads(x) for x in (output_dir / n).read_text().splitlines()] for n in names]


def ids_of(entries: list[dict], epoch: int) -> list[int]:
    return [i for e in entries if e["epoch"] == epoch for i in e["sample_ids"]]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    data = write_tokenized(root / "tok.jsonl", N_SAMPLES, seed=3)
    out = root / "run"
    doc = train_pipeline(root, data=data, output_dir=out, every_steps=2, epochs=EPOCHS)
    doc["checkpoint"]["keep_last"] = 50
    path = write_yaml(root / "p.yaml", doc)
    t0 = time.monotonic()
    proc = cli(["run", path, "--nproc", "2"], cwd=root, timeout=600)
    return root, path, out, proc, time.monotonic() - t0


def test_every_sample_once_per_epoch_across_ranks(first_run):
    root, _path, out, proc, _ = first_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = batch_log(out, 2)
    for epoch in range(EPOCHS):
        got = Counter(ids_of(logs[0], epoch) + ids_of(logs[1], epoch))
        assert sorted(got) == list(range(N_SAMPLES)) and set(got.values()) == {1}, epoch
    assert abs(len(logs[0]) - len(logs[1])) <= EPOCHS  # equal steps; fillers (not logged) only at epoch ends
    # rank 1 prints nothing (the console is rank 0's); rank 0 printed the summary, with the all-reduce wait
    assert "run summary" in proc.stderr
    assert "allreduce_wait_s" in proc.stderr and "allreduce_wait_frac" in proc.stderr, proc.stderr[-3000:]


def test_rank0_owns_the_one_mlflow_run_with_reduced_and_per_rank_metrics(first_run):
    root, _path, out, proc, _ = first_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = mlflow_runs(root / "mlflow.db")
    assert len(runs) == 1, [r.info.run_id for r in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    keys = set(run.data.metrics)
    assert "train/loss" in keys and "train/tokens_per_s" in keys
    assert any(k.startswith("rank1/stage/") for k in keys) and any(k.startswith("rank0/stage/") for k in keys)
    assert run.data.tags.get("world_size") == "2"


def test_checkpoints_are_written_once_with_every_ranks_position(first_run):
    root, _path, out, proc, _ = first_run
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert ckpts and not list((out / "checkpoints").glob(".tmp-*"))
    state = json.loads((ckpts[0] / "state.json").read_text())
    assert state["extra"]["world_size"] == 2
    positions = state["extra"]["data_positions"]
    assert len(positions) == 2 and positions[0] == positions[1] == state["data_position"]


@pytest.mark.parametrize("world", [1, 2])
def test_elastic_resume_from_a_two_rank_checkpoint(first_run, world):
    """Continue from step 2 of the 2-rank run with 1 and with 2 ranks: with what the first run trained
    before its checkpoint, every sample of each epoch is trained exactly once."""
    root, path, out, proc, _ = first_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckpt = out / "checkpoints" / "step-00000002"
    state = json.loads((ckpt / "state.json").read_text())
    assert state["data_position"]["epoch"] == 0  # mid epoch 0
    before = batch_log(out, 2)
    trained_before = [e for log in before for e in log[:2]]  # 2 steps per rank, no filler yet
    resumed_out = root / f"resumed-{world}"
    args = ["run", path, "--resume", ckpt, "--set", f"output_dir={resumed_out}", "--set", "tracking.enabled=false"]
    if world > 1:
        args += ["--nproc", str(world)]
    res = cli(args, cwd=root, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    after = [e for log in batch_log(resumed_out, world) for e in log]
    for epoch in range(EPOCHS):
        got = Counter(ids_of(trained_before, epoch) + ids_of(after, epoch))
        assert sorted(got) == list(range(N_SAMPLES)) and set(got.values()) == {1}, (world, epoch)
    if world == 2:  # the same world size continues the very same plan, rank by rank
        again = batch_log(resumed_out, 2)
        for r in range(2):
            assert again[r] == before[r][2:]


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])  # the parent's pid
        if pid == ancestor:
            return True
    return False


def _rank_pid(launcher_pid: int, rank: int) -> int | None:
    """This job's rank process (a descendant of our launcher: other jobs may run on the machine)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if b"dflash_flow" in cmd and f"RANK={rank}".encode() in env and b"LOCAL_RANK=" in b"".join(env):
            if int(d.name) != launcher_pid and _descends_from(int(d.name), launcher_pid):
                return int(d.name)
    return None


def test_a_killed_rank_takes_the_job_down_promptly_and_is_named(tmp_path):
    data = write_tokenized(tmp_path / "tok.jsonl", 200, seed=4)
    out = tmp_path / "run"
    doc = train_pipeline(tmp_path, data=data, output_dir=out, every_steps=0, epochs=20)
    path = write_yaml(tmp_path / "p.yaml", doc)
    proc = start_cli(["run", path, "--nproc", "2"], cwd=tmp_path, log=tmp_path / "log.txt")
    deadline = time.monotonic() + 240
    log1 = out / "batches.rank1.jsonl"
    while time.monotonic() < deadline and (not log1.exists() or log1.read_text().count("\n") < 3):
        assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
        time.sleep(0.1)
    pid = _rank_pid(proc.pid, 1)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    code = finish(proc, timeout=120)
    took = time.monotonic() - t0
    text = (tmp_path / "log.txt").read_text()
    assert code != 0
    assert took < 90, took  # bounded: no rank waits in a collective for the process-group timeout
    assert "rank 1" in text, text[-2000:]
    runs = mlflow_runs(tmp_path / "mlflow.db")
    assert len(runs) == 1 and runs[0].info.status in ("FAILED", "KILLED")
