"""The supervisor: one thread per stage replica, channels between them. An error or a stop cancels every
channel and joins every thread; one stuck past ``shutdown_grace_s`` is abandoned (``Pipeline.abandoned``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Generic

import attrs

from .assembly import assemble, only_feeding
from .channel import END_OF_STREAM, ChannelCancelled, ErrorItem
from .devices import setup_thread
from .errors import PipelineInterrupted, PipelineStalled, ShutdownTimeout, StageError
from .graph import Graph
from .replica import TOMBSTONE, Replica, replica_state, watch
from .replica import main as replica_main
from .snapshot import RuntimeSnapshot, Sampler, StageSnapshot
from .stage import ServicesT
from .stopping import StopController, StopSignal, controller
from .validate import Validated, validated


@attrs.define
class RunResult:
    """What a completed ``Pipeline.run()`` returns (failures and stops raise instead)."""

    elapsed_s: float
    snapshot: RuntimeSnapshot
    states: dict[str, list[dict[str, Any]]]


class Pipeline(Generic[ServicesT]):
    """The bare runtime: a graph on a thread per replica; ``run()``, or ``iterate(stage)`` with ``collect``.
    ``resume_state``: as ``state_dict()`` returned; ``rank``/``world_size``/...: default from torchrun's env."""

    def __init__(self, graph: Graph | Validated, *, services: ServicesT | None = None,
                 resume_state: dict[str, list[dict[str, Any]]] | None = None, rank: int | None = None,
                 world_size: int | None = None, local_rank: int | None = None, local_world_size: int | None = None,
                 output_dir: str | Path | None = None, check_devices: bool = True, collect: list[str] | None = None):
        v = graph if isinstance(graph, Validated) else validated(graph, check_devices=check_devices)
        self.validated = v
        self.graph = v.graph
        self.rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if local_world_size is None else local_world_size
        self.output_dir = Path(output_dir) if output_dir else self.graph.run_dir
        self.services: ServicesT | dict[str, Any] = services if services is not None else {}
        self._lock = threading.Lock()
        self._done = threading.Event()
        # Set when every thread ended or the run was cancelled: run() then shuts down.
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._errors: list[StageError] = []
        self._interrupted: str | None = None
        self._cancelled = False
        self._stall: PipelineStalled | None = None
        self._running = 0
        self._started = False
        self._finished = False
        self._start_time = 0.0
        self._end_time: float | None = None
        self._watch_stop = threading.Event()
        self._stuck: list[str] = []
        # The drain timer of a stop (False once shutdown began: none may start after that) and the watchdog.
        self._drain_timer: threading.Timer | bool | None = None
        self._watchdog: threading.Thread | None = None
        # The one sampler of the run: the Monitor and `profile` subscribe to it.
        self.sampler = Sampler(self.snapshot, self._subscriber_failed)
        self.home_device, self.replicas, self._collect = assemble(
            v, self, stop=self._stop, resume_state=resume_state or {}, collect=collect or [])

    # -- public API -------------------------------------------------------------------------------
    def run(self) -> RunResult:
        """Run to completion. Raises StageError, PipelineStalled or PipelineInterrupted."""
        if self._collect:
            raise RuntimeError("this pipeline collects outputs; use iterate()")
        with controller().running() as stopping:
            try:
                received: list[BaseException] = []
                try:
                    self._start()
                except KeyboardInterrupt as exc:
                    if self._watchdog is None:
                        raise  # during the stage imports (preload): nothing runs yet
                    received.append(exc)
                self._supervise(stopping, received)
            finally:
                stopping.wind_down()
                self._shutdown()
        self._raise_if_failed()
        snap = self.snapshot()
        return RunResult(snap.elapsed_s, snap, self.state_dict())

    def _supervise(self, stopping: StopController, received: list[BaseException]) -> None:
        """Wait until the run ends; a stop signal lands here (first: drain, next: cancel), under a hold."""
        acted = 0
        while received or not self._wake.is_set():
            try:
                with stopping.hold():
                    if received:
                        exc = received.pop(0)
                        acted += 1
                        reason = exc.name if isinstance(exc, StopSignal) else "SIGINT"
                        (self.stop if acted == 1 else self.cancel)(reason)
                        stopping.announce_stop(reason, forced=acted > 1)
                if not received:
                    self._wake.wait()
            except KeyboardInterrupt as exc:
                received.append(exc)

    def iterate(self, stage: str | None = None) -> Iterator[Any]:
        """Yield the outputs of ``stage`` (declared in ``collect``) in the calling thread."""
        if not self._collect:
            raise RuntimeError("pass collect=[STAGE] to Pipeline to iterate over a stage's output")
        name = stage or next(iter(self._collect))
        ch = self._collect[name]
        self._start()
        try:
            while True:
                try:
                    env = ch.get()
                except ChannelCancelled:
                    break
                if env is END_OF_STREAM:
                    # Let other branches finish rather than have _shutdown cancel them (an interruption).
                    self._wake.wait()
                    break
                if isinstance(env, ErrorItem):
                    break
                _, item = env
                if item is TOMBSTONE:
                    continue
                yield item
        except GeneratorExit:
            self.cancel("consumer closed the iterator")
            raise
        except BaseException:
            self.cancel("consumer raised")
            raise
        finally:
            self._shutdown()
        self._raise_if_failed()

    def stop(self, reason: str = "stop requested") -> None:
        """Graceful stop: sources stop, in-flight items drain (cancelled after ``runtime.drain_timeout_s``)."""
        with self._lock:
            if self._interrupted is None:
                self._interrupted = reason
        self._stop.set()
        with self._lock:
            # One drain timer per run: a second stop() must not start (and leak) another one.
            if not self._started or self._done.is_set() or self._drain_timer is not None:
                return
            t = threading.Timer(self.graph.runtime.drain_timeout_s, self.cancel, args=(f"{reason}: drain timed out",))
            t.name = "dflash-flow-drain-timer"
            self._drain_timer = t
            t.start()

    def abandon_upstream(self, stage: str) -> list[str]:
        """``stage`` takes no more input (a trainer stopped at a consistent point): the stages whose work can only
        reach it drop their inputs unprocessed (end-of-stream still flows); returns their names."""
        gone = only_feeding(self.graph, stage, self._collect)
        for name in gone:
            for rep in self.replicas[name]:
                rep.abandoned = True
        return gone

    def cancel(self, reason: str = "cancelled") -> None:
        """Immediate stop: every channel wakes its waiters with ChannelCancelled. Idempotent."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            if self._interrupted is None and not self._errors and self._stall is None:
                self._interrupted = reason
        self._stop.set()
        self._wake.set()
        inputs = [rep.input for reps in self.replicas.values() for rep in reps if rep.input is not None]
        for ch in [*inputs, *self._collect.values()]:
            ch.cancel()

    def snapshot(self) -> RuntimeSnapshot:
        """Every replica's state, counts, busy/blocked time, metrics and queue, as of now (lock-free reads)."""
        now = time.monotonic()
        stages = {}
        for spec in self.graph.stages:
            reps = [rep.snapshot(now) for rep in self.replicas[spec.name]]
            kinds = {m.name: m.kind for rep in self.replicas[spec.name] for m in rep.ctx.metrics}
            stages[spec.name] = StageSnapshot(spec.name, spec.type, reps, kinds)
        end = self._end_time or now
        return RuntimeSnapshot(time=now, elapsed_s=(end - self._start_time) if self._started else 0.0, stages=stages,
                               cpu_s=time.process_time())

    def state_dict(self) -> dict[str, list[dict[str, Any]]]:
        """Every replica's ``state_dict()`` (``replica.replica_state``)."""
        return {name: [replica_state(rep) for rep in reps] for name, reps in self.replicas.items()}

    # -- what a stage may use as ``ctx.runtime`` (stage.RuntimeAccess) ---------------------------------
    request_stop = stop  # e.g. because another rank of the job stops
    stage_states = state_dict

    def subscribe(self, callback: Any, interval_s: float, *, owner: str) -> Any:
        """Have the sampler call ``callback(snapshot)`` every ``interval_s`` on its thread (see :meth:`unsubscribe`)."""
        return self.sampler.subscribe(callback, interval_s, owner=owner)

    def unsubscribe(self, subscription: Any) -> None:
        self.sampler.unsubscribe(subscription)

    # -- internals --------------------------------------------------------------------------------
    def _start(self) -> None:
        if self._started:
            raise RuntimeError("a Pipeline runs once; build a new one to run again")
        self._started = True
        first: dict[type, str] = {}  # each class preloaded once, named by its first stage
        for name, cls in self.validated.classes.items():
            first.setdefault(cls, name)
        for cls, name in first.items():
            try:
                cls.preload()
            except Exception as exc:
                self._finished = True
                raise self._record_error(name, 0, "preload", exc) from exc
        setup_thread([], self.home_device)  # the starting thread on this rank's GPU too
        # The threads start together: a stop signal meanwhile is held until they all run.
        with controller().hold():
            self._start_time = time.monotonic()
            self.output_dir.mkdir(parents=True, exist_ok=True)
            all_reps = [r for reps in self.replicas.values() for r in reps]
            self._running = len(all_reps)
            for rep in all_reps:
                # Joined on every path (_shutdown); a daemon only so that an abandoned one does not block the exit.
                rep.thread = threading.Thread(target=replica_main, args=(rep, self), name=f"dflash-flow:{rep.label}",
                                              daemon=True)
            self.sampler.start()
            for rep in all_reps:
                rep.thread.start()
            self._watchdog = threading.Thread(
                target=watch, args=(self.replicas, self.graph.runtime,
                                    lambda s: self._done.wait(s) or self._watch_stop.is_set(), lambda: self._cancelled,
                                    self._on_stall), name="dflash-flow:supervisor", daemon=False)
            self._watchdog.start()

    def _record_error(self, stage: str, replica: int, phase: str, exc: BaseException) -> StageError:
        err = StageError(stage, replica, phase, exc)
        err.__cause__ = exc
        with self._lock:
            self._errors.append(err)
        return err

    def fail(self, rep: Replica, phase: str, exc: BaseException) -> None:
        self._record_error(rep.name, rep.index, phase, exc)
        # The error travels downstream as a value, then everything is cancelled.
        for router in rep.routers:
            for ch in router.channels:
                ch.put_error(ErrorItem(rep.name, rep.index, exc))
        self.cancel(f"stage '{rep.name}' failed")

    def _subscriber_failed(self, owner: str, exc: BaseException) -> None:
        """A sampler subscriber raised: the run fails as its owner's (a stage's) failure."""
        if self.replicas.get(owner):
            return self.fail(self.replicas[owner][0], "sample", exc)
        self._record_error(owner, 0, "sample", exc)
        self.cancel(f"'{owner}' failed while sampling")

    def _on_stall(self, err: PipelineStalled) -> None:
        self._stall = err
        self.cancel("stalled")

    # -- what a replica's thread tells the supervisor (replica.main) ----------------------------------
    def has_failed(self, rep: Replica) -> bool:
        return any(e.stage == rep.name and e.replica == rep.index for e in self._errors)

    def replica_ended(self, rep: Replica) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if last:
            self._end_time = time.monotonic()
            self._done.set()
            self._wake.set()

    def _shutdown(self) -> None:
        if self._finished:
            return
        if not any(rep.thread is not None and rep.thread.ident is not None for reps in self.replicas.values() for rep in reps):
            # Interrupted before any thread started (Ctrl-C during the stage imports): nothing to wait for.
            self.cancel("shutdown")
            self._finished = True
            return
        if not self._done.is_set():
            self.cancel("shutdown")
        grace = self.graph.runtime.shutdown_grace_s
        self._done.wait(grace)
        alive = []
        deadline = time.monotonic() + grace
        for reps in self.replicas.values():
            for rep in reps:
                if rep.thread is not None:
                    rep.thread.join(max(deadline - time.monotonic(), 0.0))
                    if rep.thread.is_alive():
                        alive.append(rep.label)
        with self._lock:
            timer = self._drain_timer
            self._drain_timer = False  # no drain timer may start after this point
        if timer:
            timer.cancel()
            timer.join()
        self.sampler.stop()
        self._watch_stop.set()
        if self._watchdog is not None:
            self._watchdog.join()
        self._finished = True
        self._stuck = alive
        if alive:
            logging.getLogger("dflash_flow").warning(
                "abandoned stage threads still running %.0fs after the stop: %s (stuck in the stage's own code; "
                "daemon threads, so the process can still exit)", grace, ", ".join(alive))

    @property
    def abandoned(self) -> list[str]:
        """The stage threads (``stage[replica]``) left running, stuck, after the shutdown grace period."""
        return list(self._stuck)

    def _raise_if_failed(self) -> None:
        stuck = (f"stage threads still running {self.graph.runtime.shutdown_grace_s:.0f}s after the stop: "
                 f"{', '.join(self._stuck)} (blocked outside the runtime's channels; abandoned as daemon threads, "
                 "the process can still exit)") if self._stuck else None
        err = self._errors[0] if self._errors else self._stall  # it names the culprit; stuck threads are a note
        if err is not None:
            if stuck:
                err.add_note(stuck)
            raise err
        if stuck:
            raise ShutdownTimeout(stuck)
        if self._interrupted is not None:
            raise PipelineInterrupted(self._interrupted)

    @property
    def errors(self) -> list[StageError]:
        return list(self._errors)
