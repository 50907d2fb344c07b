"""Local servers a run starts itself and always stops (:class:`LocalServers`): each under a guard
(:mod:`.guard`) in a process group of its own, ready when ``GET ready_url`` answers 200, stopped (SIGTERM to
the group, then SIGKILL) by :meth:`LocalServers.stop`, an ``atexit`` hook, or -- after a SIGKILL of this
process -- the guard, when the pipe from this process closes.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LaunchError", "LocalServers", "ServerSpec", "port_free", "shared_servers"]

GUARD = str(Path(__file__).with_name("guard.py"))


class LaunchError(RuntimeError):
    """A local server that could not be started or did not become ready."""


@dataclass
class ServerSpec:
    """One server: its command, where it logs, and the URL that answers 200 once it is ready."""

    name: str
    argv: Sequence[str]
    log_path: str | os.PathLike
    ready_url: str
    env: Mapping[str, str] | None = None  # the whole environment (default: this process's)
    cwd: str | None = None
    port: int | None = None  # checked free before the start
    headers: Mapping[str, str] = field(default_factory=dict)  # for the readiness request (an API key)


@dataclass
class _Running:
    spec: ServerSpec
    proc: subprocess.Popen
    pipe_w: int
    log: Any
    ready: bool = False


_LIVE: set[LocalServers] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all_at_exit() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for servers in live:
        servers.stop()


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _tail(path: str | os.PathLike, n: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()[-n:]
    except OSError:
        return "(no log)"
    return " | ".join(ln.strip()[:300] for ln in lines) or "(empty log)"


class LocalServers:
    """Start, wait for and stop a set of local servers."""

    def __init__(self, specs: Sequence[ServerSpec], *, ready_timeout_s: float = 1200.0, grace_s: float = 30.0,
                 log: Callable[[str], None] | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"server names repeat: {names}")
        self.specs = list(specs)
        self.ready_timeout_s = ready_timeout_s
        self.grace_s = grace_s
        self.log = log or (lambda _m: None)
        self._running: list[_Running] = []
        self._lock = threading.Lock()
        self.start_s: float | None = None

    def start(self) -> LocalServers:
        busy = [s for s in self.specs if s.port is not None and not port_free(s.port)]
        if busy:
            raise LaunchError(f"port {busy[0].port} for server {busy[0].name} is in use (another server or run?); "
                              "choose another first port (model.engine.launch.port)")
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            for spec in self.specs:
                self._start_one(spec)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_one(self, spec: ServerSpec) -> None:
        Path(spec.log_path).parent.mkdir(parents=True, exist_ok=True)
        log = open(spec.log_path, "ab", buffering=0)
        r, w = os.pipe()  # both ends non-inheritable; the guard gets r explicitly, w stays only here
        try:
            proc = subprocess.Popen([sys.executable, GUARD, str(r), f"{self.grace_s:g}", "--", *spec.argv],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    env=dict(spec.env) if spec.env is not None else None, cwd=spec.cwd,
                                    start_new_session=True, pass_fds=(r,))
        except OSError as e:
            os.close(w)
            log.close()
            raise LaunchError(f"cannot start server {spec.name} ({spec.argv[0]}): {e}") from None
        finally:
            os.close(r)
        with self._lock:
            self._running.append(_Running(spec, proc, w, log))
        self.log(f"started server {spec.name} (pid {proc.pid}; log {spec.log_path})")

    def wait_ready(self, stop: threading.Event | None = None, on_wait: Callable[[], None] | None = None) -> None:
        """Return when every server answers 200; LaunchError when one exits or the timeout passes."""
        t0 = time.monotonic()
        deadline = t0 + self.ready_timeout_s
        while True:
            pending = [r for r in self._running if not r.ready]
            if not pending:
                self.start_s = time.monotonic() - t0
                return
            for r in pending:
                rc = r.proc.poll()
                if rc is not None:
                    raise LaunchError(f"server {r.spec.name} exited with code {rc} during start-up; its log "
                                      f"{r.spec.log_path} ends: {_tail(r.spec.log_path)}")
                if self._answers(r.spec):
                    r.ready = True
                    self.log(f"server {r.spec.name} is ready ({time.monotonic() - t0:.0f} s)")
            if all(r.ready for r in self._running):
                continue
            if time.monotonic() > deadline:
                r = next(r for r in self._running if not r.ready)
                raise LaunchError(
                    f"server {r.spec.name} did not answer GET {r.spec.ready_url} within {self.ready_timeout_s:g} s "
                    f"(raise model.engine.launch.ready_timeout_s for a large model); its log {r.spec.log_path} ends: "
                    f"{_tail(r.spec.log_path)}")
            if on_wait is not None:
                on_wait()
            if stop is not None:
                if stop.wait(0.5):
                    raise LaunchError("stopped while waiting for the servers to start")
            else:
                time.sleep(0.5)

    @staticmethod
    def _answers(spec: ServerSpec) -> bool:
        req = urllib.request.Request(spec.ready_url, headers=dict(spec.headers))
        try:
            with urllib.request.urlopen(req, timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def stop(self) -> None:
        """Stop every server (idempotent, safe from any thread and at exit)."""
        with self._lock:
            running, self._running = self._running, []
        for r in running:  # closing the pipe tells each guard to stop its group (SIGTERM, then SIGKILL)
            with contextlib.suppress(OSError):
                os.close(r.pipe_w)
        for r in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=self.grace_s + 10)
            with contextlib.suppress(ProcessLookupError, PermissionError):  # what is left (a hung guard, a child)
                os.killpg(r.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=10)
            r.log.close()
            self.log(f"stopped server {r.spec.name}")
        with _LIVE_LOCK:
            _LIVE.discard(self)

    def alive(self) -> list[str]:
        return [r.spec.name for r in self._running if r.proc.poll() is None]

    def __enter__(self) -> LocalServers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@dataclass
class _Shared:
    servers: LocalServers
    users: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: bool = False
    failed: BaseException | None = None


_SHARED: dict[object, _Shared] = {}
_SHARED_LOCK = threading.Lock()


def shared_servers(key: object, make: Callable[[], LocalServers], stop: threading.Event | None = None,
                   on_wait: Callable[[], None] | None = None):
    """``(servers, release)``: the ready servers for ``key``, made by ``make()`` for the first user (the others
    wait, and share its error); the last ``release()`` stops them."""
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = _Shared(make())
        entry.users += 1
    try:
        with entry.lock:  # one user starts them; the others wait here until they are ready
            if entry.failed is not None:
                raise LaunchError(str(entry.failed))
            if not entry.ready:
                try:
                    entry.servers.start()
                    entry.servers.wait_ready(stop, on_wait)
                except BaseException as e:
                    entry.failed = e
                    raise
                entry.ready = True
    except BaseException:
        _release(key, entry)
        raise
    return entry.servers, lambda: _release(key, entry)


def _release(key: object, entry: _Shared) -> None:
    with _SHARED_LOCK:
        entry.users -= 1
        last = entry.users <= 0
        if last and _SHARED.get(key) is entry:
            del _SHARED[key]
    if last:
        entry.servers.stop()
