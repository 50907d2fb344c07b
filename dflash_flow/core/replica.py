"""A stage replica and its thread's work, told to the supervisor; and the no-progress watchdog (``watch``)."""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

from .channel import END_OF_STREAM, Channel, ChannelCancelled, ErrorItem, Router, Sentinel
from .devices import setup_thread
from .errors import DflashFlowError, PipelineStalled, SavedStateError, StopRequested
from .snapshot import ReplicaSnapshot, ReplicaState
from .stage import Source, Stage, StageContext


def thread_sched(native_id: int | None) -> tuple[float, float] | None:
    """(CPU seconds a thread has run, seconds it waited runnable for a core); None where the OS does not say."""
    if native_id is None:
        return None
    try:
        with open(f"/proc/self/task/{int(native_id)}/schedstat", "rb") as f:
            ran, waited = f.read().split()[:2]
        return int(ran) / 1e9, int(waited) / 1e9
    except (OSError, ValueError):
        return None


#: Stands for an input that produced no output, so an ordered consumer does not wait for it.
TOMBSTONE = Sentinel("TOMBSTONE")


class Replica:
    """One stage replica: its stage object and context, its channels, and what it has done (snapshots read it)."""

    def __init__(self, spec_name: str, type_name: str, index: int, stage: Stage, ctx: StageContext):
        self.name = spec_name
        self.type_name = type_name
        self.index = index
        self.stage = stage
        self.ctx = ctx
        self.input: Channel | None = None
        self.routers: list[Router] = []
        self.ordered = False
        self.send_tombstones = False
        self.thread: threading.Thread | None = None
        self.state = ReplicaState.PENDING
        self.state_since = time.monotonic()
        self.started_at: float | None = None
        self.setup_ended_at: float | None = None
        self.ended_at: float | None = None
        self.items_in = 0
        self.items_out = 0
        self.blocked_out_s = 0.0
        self.resume_state: dict[str, Any] | None = None
        self.state_loaded = False  # until the resume state is loaded, it is this replica's state
        self.final_state: dict[str, Any] | None = None
        # Set when every consumer of its output stopped taking items: what is queued or to come is dropped.
        self.abandoned = False
        self.items_dropped = 0
        # An ordered consumer's most items held out of order at once, and the replicas upstream of it.
        self.heap_peak = 0
        self.upstream: list[Replica] = []
        self.home_device: str | None = None  # the first GPU of the rank's slice (devices.setup_thread)
        self.native_id: int | None = None  # its thread's, once running
        self.sched_at_end: tuple[float, float] | None = None  # thread_sched when it ended

    @property
    def label(self) -> str:
        return f"{self.name}[{self.index}]"

    def set_state(self, state: ReplicaState) -> None:
        self.state = state
        self.state_since = time.monotonic()

    def blocked_in_s(self) -> float:
        """Seconds waiting for input, a wait still going on included."""
        if self.input is None:
            return 0.0
        ongoing = self.input.waiting_s(self.thread.ident) if self.thread is not None and self.ended_at is None else 0.0
        return self.input.blocked_get_s + ongoing

    def blocked_out_now_s(self) -> float:
        """Seconds waiting to put output, a put still waiting included."""
        if self.thread is None or self.ended_at is not None or self.state is not ReplicaState.BLOCKED:
            return self.blocked_out_s
        ident = self.thread.ident
        return self.blocked_out_s + sum(ch.waiting_s(ident) for router in self.routers for ch in router.channels)

    def snapshot(self, now: float) -> ReplicaSnapshot:
        """Its cumulative readings as of ``now`` (lock-free reads of fields its thread writes)."""
        start = self.started_at or now
        end = self.ended_at or now
        alive = max(end - start, 0.0)
        setup = max((self.setup_ended_at or end) - start, 0.0)
        bin_ = self.blocked_in_s()
        bout = self.blocked_out_now_s()
        sched = self.sched_at_end if self.ended_at is not None else thread_sched(self.native_id)
        return ReplicaSnapshot(
            replica=self.index, device=self.ctx.device, state=self.state, items_in=self.items_in,
            items_out=self.items_out, busy_s=max(alive - bin_ - bout, 0.0), blocked_in_s=bin_, blocked_out_s=bout,
            alive_s=alive, metrics=self.ctx.metrics.read(), channel=self.input.stats() if self.input is not None else None,
            cpu_s=sched[0] if sched is not None else None, cpu_wait_s=sched[1] if sched is not None else None,
            setup_s=setup)


def main(rep: Replica, sup: Any) -> None:
    """The replica's thread; it tells ``sup`` (``runtime.Pipeline``) ``fail``, ``has_failed`` and ``replica_ended``."""
    phase = "setup"
    rep.native_id = threading.get_native_id()
    rep.started_at = time.monotonic()
    rep.set_state(ReplicaState.SETUP)
    try:
        try:
            setup_thread(list(rep.ctx.devices), rep.home_device)  # this thread on its GPU, before the stage uses any
            rep.stage.setup(rep.ctx)
        except StopRequested:
            # The run stopped during a long setup: no work; its outputs close, downstream ends as in a stop.
            _close_outputs(rep)
            return
        if rep.resume_state is not None:
            try:
                rep.stage.load_state_dict(rep.resume_state)
            except DflashFlowError:
                raise
            except (TypeError, ValueError, KeyError, IndexError, AttributeError, OverflowError) as exc:
                # A saved state without the shape the stage writes: the checkpoint's fault, not the stage's.
                raise SavedStateError(f"its saved state cannot be restored ({type(exc).__name__}: {exc})") from exc
        rep.state_loaded = True
        rep.setup_ended_at = time.monotonic()
        phase = "produce" if rep.input is None else "process"
        (_run_source if rep.input is None else _run_transform)(rep)
        phase = "finish"
        try:
            for out in _outputs(rep, rep.stage.finish(), "finish"):
                emit(rep, None, out)
        except StopRequested:
            pass  # the run is stopping: finish's work was abandoned, the outputs still close
        _close_outputs(rep)
        phase = "state_dict"
        rep.final_state = rep.stage.state_dict()
    except (ChannelCancelled, _UpstreamFailed):
        pass
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the supervisor
        sup.fail(rep, phase, exc)
    finally:
        rep.set_state(ReplicaState.TEARDOWN)
        try:
            rep.stage.teardown()
        except BaseException as exc:  # noqa: BLE001
            sup.fail(rep, "teardown", exc)
        if rep.final_state is None:
            try:
                rep.final_state = rep.stage.state_dict()
            except BaseException:  # noqa: BLE001 - a broken state_dict must not hide the real error
                rep.final_state = None
        rep.sched_at_end = thread_sched(rep.native_id)
        rep.ended_at = time.monotonic()
        rep.set_state(ReplicaState.FAILED if sup.has_failed(rep) else ReplicaState.FINISHED)
        sup.replica_ended(rep)


def _close_outputs(rep: Replica) -> None:
    for router in rep.routers:
        for ch in router.channels:
            ch.close()


def _run_source(rep: Replica) -> None:
    if not isinstance(rep.stage, Source):
        raise TypeError(f"stage '{rep.name}' has no input: its type must be a Source with produce()")
    it = iter(rep.stage.produce())
    seq = 0
    stop = rep.ctx.stop_requested  # the pipeline's stop
    while not stop.is_set() and not rep.abandoned:
        rep.set_state(ReplicaState.BUSY)
        try:
            item = next(it)
        except (StopIteration, StopRequested):
            break
        emit(rep, seq, item)
        seq += 1
    if isinstance(it, Generator):
        it.close()


def _run_transform(rep: Replica) -> None:
    ch = rep.input
    one_to_one = type(rep.stage).cardinality == "1:1"
    counter = itertools.count()
    heap: list[tuple[int, int, Any]] = []
    expected = 0
    tie = itertools.count()
    bounded = True  # an ordered consumer holds at most its input's capacity out of order (Channel.get_seq)
    while True:
        rep.set_state(ReplicaState.WAITING)
        if rep.ordered and bounded and len(heap) >= ch.capacity:
            env = ch.get_seq(expected, progress=lambda: upstream_progress(rep))
            if env is None:  # it will not come (a gap left by a cancelled upstream): the rest as it comes
                bounded = False
                continue
        else:
            env = ch.get()
        if env is END_OF_STREAM:
            break
        if isinstance(env, ErrorItem):
            raise _UpstreamFailed()
        seq, item = env
        if rep.ordered and seq is not None:
            heapq.heappush(heap, (seq, next(tie), item))
            while heap and heap[0][0] <= expected:
                s, _, it = heapq.heappop(heap)
                expected = max(expected, s + 1)
                _handle(rep, s, it, one_to_one, counter)
            rep.heap_peak = max(rep.heap_peak, len(heap))
            continue
        _handle(rep, seq, item, one_to_one, counter)
    # Anything still held (gaps can only come from a cancelled upstream) goes out in order.
    while heap:
        s, _, it = heapq.heappop(heap)
        _handle(rep, s, it, one_to_one, counter)


def upstream_progress(rep: Replica) -> int | None:
    """None while a replica upstream of ``rep`` works; else the items they took and emitted in all (equal at two
    looks: nothing upstream moved; ``Channel.get_seq``)."""
    total = 0
    for up in rep.upstream:
        if up.state in (ReplicaState.PENDING, ReplicaState.SETUP, ReplicaState.BUSY):
            return None
        total += up.items_in + up.items_out
    return total


def _handle(rep: Replica, seq: Any, item: Any, one_to_one: bool, counter) -> None:
    if item is TOMBSTONE:
        if rep.send_tombstones:
            emit(rep, seq, TOMBSTONE)
        return
    if rep.abandoned:
        rep.items_dropped += 1
        return
    rep.set_state(ReplicaState.BUSY)
    rep.items_in += 1
    emitted = 0
    try:
        for out in _outputs(rep, rep.stage.process(item), "process"):
            emitted += 1
            if not one_to_one:
                emit(rep, next(counter), out)
                continue
            if emitted > 1:
                raise RuntimeError(f"stage type '{rep.type_name}' is declared 1:1 but emitted more than one item "
                                   "for one input (declare cardinality = '1:n')")
            emit(rep, seq, out)
    except StopRequested:
        pass  # the item was abandoned because the run is stopping: no (further) output
    if emitted == 0 and one_to_one and rep.send_tombstones:
        emit(rep, seq, TOMBSTONE)


def _outputs(rep: Replica, outs: Any, hook: str) -> Iterator[Any]:
    """What ``process`` / ``finish`` returned (a bare item is refused), until the replica is abandoned."""
    if outs is not None and not isinstance(outs, (list, tuple, Iterator)):
        raise TypeError(f"stage '{rep.name}' ({rep.type_name}).{hook}() returned a bare {type(outs).__name__}; return "
                        "its outputs in a list or tuple (`return (item,)`), yield them, or return None for no output")
    it = iter(() if outs is None else outs)
    try:
        for out in it:
            if rep.abandoned:
                rep.items_dropped += 1
                break
            yield out
    finally:
        if isinstance(it, Generator):
            it.close()


def emit(rep: Replica, seq: Any, item: Any) -> None:
    env = (seq, item)
    blocked = 0.0
    state, since = rep.state, rep.state_since
    rep.state = ReplicaState.BLOCKED  # a put that waits shows as blocked on output, not busy, to the watchdog
    for router in rep.routers:
        target = router.targets()
        for ch in target if isinstance(target, list) else (target,):
            blocked += ch.put(env)
    rep.state, rep.state_since = state, since
    if item is not TOMBSTONE:
        rep.items_out += 1
    if blocked:
        rep.blocked_out_s += blocked
        rep.state_since = time.monotonic()


class _UpstreamFailed(Exception):
    pass


def replica_state(rep: Replica) -> dict[str, Any]:
    if rep.final_state is not None:
        return rep.final_state
    if rep.resume_state is not None and not rep.state_loaded:
        return rep.resume_state
    return rep.stage.state_dict()


# -- the no-progress watchdog -----------------------------------------------------------------------
def running_time(gap_s: float, interval_s: float) -> float:
    """The running time between two watchdog ticks: a late tick means the process was suspended, so a gap counts
    for at most ``interval_s`` plus half an interval (at least 50 ms) of jitter."""
    cap = interval_s + max(0.5 * interval_s, 0.05)
    return min(max(gap_s, 0.0), cap)


def watch(replicas: dict[str, list[Replica]], rt: Any, should_end: Callable[[float], bool],
          cancelled: Callable[[], bool], on_stall: Callable[[PipelineStalled], None]) -> None:
    """The supervisor thread's loop: no progress for ``rt.stall_timeout_s`` of running time hands ``on_stall`` a
    :class:`PipelineStalled`; ``should_end(s)`` waits up to ``s`` seconds and says whether the run ended."""
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
        progress = progress_count(replicas)
        if progress != last_progress:
            last_progress = progress
            idle = 0.0
            continue
        idle += ran
        if idle >= timeout:
            on_stall(_stall_error(replicas, idle))
            return


def progress_count(replicas: dict[str, list[Replica]]) -> int:
    """Items in and out and heartbeats so far: grows while the pipeline makes progress."""
    return sum(rep.items_in + rep.items_out + rep.ctx.heartbeats + (rep.input.items_in if rep.input else 0)
               for reps in replicas.values() for rep in reps)


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

