"""Run services: what the application hands the DFlash stages besides their config, one typed object per run
(``StageContext[RunServices].services``; opaque to the core); a run's missing ones are None."""

from __future__ import annotations

import abc
from pathlib import Path
from typing import Any, Protocol

import attrs

from dflash_flow.core.stage import StageContext
from dflash_flow.model.spec import ModelSpec
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
    """A stage that hands the checkpoint service its payload (DrafterStep)."""

    @abc.abstractmethod
    def checkpoint_payload(self, epoch_end: bool = False) -> CheckpointPayload: ...


class Checkpoints(Protocol):
    """Checkpoint policy and writer (``dflash_flow.app.checkpoint.CheckpointService``)."""

    on_signal: bool

    def after_step(self, source: CheckpointSource, *, step: int, epoch_end: bool) -> Path | None: ...

    def save(self, source: CheckpointSource, *, epoch_end: bool = False) -> Path | None: ...

    def at_stop(self, source: CheckpointSource, *, trained: bool) -> Path | None: ...


class Resume(Protocol):
    """The checkpoint a run continues from (``dflash_flow.app.checkpoint_format.Checkpoint``)."""

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

    def agree_to_stop(self, stop_requested: bool) -> bool: ...


class BatchLog(Protocol):
    """The trained-batch log (``dflash_flow.observe.record.BatchLog``)."""

    def write(self, meta: Any) -> None: ...

    def close(self) -> None: ...


class Exported(Protocol):
    path: Path
    serve_commands: dict[str, str]  # engine -> the command that serves the export


class Exporter(Protocol):
    """Writes the final inference checkpoint in the run's output directory (``model.export.DrafterExporter``)."""

    def export(self, drafter: Any, state: dict[str, Any], out: str, *, target: str | None,
               check_stop: Any = None) -> Exported: ...


@attrs.define(eq=False, kw_only=True)
class RunServices:
    model: ModelSpec = attrs.field(factory=ModelSpec)  # the model facts, resolved once (app.model_spec)
    tracker: MetricSink | None = None
    checkpoints: Checkpoints | None = None
    resume: Resume | None = None
    record: RunRecord = attrs.field(factory=RunRecord)
    tokenizer: Any = None  # a tokenizer object for ChatSource stages given no tokenizer path
    dist: Collective | None = None  # set when the pipeline runs as one rank of a torchrun job
    stop_consensus: Collective | None = None  # under torchrun: the ranks agree on the step they stop after
    exporter: Exporter | None = None  # None: the trainer stage exports into its context's output_dir

    def open_batch_log(self, ctx: StageContext[RunServices]) -> BatchLog:
        """The trained-batch log of a trainer stage: ``OUTPUT/batches.jsonl`` (one per rank), continued on resume."""
        from dflash_flow.observe.record import BatchLog as FileBatchLog

        return FileBatchLog(Path(ctx.output_dir), rank=ctx.rank, world_size=ctx.world_size,
                            append=self.resume is not None)


def services_of(ctx: StageContext[Any]) -> RunServices:
    """The run services of a stage context (empty ones when the pipeline was built without them)."""
    return ctx.services if isinstance(ctx.services, RunServices) else RunServices()
