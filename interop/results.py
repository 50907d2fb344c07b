"""The start and the end every interop check shares: what the result file records about the run (the command,
the machine's load before and after, the wall time, the return code) and the lines it prints at the end."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def begin(command: str, argv: Sequence[str] | None) -> tuple[dict[str, Any], float]:
    """(what the result is stamped with, the wall clock's start) for ``command`` run with ``argv``."""
    from run_all import load_avg

    args = argv if argv is not None else sys.argv[1:]
    started = {"command": command + "".join(f" {shlex.quote(a)}" for a in args), "started_unix": int(time.time()),
               "load_avg_before": load_avg()}
    return started, time.perf_counter()


def finish(name: str, out: Path, figures: dict[str, Any], failed: list[str], host: Any, started: dict[str, Any],
           t0: float, say: Callable[[str], None]) -> int:
    """Write ``figures`` (with the failures and the machine) to ``out``, stamp it, print each failure and the
    verdict; the process's exit code (1 when anything failed)."""
    from common import write_result
    from run_all import load_avg, stamp

    figures["failed"] = failed
    figures["machine"] = host
    write_result(out, figures)
    stamp(out, {**started, "wall_s": round(time.perf_counter() - t0, 1), "load_avg_after": load_avg(),
                "returncode": 1 if failed else 0})
    for line in failed:
        print(f"{name}: FAILED {line}", file=sys.stderr)
    say(f"{'FAILED' if failed else 'passed'}; results in {out}")
    return 1 if failed else 0
