"""A 2-rank job (torchrun, gloo, CPU) and signals (issue 40.13, 40.16): SIGTERM to the launcher stops the job
without torch's SignalException traceback; a rank stopped with SIGSTOP fails the job at the collective
timeout, and the messages name that rank -- the one whose progress stopped -- not rank 0, which only waited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reltools import cli_env, train_pipeline, write_tokenized, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _start(root: Path, **distributed) -> tuple[subprocess.Popen, Path]:
    data = write_tokenized(root / "data.jsonl", 200, seed=4)
    doc = train_pipeline(root, data=data, output_dir=root / "out", every_steps=0, epochs=20)
    if distributed:
        doc["distributed"] = distributed
    path = write_yaml(root / "p.yaml", doc)
    log = open(root / "console.log", "w")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen([sys.executable, "-m", "dflash_flow.cli", "run", str(path), "--nproc", "2"], cwd=root,
                            env=cli_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    proc._log = log  # type: ignore[attr-defined]
    return proc, root / "console.log"


def _wait_lines(path: Path, n: int, proc: subprocess.Popen, log: Path, timeout: float = 480) -> None:
    deadline = time.monotonic() + timeout  # a bound on start-up, not a measured duration
    while not (path.exists() and path.read_bytes().count(b"\n") >= n):
        assert proc.poll() is None, f"the run ended early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not reach {n} lines:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def _end(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise AssertionError(f"the job did not end within {timeout}s") from None
    finally:
        proc._log.close()  # type: ignore[attr-defined]
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _rank_pid(root_pid: int, rank: int) -> int:
    """The worker process of ``rank`` under the launcher ``root_pid`` (torchrun's child with RANK=rank)."""
    todo, seen = [root_pid], []
    while todo:
        pid = todo.pop()
        seen.append(pid)
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except OSError:
            continue
        todo += [int(c) for c in children]
    for pid in seen:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and any(e.startswith(b"LOCAL_RANK=") for e in env):
            return pid
    raise AssertionError(f"no process of rank {rank} under {root_pid}")


def test_sigterm_to_a_two_rank_launcher_stops_the_job_without_torchs_traceback(tmp_path):
    proc, log = _start(tmp_path)
    try:
        _wait_lines(tmp_path / "out" / "batches.rank1.jsonl", 3, proc, log)
        os.kill(proc.pid, signal.SIGTERM)
        code = _end(proc, 240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 130, f"exit {code}\n{text[-3000:]}"
    assert "Traceback" not in text and "SignalException" not in text, text[-4000:]


def test_a_rank_stopped_with_sigstop_is_named_not_rank_0(tmp_path):
    """Rank 1 is frozen (SIGSTOP) mid-training: rank 0 waits in a collective until distributed.timeout_s and
    fails. Rank 0's error and the launcher's summary name rank 1 as the rank whose progress stopped."""
    proc, log = _start(tmp_path, timeout_s=60)  # long enough for start-up on a busy machine
    frozen = None
    try:
        _wait_lines(tmp_path / "out" / "batches.rank1.jsonl", 3, proc, log)
        frozen = _rank_pid(proc.pid, 1)
        os.kill(frozen, signal.SIGSTOP)
        code = _end(proc, 400)
    finally:
        if frozen is not None:
            try:
                os.kill(frozen, signal.SIGCONT)
                os.kill(frozen, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = log.read_text()
    assert code == 1, f"exit {code}\n{text[-3000:]}"
    errors = [x for x in text.splitlines() if x.startswith("error:")]
    assert errors, text[-4000:]
    summary = errors[-1]  # the launcher's line comes last
    assert summary.startswith("error: rank 1 "), summary
    assert "stopped making progress" in summary and "rank 0" in summary, summary
    rank0 = [x for x in errors[:-1] if "rank 1" in x and "no progress" in x]
    assert rank0, errors  # rank 0's own error says whom it waited for
