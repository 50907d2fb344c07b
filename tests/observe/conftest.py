"""Shared helpers for the observe tests: a real sqlite MLflow store and a real `mlflow server`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def sqlite_uri(tmp_path_factory) -> str:
    """One real sqlite store per test module (creating the schema takes ~5 s on 2 shared cores)."""
    root = tmp_path_factory.mktemp("mlflow_store")
    return f"sqlite:///{root / 'mlflow.db'}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """Poll /health until the server answers; bounded, and fails fast if the server died."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mlflow server exited early with code {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"mlflow server on port {port} not healthy after {timeout_s} s")


def start_server(db_uri: str, port: int, workdir: Path, log_name: str) -> subprocess.Popen:
    """`mlflow server` in its own session, so that killing its process group takes its children too."""
    log = open(workdir / log_name, "wb")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        db_uri,
        "--artifacts-destination",
        str(workdir / "server-artifacts"),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    return subprocess.Popen(
        cmd, cwd=workdir, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def kill_server(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGKILL the server's process group (ours: started with start_new_session) and reap it."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    # Children of the group that outlived the leader (uvicorn worker): make sure they are gone too.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class ServerFactory:
    """Starts real `mlflow server` processes; every one started is killed at fixture teardown."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen] = []

    def free_port(self) -> int:
        return free_port()

    def start(self, db_uri: str, port: int, timeout_s: float = 90.0) -> subprocess.Popen:
        proc = start_server(db_uri, port, self.workdir, f"server{len(self.procs)}.log")
        self.procs.append(proc)
        try:
            wait_healthy(port, proc, timeout_s)
        except Exception:
            log = (self.workdir / f"server{len(self.procs) - 1}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"mlflow server did not come up:\n{log}") from None
        return proc

    def kill(self, proc: subprocess.Popen) -> None:
        kill_server(proc)

    def close(self) -> None:
        for p in self.procs:
            kill_server(p)


@pytest.fixture
def mlflow_servers(tmp_path):
    factory = ServerFactory(tmp_path)
    try:
        yield factory
    finally:
        factory.close()
