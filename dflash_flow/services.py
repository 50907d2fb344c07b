"""Run services: what the application hands the DFlash stages besides their config.

One typed object (``StageContext.services``), built by the application layer (``dflash_flow.app``) for
each run. Stages read its fields; they never build services themselves. Fields that a run does not have
are None (a pipeline built in Python without the application gets ``RunServices()``: no tracking, no
checkpoints, no resume). The core runtime treats ``services`` as opaque.
"""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Protocol

import attrs

from dflash_flow.observe.record import RunRecord


class MetricSink(Protocol):
    """Where metrics go (the MLflow tracker, ``dflash_flow.observe.tracking.Tracker``)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush_async(self) -> None: ...


@attrs.define(kw_only=True, eq=False)
class CheckpointPayload:
    """What a trainer stage hands the checkpoint service; the service adds every other stage's state."""

    step: int
    epoch: int
    model_state: dict[str, Any]
    optimizer_state: dict[str, Any]
    data_position: dict[str, Any]  # where the data stream continues after a resume
    stage: str  # the stage that wrote it ...
    stage_state: dict[str, Any]  # ... and its own state_dict at this point
    extra: dict[str, Any] = attrs.field(factory=dict)
    files: dict[str, str] = attrs.field(factory=dict)  # small text files, e.g. the drafter's config.json


class CheckpointSource(abc.ABC):
    """A stage that hands the checkpoint service its payload (DrafterStep); a base class, not a name looked
    up: a subclass that does not implement ``checkpoint_payload`` cannot be built."""

    @abc.abstractmethod
    def checkpoint_payload(self, epoch_end: bool = False) -> CheckpointPayload: ...


class Checkpoints(Protocol):
    """Checkpoint policy and writer (``dflash_flow.app.checkpoint.CheckpointService``)."""

    on_signal: bool

    def after_step(self, source: CheckpointSource, *, step: int, epoch_end: bool) -> Path | None: ...

    def save(self, source: CheckpointSource, *, epoch_end: bool = False) -> Path | None: ...


class Resume(Protocol):
    """The checkpoint a run continues from (``dflash_flow.app.checkpoint.Checkpoint``)."""

    step: int
    epoch: int
    data_position: dict[str, Any]
    extend: bool  # asked to extend the run (--extend): a new length re-plans the learning-rate schedule

    def model_state(self, device: str = "cpu") -> dict[str, Any]: ...

    def optimizer_state(self) -> dict[str, Any]: ...


class Collective(Protocol):
    """The job's ranks under torchrun (``dflash_flow.app.distributed.Distributed``)."""

    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...

    def reduce_train(self, metrics: dict[str, float], position_accuracy: tuple[float, ...],
                     sample: bool) -> tuple[dict[str, float], tuple[float, ...], bool]: ...

    def gather_to_main(self, obj: Any) -> list[Any] | None: ...


@attrs.define(eq=False, kw_only=True)
class RunServices:
    tracker: MetricSink | None = None
    checkpoints: Checkpoints | None = None
    resume: Resume | None = None
    record: RunRecord = attrs.field(factory=RunRecord)
    tokenizer: Any = None  # a tokenizer object for ChatSource stages given no tokenizer path
    dist: Collective | None = None  # set when the pipeline runs as one rank of a torchrun job


def agree_to_stop(dist: Collective | None, stop_requested: bool) -> bool:
    """Whether any rank of the job was asked to stop (Ctrl-C, SIGTERM), agreed by every rank at the same
    step (collective on the control group; the trainer's thread): the data position then is one for all of
    them and no collective waits in vain. In one process: ``stop_requested``."""
    if dist is None:
        return stop_requested
    return any(dist.all_gather_object(stop_requested))


def services_of(ctx: Any) -> RunServices:
    """The run services of a stage context (empty ones when the pipeline was built without them)."""
    services = ctx.services
    return services if isinstance(services, RunServices) else RunServices()
