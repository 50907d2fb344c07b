"""What the supervisor reports about a running pipeline: plain attrs objects of cumulative readings
(seconds busy/blocked, items, metric values), built once per ``Pipeline.snapshot()``.

Readers turn two snapshots into window values (``dflash_flow.observe.sample.take_sample``); there is no
flat key form here: MLflow keys are made only at the MLflow boundary (``observe.schema``)."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from .channel import ChannelStats
from .metrics import merge_values


class ReplicaState(enum.StrEnum):
    """Where a replica's thread is. String-valued, so a snapshot's state prints and compares as its name."""

    PENDING = "pending"  # its thread has not started
    SETUP = "setup"  # in the stage's setup (and loading its resume state)
    WAITING = "waiting"  # waiting for input
    BUSY = "busy"  # in the stage's own code (process, produce, finish)
    BLOCKED = "blocked"  # waiting to put an output (backpressure)
    TEARDOWN = "teardown"
    FINISHED = "finished"
    FAILED = "failed"


@attrs.define
class ReplicaSnapshot:
    replica: int
    device: str
    state: ReplicaState
    items_in: int
    items_out: int
    busy_s: float
    blocked_in_s: float
    blocked_out_s: float
    alive_s: float
    metrics: dict[str, Any]
    channel: ChannelStats | None
    cpu_s: float | None = None  # CPU seconds its thread has run (None: the OS does not say)
    cpu_wait_s: float | None = None  # seconds its thread has waited, runnable, for a core
    # Seconds from its thread's start to the end of its setup (and resume state): a setup still going on counts
    # so far. ``busy_s`` includes it (busy is alive less blocked); a steady-state rate leaves it out.
    setup_s: float = 0.0


@attrs.define
class StageSnapshot:
    name: str
    type: str
    replicas: list[ReplicaSnapshot]
    metric_kinds: dict[str, str]

    def metric(self, name: str) -> Any:
        values = [r.metrics[name] for r in self.replicas if name in r.metrics]
        return merge_values(self.metric_kinds.get(name, "gauge"), values)

    def fractions(self) -> dict[str, float]:
        alive = sum(r.alive_s for r in self.replicas) or 1e-9
        return {
            "busy": sum(r.busy_s for r in self.replicas) / alive,
            "blocked_in": sum(r.blocked_in_s for r in self.replicas) / alive,
            "blocked_out": sum(r.blocked_out_s for r in self.replicas) / alive,
        }


@attrs.define
class RuntimeSnapshot:
    time: float
    elapsed_s: float
    stages: dict[str, StageSnapshot]
    cpu_s: float | None = None  # the process's CPU seconds so far, all its threads (None: not read)
