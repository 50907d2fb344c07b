"""Faults of a torchrun job (gloo, CPU) named where they happened (issue 23): a stage failing on rank 1 is
reported as rank 1's, not as the connection error it causes on rank 0; ranks that disagree on their
config or data refuse to start; a replica whose first batch is a filler trains."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from reltools import cli, cli_env, mlflow_runs, train_pipeline, write_tokenized, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

RELIABILITY = Path(__file__).resolve().parents[1] / "reliability"


def _with_faulty_stages(root: Path) -> dict[str, str]:
    """An environment in which every `dflash-flow run` process (the ranks torchrun starts included) has the
    Faulty<Type> test stages registered, as an installed plugin's would be: a sitecustomize on PYTHONPATH."""
    site = root / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "if any(a.startswith('dflash_flow') for a in sys.orig_argv):\n"
        f"    sys.path.insert(0, {str(RELIABILITY)!r})\n"
        "    import faulty_stages  # noqa: F401\n")
    env = cli_env()
    env["PYTHONPATH"] = f"{site}{':' + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}"
    return env


def _run(args: list, *, cwd: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "dflash_flow.cli", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _error_lines(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith("error:")]


def test_a_stage_failing_on_rank_1_is_named_with_its_stage_and_error(tmp_path):
    data = write_tokenized(tmp_path / "tok.jsonl", 48, seed=3)
    out = tmp_path / "run"
    doc = train_pipeline(tmp_path, data=data, output_dir=out, every_steps=0, epochs=4, overrides={
        "target": {"type": "FaultyTargetForward", "fault_phase": "process", "fault_rank": 1, "fault_at": 3}})
    path = write_yaml(tmp_path / "p.yaml", doc)
    res = _run(["run", path, "--nproc", "2"], cwd=tmp_path, env=_with_faulty_stages(tmp_path))
    assert res.returncode == 1, res.stderr[-4000:]
    summary = _error_lines(res.stderr)[-1]  # the launcher's line comes last
    assert summary.startswith("error: rank 1 failed: stage 'target' replica 0 failed in process: InjectedFault"), summary
    assert "Connection closed" not in summary, summary
    runs = mlflow_runs(tmp_path / "mlflow.db")
    assert len(runs) == 1 and runs[0].info.status == "FAILED"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_that_disagree_on_config_or_data_refuse_to_start_naming_the_field_and_the_ranks(tmp_path):
    """The multi-node recipe (each node runs its own `dflash-flow run --nnodes 2`), two jobs side by side on
    this machine, one node each in its own directory with the same pipeline file (relative paths): job
    `seed` has `--set seed=8` on one node, job `data` a shuffled copy of the data there. Every node refuses
    at start-up, names the field and the ranks, exits 2, and nothing is trained or recorded."""
    rows = write_tokenized(tmp_path / "tok.jsonl", 16, seed=3).read_text().splitlines(keepends=True)
    shuffled = list(rows)
    random.Random(1).shuffle(shuffled)
    procs = {}
    for job in ("seed", "data"):
        port = _free_port()
        for node in (0, 1):
            d = tmp_path / job / f"node{node}"
            d.mkdir(parents=True)
            (d / "tok.jsonl").write_text("".join(shuffled if (job, node) == ("data", 1) else rows))
            doc = train_pipeline(d, data=Path("tok.jsonl"), output_dir=Path("run"), every_steps=1, epochs=1)
            doc["tracking"]["tracking_uri"] = "mlflow.db"
            path = write_yaml(d / "p.yaml", doc)
            args = ["run", path.name, "--nproc", "1", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                    "--rdzv-id", job]
            if (job, node) == ("seed", 1):
                args += ["--set", "seed=8"]
            cmd = [sys.executable, "-m", "dflash_flow.cli", *args]
            procs[job, node] = (d, subprocess.Popen(cmd, cwd=d, env=cli_env(), stdout=subprocess.PIPE,
                                                    stderr=subprocess.PIPE, text=True))
    results = {}
    try:
        for key, (d, proc) in procs.items():
            _out, err = proc.communicate(timeout=300)
            results[key] = (d, proc.returncode, err)
    finally:
        for _d, proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
    expected = {"seed": "disagree on config (seed: ", "data": "disagree on data_files (tok.jsonl: "}
    for (job, _node), (d, code, err) in results.items():
        assert code == 2, err[-4000:]
        summary = _error_lines(err)[-1]  # this node's launcher: its own rank, refused, and why
        assert expected[job] in summary and "on rank 0" in summary and "on rank 1" in summary, summary
        assert "rank(s) 1 differ from rank 0" in summary and "died" not in summary, summary
        if job == "seed":
            assert "7 on rank" in summary and "8 on rank" in summary, summary
        assert not (d / "run").exists() and not (d / "mlflow.db").exists(), list(d.iterdir())


def test_two_ranks_on_seven_samples_train_with_a_filler_as_a_replicas_first_batch(tmp_path):
    """7 samples of 40 tokens, 3 to a batch (128-token budget): 3 batches an epoch, 2 global steps, so rank
    1's second step is a filler, and it is the first batch its second Padder replica sees (round robin).
    The job trains every sample exactly once per epoch and ends FINISHED."""
    data = write_tokenized(tmp_path / "tok.jsonl", 7, seed=2, min_len=40, max_len=40)
    out = tmp_path / "run"
    doc = train_pipeline(tmp_path, data=data, output_dir=out, every_steps=0, epochs=2,
                         overrides={"bucketer": {"num_buckets": 1}})
    res = cli(["run", write_yaml(tmp_path / "p.yaml", doc), "--nproc", "2"], cwd=tmp_path, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "ZeroDivisionError" not in res.stderr
    logs = [[json.loads(x) for x in (out / f"batches.rank{r}.jsonl").read_text().splitlines()] for r in (0, 1)]
    for epoch in range(2):
        steps = [[e for e in log if e["epoch"] == epoch] for log in logs]
        assert [len(s) for s in steps] == [2, 1], steps  # rank 1's second step: the filler (not logged)
        ids = sorted(i for s in steps for e in s for i in e["sample_ids"])
        assert ids == list(range(7)), ids
    (run,) = mlflow_runs(tmp_path / "mlflow.db")
    assert run.info.status == "FINISHED"
