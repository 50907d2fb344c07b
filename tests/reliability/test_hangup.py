"""A closed terminal window or a dropped SSH session (issue 40.8): the terminal hangs up, the run gets SIGHUP
and ends as on SIGTERM: a checkpoint of the last step trained, the MLflow run KILLED (never RUNNING for
good), summary.json written, exit 130; in one process and as a 2-rank job (`--nproc 2`, torchrun).

The run is started on a real pseudo-terminal, its controlling terminal; closing our side of it is the
hang-up: the kernel sends SIGHUP, and every later write to the terminal fails (EIO)."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from reltools import cli_env, mlflow_runs, read_lines, summary, train_pipeline, write_tokenized, write_yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class Terminal:
    """``dflash-flow ARGS`` in a session of its own whose controlling terminal is a pseudo-terminal we hold
    (stdin, stdout and stderr on it); what it prints is read into ``text`` until the hang-up."""

    def __init__(self, args: list, cwd: Path) -> None:
        master, slave = pty.openpty()

        def on_the_terminal():
            signal.signal(signal.SIGHUP, signal.SIG_DFL)  # the test itself may run under nohup
            import fcntl
            import termios

            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        cmd = [sys.executable, "-m", "dflash_flow.cli", *[str(a) for a in args]]
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=cli_env(), stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, preexec_fn=on_the_terminal)
        os.close(slave)
        self._master = master
        self._chunks: list[bytes] = []
        self._stop = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._master], [], [], 0.1)
            if ready:
                try:
                    data = os.read(self._master, 65536)
                except OSError:
                    return
                if not data:
                    return
                self._chunks.append(data)

    @property
    def text(self) -> str:
        return b"".join(self._chunks).decode(errors="replace")

    def hang_up(self) -> None:
        self._stop.set()
        self._reader.join()
        os.close(self._master)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
            raise AssertionError(f"the run did not end within {timeout}s of the hang-up") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


def _wait_lines(path: Path, n: int, term: Terminal, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_bytes().count(b"\n") >= n):
        assert term.proc.poll() is None, f"the run ended before the hang-up:\n{term.text[-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not reach {n} lines:\n{term.text[-3000:]}"
        time.sleep(0.05)


def _pipeline(root: Path) -> Path:
    data = write_tokenized(root / "data.jsonl", 200, seed=4)
    # No periodic checkpoint: the checkpoint found is the stop's. Epochs enough to outlast any start-up.
    return write_yaml(root / "p.yaml", train_pipeline(root, data=data, output_dir=root / "out", every_steps=0, epochs=20))


def _stopped_as_on_sigterm(root: Path, code: int, term: Terminal) -> dict:
    """Exit 130, the MLflow run KILLED, summary.json KILLED naming it; returns the stop checkpoint's state."""
    out = root / "out"
    assert code == 130, f"exit {code}\n{term.text[-3000:]}"
    ckdir = out / "checkpoints"
    assert (ckdir / "latest").exists(), f"no stop checkpoint\n{term.text[-3000:]}"
    [run] = mlflow_runs(root / "mlflow.db")
    assert run.info.status == "KILLED"
    assert summary(out)["status"] == "KILLED" and summary(out)["mlflow_run_id"] == run.info.run_id
    return json.loads((ckdir / (ckdir / "latest").read_text().strip() / "state.json").read_text())


def test_a_hung_up_terminal_stops_the_run_as_sigterm_does(tmp_path):
    term = Terminal(["run", _pipeline(tmp_path)], tmp_path)
    try:
        _wait_lines(tmp_path / "out" / "batches.jsonl", 3, term, 240)
        term.hang_up()
        code = term.wait(120)
    finally:
        term.kill()
    state = _stopped_as_on_sigterm(tmp_path, code, term)
    trained = len(read_lines(tmp_path / "out" / "batches.jsonl"))
    assert state["step"] == trained == state["data_position"]["total"], "the stop checkpoint is the last step trained"


def test_a_hung_up_terminal_stops_a_two_rank_job_as_sigterm_does(tmp_path):
    term = Terminal(["run", _pipeline(tmp_path), "--nproc", "2"], tmp_path)
    out = tmp_path / "out"
    try:
        _wait_lines(out / "batches.rank1.jsonl", 3, term, 480)
        term.hang_up()
        code = term.wait(180)
    finally:
        term.kill()
    state = _stopped_as_on_sigterm(tmp_path, code, term)
    assert state["extra"]["world_size"] == 2 and len(state["extra"]["data_positions"]) == 2
    # The ranks agree on the step they stop after: the checkpoint is at the last step rank 0 trained.
    assert state["step"] >= 3 and abs(len(read_lines(out / "batches.rank0.jsonl")) - state["step"]) <= 1
