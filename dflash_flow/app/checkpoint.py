"""The run's checkpoints: CheckpointService, over checkpointer (writing, pruning) and checkpoint_format.

Layout of one checkpoint directory ``step-00000123/``:
  model.safetensors   trainable weights (safetensors: loading never runs code)
  optimizer.pt        optimizer + scheduler state (loaded with ``torch.load(weights_only=True)``)
  state.json          step, epoch, data position, every stage's state_dict, MLflow run id, the settings
                      that can change the result (``core.identity.result_settings``) and their hash,
                      the run's lineage id, the directory it was written into (a copy elsewhere is a
                      fork: ``Checkpointer.holds``) and the sha256 of every data file
  MANIFEST.json       sha256 of every file above; written last
A checkpoint is first written to a hidden temporary directory and renamed into place, so a crash
mid-write (or a full disk) leaves either the previous checkpoints or a complete new one, never a
half-written one.

Pruning removes only checkpoints of this run's lineage (``run_uid`` in state.json: a fresh run draws a
new one, a resumed run keeps its checkpoint's), so a checkpoint directory shared with anything else never
loses what it did not write. Loading checks everything it reads (the manifest, every checksum, the shape of
state.json) and names the checkpoint and the reason: ``not a valid checkpoint: PATH: why``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_flow.core.errors import CheckpointError

from .checkpoint_format import (
    LATEST,
    Checkpoint,
    InvalidCheckpoint,
    checkpoint_size_estimate,
    load_checkpoint,
)
from .checkpointer import Checkpointer, new_run_uid

# The checkpoint names keep this module as their documented home; each is defined in the module named above.
__all__ = [
    "LATEST",
    "Checkpoint",
    "CheckpointError",
    "CheckpointService",
    "Checkpointer",
    "InvalidCheckpoint",
    "checkpoint_size_estimate",
    "load_checkpoint",
    "new_run_uid",
]


class CheckpointService:
    """The run's checkpoint policy (``checkpoint:`` section) in front of a :class:`Checkpointer`.

    A trainer stage reports each optimizer step (``after_step``) and hands over a
    ``services.CheckpointPayload`` when a checkpoint is due; the service adds every other stage's state
    (``stage_states``, the pipeline's) and writes it. ``last_path`` is what the application reports.
    """

    def __init__(self, checkpointer: Checkpointer, policy: Any, *, stage_states: Any = None, dist: Any = None,
                 tracker: Any = None, before_commit: Any = None, elapsed_s: Any = None) -> None:
        self.checkpointer = checkpointer
        self.policy = policy
        self.on_signal = bool(policy.on_signal)
        # () -> {stage: [state per replica]}: the running pipeline's, asked at each save (the service is built
        # before the pipeline, which gets its services complete).
        self.stage_states = stage_states
        self.dist = dist  # app.distributed.Distributed under torchrun: rank 0 writes, every rank waits
        # The run's tracker: its run id is asked at each save (it creates its run late when the store was
        # unreachable at the start).
        self.tracker = tracker
        # (step) -> None, called by the writing rank before a checkpoint of ``step`` is written: the
        # application puts the metrics of every step up to it into MLflow first (session.flush_tracking),
        # so that a run killed after the checkpoint has, after its resume, each step's metrics exactly once.
        self.before_commit = before_commit
        # () -> seconds the run has run, the runs it resumes included: state.json's ``extra.elapsed_s``,
        # where a resumed run's clock goes on from.
        self.elapsed_s = elapsed_s
        self.last_path: Path | None = None

    def due(self, step: int, epoch_end: bool) -> bool:
        every = self.policy.every_steps
        return bool(every and step % every == 0) or (epoch_end and self.policy.at_epoch_end)

    def after_step(self, source: Any, *, step: int, epoch_end: bool) -> Path | None:
        return self.save(source, epoch_end=epoch_end) if self.due(step, epoch_end) else None

    def at_stop(self, source: Any, *, trained: bool) -> Path | None:
        """The stop checkpoint (``on_signal``), when the trainer trained since its last one; under torchrun
        every rank writes it regardless (the save is collective: no rank may skip it)."""
        if self.on_signal and (trained or self.dist is not None):
            return self.save(source)
        return None

    def save(self, source: Any, *, epoch_end: bool = False) -> Path | None:
        """Write a checkpoint. Under torchrun every rank calls this at the same step (it is collective):
        the ranks' data positions are gathered, rank 0 writes once, and nobody goes on before it is done."""
        payload = source.checkpoint_payload(epoch_end)
        extra = dict(payload.extra)
        if self.elapsed_s is not None:
            extra["elapsed_s"] = round(float(self.elapsed_s()), 3)
        if self.dist is not None:
            positions = self.dist.all_gather_object(payload.data_position)
            extra.update(world_size=self.dist.world_size, data_positions=positions)
            if self.dist.rank != 0:
                self.dist.barrier()
                self.last_path = self.checkpointer.dir / f"step-{payload.step:08d}"
                return self.last_path
        states = self.stage_states() if self.stage_states is not None else {}
        states[payload.stage] = [payload.stage_state]
        try:
            if self.before_commit is not None:
                self.before_commit(payload.step)
            self.last_path = self.checkpointer.save(
                step=payload.step,
                epoch=payload.epoch,
                model_state=payload.model_state,
                optimizer_state=payload.optimizer_state,
                data_position=payload.data_position,
                stage_states=states,
                extra=extra,
                files=payload.files,
                mlflow_run_id=self.tracker.run_id if self.tracker is not None else None,
            )
        finally:
            if self.dist is not None:
                self.dist.barrier()
        return self.last_path
