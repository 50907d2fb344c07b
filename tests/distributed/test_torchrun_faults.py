"""Faults of a torchrun job (gloo, CPU) named where they happened (issue 23): a stage failing on rank 1 is
reported as rank 1's, not as the connection error it causes on rank 0; ranks that disagree on their
config or data refuse to start; a replica whose first batch is a filler trains."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from reltools import cli_env, mlflow_runs, train_pipeline, write_tokenized, write_yaml

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
