"""The no-progress watchdog of the supervisor: running time without progress (suspensions excluded), the
stalled stage named with every queue depth."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from .errors import PipelineStalled
from .replica import Replica
from .snapshot import ReplicaState


def running_time(gap_s: float, interval_s: float) -> float:
    """How much of the wall time between two watchdog ticks counts as time the pipeline had to make
    progress. The watchdog waits ``interval_s`` between ticks; a tick that comes much later than that means
    the process could not run (SIGSTOP until SIGCONT, a debugger, a frozen VM): that suspended time is not
    no-progress time. A late tick counts for at most ``interval_s`` plus a jitter allowance (half an interval,
    at least 50 ms), so a suspension of any length adds at most that allowance, and ordinary scheduling
    delays on a busy machine still count in full."""
    cap = interval_s + max(0.5 * interval_s, 0.05)
    return min(max(gap_s, 0.0), cap)


def watch(replicas: dict[str, list[Replica]], rt: Any, should_end: Callable[[float], bool],
          cancelled: Callable[[], bool], on_stall: Callable[[PipelineStalled], None]) -> None:
    """The supervisor thread's loop: no progress for ``stall_timeout_s`` of running time hands a
    :class:`PipelineStalled` naming the stalled stage and every queue depth to ``on_stall``. ``should_end(s)``
    waits up to ``s`` seconds and says whether the run ended; ``rt``: the graph's ``RuntimeOptions``."""
    timeout = rt.stall_timeout_s
    interval = rt.watchdog_interval_s
    last_progress = None
    idle = 0.0  # time the process ran without progress (suspended time excluded: running_time)
    last_tick = time.monotonic()
    while not should_end(interval):
        now = time.monotonic()
        ran = running_time(now - last_tick, interval)
        last_tick = now
        if timeout <= 0 or cancelled():
            continue
        progress = _progress(replicas)
        if progress != last_progress:
            last_progress = progress
            idle = 0.0
            continue
        idle += ran
        if idle >= timeout:
            on_stall(_stall_error(replicas, idle))
            return


def progress_count(replicas: dict[str, list[Replica]]) -> int:
    """How much the pipeline has done so far (items in and out, heartbeats): a number that grows while it makes
    progress. What a rank shares with the others of its job (``app.distributed.PeerProgress``)."""
    return _progress(replicas)[0]


def _progress(replicas: dict[str, list[Replica]]) -> tuple:
    total = 0
    for reps in replicas.values():
        for rep in reps:
            total += rep.items_in + rep.items_out + rep.ctx.heartbeats
            if rep.input is not None:
                total += rep.input.items_in
    return (total,)

def _stall_error(replicas: dict[str, list[Replica]], idle: float) -> PipelineStalled:
    depths = {}
    busy = []
    blocked = []
    for reps in replicas.values():
        for rep in reps:
            if rep.input is not None:
                depths[rep.label] = f"{rep.input.depth}/{rep.input.capacity}"
            age = time.monotonic() - rep.state_since
            if rep.state in (ReplicaState.BUSY, ReplicaState.SETUP):
                doing = getattr(rep.ctx, "busy_with", "")  # what a long call says it waits on (a server, a file)
                busy.append((age, f"{rep.label} ({'in setup' if rep.state is ReplicaState.SETUP else 'in process'} "
                                  f"for {age:.0f}s{': ' + doing if doing else ''})"))
            elif rep.state is ReplicaState.WAITING:
                blocked.append(f"{rep.label} (waiting for input)")
    if busy:
        busy.sort(reverse=True)
        stalled = [b[1] for b in busy]
        head = f"no progress for {idle:.0f}s; stalled stage: {stalled[0]}"
    else:
        stalled = blocked
        head = f"no progress for {idle:.0f}s and no stage is working (deadlock?): " + ", ".join(blocked)
    depth_text = ", ".join(f"{k}={v}" for k, v in depths.items())
    return PipelineStalled(f"{head}; queue depths: {depth_text}", stalled, depths)

