"""Local servers started by a run (engine.launch): ready when their URL answers, a timeout that says what it
waited for, and no process left behind on any exit path of the process that started them -- a return, an
exception, Ctrl-C, SIGTERM and SIGKILL -- nor when a server ignores SIGTERM. The servers are real processes
(tests/engine/tiny_server.py, which starts a child of its own as vLLM's API server does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_flow.engine.launch import LaunchError, LocalServers, ServerSpec, port_free

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spec(tmp: Path, name: str, *extra: str) -> ServerSpec:
    port = free_port()
    return ServerSpec(name=name, argv=[sys.executable, str(HERE / "tiny_server.py"), "--port", str(port),
                                       "--pid-file", str(tmp / f"{name}.pid"), *extra],
                      log_path=tmp / "logs" / f"{name}.log", ready_url=f"http://127.0.0.1:{port}/v1/models", port=port)


def pids(tmp: Path, name: str) -> list[int]:
    return [int(x) for x in (tmp / f"{name}.pid").read_text().split()]


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie no one reaped yet is dead


def wait_gone(all_pids: list[int]) -> list[int]:
    """The pids still alive once they are all gone or a generous bound has passed (not a timing claim)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        alive = [p for p in all_pids if not gone(p)]
        if not alive:
            return []
        time.sleep(0.05)
    return [p for p in all_pids if not gone(p)]


def test_servers_start_answer_and_stop_with_their_children(tmp_path):
    specs = [spec(tmp_path, "a"), spec(tmp_path, "b")]
    with LocalServers(specs, ready_timeout_s=120, grace_s=10) as servers:
        servers.wait_ready()
        assert sorted(servers.alive()) == ["a", "b"]
        running = pids(tmp_path, "a") + pids(tmp_path, "b")
        assert not any(gone(p) for p in running)
        assert "tiny server up" in (tmp_path / "logs" / "a.log").read_text()  # the log is kept
    assert wait_gone(running) == []


def test_a_server_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    s = spec(tmp_path, "stubborn", "--ignore-sigterm")
    servers = LocalServers([s], ready_timeout_s=120, grace_s=0.5).start()
    servers.wait_ready()
    running = pids(tmp_path, "stubborn")
    servers.stop()
    assert wait_gone(running) == []


PARENT = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from dflash_flow.engine.launch import LocalServers, ServerSpec
mode = {mode!r}
s = ServerSpec(name="x", argv={argv!r}, log_path={log!r}, ready_url={url!r})
servers = LocalServers([s], ready_timeout_s=120, grace_s=10).start()
servers.wait_ready()
print("ready", flush=True)
if mode == "return":
    sys.exit(0)            # no stop(): the atexit hook
if mode == "raise":
    raise RuntimeError("a bug in the run")
time.sleep(600)            # waits for the test's signal
"""


@pytest.mark.parametrize("mode, signum", [("return", None), ("raise", None), ("wait", signal.SIGINT),
                                          ("wait", signal.SIGTERM), ("wait", signal.SIGKILL)])
def test_no_server_outlives_the_process_that_started_it(tmp_path, mode, signum):
    s = spec(tmp_path, "x")
    code = PARENT.format(root=str(ROOT), mode=mode, argv=list(s.argv), log=str(s.log_path), url=s.ready_url)
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert parent.stdout.readline().strip() == "ready", parent.stderr.read()
    running = pids(tmp_path, "x")
    if signum is not None:
        parent.send_signal(signum)
    parent.wait(timeout=120)
    assert wait_gone(running) == [], f"left behind after {mode}/{signum}: {running}"


def test_a_server_that_never_answers_is_named_with_what_was_awaited(tmp_path):
    port = free_port()
    s = ServerSpec(name="mute", argv=[sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); "
                                      "time.sleep(600)"],
                   log_path=tmp_path / "mute.log", ready_url=f"http://127.0.0.1:{port}/v1/models")
    servers = LocalServers([s], ready_timeout_s=0.5, grace_s=5).start()
    deadline = time.monotonic() + 90  # the process is up (its pid logged) before the wait begins
    while not (tmp_path / "mute.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        with pytest.raises(LaunchError, match=rf"server mute did not answer GET http://127.0.0.1:{port}/v1/models "
                                              r"within 0.5 s .*ready_timeout_s.*mute.log"):
            servers.wait_ready()
    finally:
        servers.stop()
    pid = int((tmp_path / "mute.log").read_text().split()[0])
    assert wait_gone([pid]) == []


def test_a_server_that_exits_at_start_shows_its_last_lines(tmp_path):
    s = ServerSpec(name="bad", argv=[sys.executable, "-c", "import sys; print('CUDA out of memory'); sys.exit(4)"],
                   log_path=tmp_path / "bad.log", ready_url="http://127.0.0.1:9/v1/models")
    with pytest.raises(LaunchError, match=r"server bad exited with code 4 during start-up; .*CUDA out of memory"):
        with LocalServers([s], ready_timeout_s=120) as servers:
            servers.wait_ready()


def test_a_busy_port_is_refused_before_anything_starts(tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        assert not port_free(port)
        s = ServerSpec(name="p", argv=[sys.executable, "-c", "pass"], log_path=tmp_path / "p.log",
                       ready_url=f"http://127.0.0.1:{port}/v1/models", port=port)
        with pytest.raises(LaunchError, match=rf"port {port} for server p is in use"):
            LocalServers([s]).start()
    assert not (tmp_path / "p.log").exists()
    assert os.path.isdir(tmp_path)
