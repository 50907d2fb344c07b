"""The small process between a run and a server it started: ``python -m dflash_flow.engine.guard FD GRACE -- CMD...``.

In a session of its own, it starts ``CMD`` in its group and, when the pipe ``FD`` from the run closes (even by
SIGKILL), stops the group: SIGTERM, then SIGKILL after ``GRACE`` seconds. Stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time


def _stop_group(proc: subprocess.Popen, grace_s: float) -> None:
    pgid = os.getpgid(0)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the server, not for us
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    # The server's children may outlive it; SIGKILL the whole group (this process included) in any case.
    sys.stdout.flush()
    os.killpg(pgid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m dflash_flow.engine.guard FD GRACE_S -- CMD...", file=sys.stderr)
        return 2
    fd, grace_s, cmd = int(argv[0]), float(argv[1]), argv[3:]
    os.set_blocking(fd, True)
    proc = subprocess.Popen(cmd)  # same process group as this guard (its own session)

    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    while True:
        if stopping:
            _stop_group(proc, grace_s)
        try:
            ready, _, _ = select.select([fd], [], [], 0.2)
        except InterruptedError:
            continue
        if ready:
            try:
                data = os.read(fd, 1)
            except OSError:
                data = b""
            if not data:  # the run closed its end, or died
                _stop_group(proc, grace_s)
        rc = proc.poll()
        if rc is not None:  # the server ended by itself: its children (vLLM's engine core) go with it
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(0), signal.SIGTERM)
            return rc if rc >= 0 else 128 - rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
