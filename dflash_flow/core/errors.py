"""Errors the runtime raises. User errors carry located problems; runtime errors name stage and replica."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Problem:
    """One located problem in a pipeline definition."""

    message: str
    file: str | None = None
    line: int | None = None
    stage: str | None = None
    field: str | None = None

    def format(self) -> str:
        where = []
        if self.file:
            where.append(f"{self.file}:{self.line}" if self.line else self.file)
        if self.stage:
            where.append(f"stage '{self.stage}'")
        if self.field:
            where.append(f"field '{self.field}'")
        prefix = ", ".join(where)
        return f"{prefix}: {self.message}" if prefix else self.message


class DflashFlowError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(DflashFlowError):
    """A pipeline definition is invalid. Holds every problem found, each located."""

    def __init__(self, problems: list[Problem] | Problem | str):
        if isinstance(problems, (str, Problem)):
            problems = [problems if isinstance(problems, Problem) else Problem(problems)]
        self.problems: list[Problem] = list(problems)
        super().__init__("\n".join(p.format() for p in self.problems))


class CheckpointError(DflashFlowError, ValueError):
    """A checkpoint (training or exported drafter) is missing, corrupted, or from another configuration."""


class StateVersionError(DflashFlowError, ValueError):
    """A saved stage state that this stage cannot load: another ``state_version``, or not a state at all."""


class SavedStateError(CheckpointError):
    """A resumed stage state without the shape the stage writes, or that cannot continue this run's data."""


class StageError(DflashFlowError):
    """A stage replica raised. The original exception is chained as ``__cause__``."""

    def __init__(self, stage: str, replica: int, phase: str, original: BaseException):
        self.stage = stage
        self.replica = replica
        self.phase = phase
        self.original = original
        super().__init__(f"stage '{stage}' replica {replica} failed in {phase}: {type(original).__name__}: {original}")


class PipelineStalled(DflashFlowError):
    """The no-progress watchdog fired."""

    def __init__(self, message: str, stalled: list[str], depths: dict[str, Any]):
        self.stalled = stalled
        self.depths = depths
        super().__init__(message)


class StopRequested(DflashFlowError):
    """Raised inside a stage (``StageContext.check_stop``) to abandon the item in hand: no output, not a failure."""


class PipelineInterrupted(DflashFlowError):
    """The run was stopped by SIGINT/SIGTERM (or ``Pipeline.stop``)."""

    def __init__(self, reason: str):
        self.reason = reason
        super().__init__(f"pipeline interrupted ({reason})")


class ShutdownTimeout(DflashFlowError):
    """Some stage threads did not exit within the shutdown grace period."""
