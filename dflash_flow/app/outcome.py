"""How a run ended: its ``Outcome`` (MLflow status, exit code, error) decided from what the pipeline raised,
the ``RunReport`` the application returns, and under torchrun each rank's outcome record (the launcher
names the failing rank from these, and stops the ranks it finds RUNNING on a second signal)."""

from __future__ import annotations

import json
import os
import time
import traceback
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, is_user_input_error


@attrs.define
class RunReport:
    """What a run did: how it ended (MLflow status, the exit code ``dflash-flow run`` ends with, the error
    shown), where it wrote, its MLflow run, the last checkpoint, and the structured record the Monitor kept
    (``record.evals``: the evaluation results; ``record.train``: the last training metrics)."""

    status: str
    exit_code: int
    error: str | None = None
    output_dir: Path | None = None
    mlflow_run_id: str | None = None
    checkpoint: Path | None = None
    record: Any = None  # observe.record.RunRecord

    @property
    def ok(self) -> bool:
        return self.exit_code == EXIT_OK


@attrs.define
class Outcome:
    """How a run ended: MLflow status, exit code, the full error text (summary.json) and what the console
    shows when that differs (a user error's one line instead of its traceback)."""

    status: str = "FINISHED"
    code: int = EXIT_OK
    error: str | None = None
    shown: str | None = None
    # Where and when it failed (the launcher blames the rank whose fault came first, not the ranks that
    # only lost their connection to it): the stage, the wall-clock time, whether it was a lost peer.
    stage: str | None = None
    at: float | None = None
    lost_peer: bool = False
    # The rank that held the job up (its progress stopped while this rank waited for it in a collective) and
    # for how long, as this rank saw it (app.distributed.PeerProgress); the launcher names that rank.
    held_up_by: int | None = None
    held_up_s: float | None = None


def outcome_of(exc: BaseException | None) -> Outcome:
    from dflash_flow.app.distributed import lost_peer
    from dflash_flow.core import StageError

    out = _classify(exc)
    if exc is not None:
        out.stage = exc.stage if isinstance(exc, StageError) else None
        out.at = time.time()
        out.lost_peer = lost_peer(exc)
    return out


def _classify(exc: BaseException | None) -> Outcome:
    from dflash_flow.core import PipelineInterrupted, PipelineStalled, StageError
    from dflash_flow.core.stopping import StopSignal

    if exc is None:
        return Outcome()
    if isinstance(exc, StageError):
        original = "".join(traceback.format_exception(exc.original))
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", []))
        error = f"{exc}\n\nOriginal traceback ({exc.stage}[{exc.replica}], {exc.phase}):\n{original}{notes}"
        if is_user_input_error(exc.original):
            # Bad input data (a file that is missing, empty, truncated, not JSON...): the message names the
            # file and line; a traceback would only bury it. summary.json keeps the traceback.
            return Outcome("FAILED", EXIT_USER_ERROR, error, f"{exc}{notes}")
        return Outcome("FAILED", EXIT_FAILED, error)
    if isinstance(exc, PipelineStalled):
        return Outcome("FAILED", EXIT_FAILED, str(exc))
    if isinstance(exc, PipelineInterrupted):
        return Outcome("KILLED", EXIT_INTERRUPTED, str(exc))
    if isinstance(exc, KeyboardInterrupt):
        # A stop signal before the pipeline's own handling started (the MLflow run's creation, stage imports).
        name = f"{exc.name}, " if isinstance(exc, StopSignal) else ""
        return Outcome("KILLED", EXIT_INTERRUPTED, f"pipeline interrupted ({name}before it started)")
    full = "".join(traceback.format_exception(exc))
    if is_user_input_error(exc):  # e.g. the disk filled up while the run's own files were written
        return Outcome("FAILED", EXIT_USER_ERROR, full, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return Outcome("FAILED", EXIT_FAILED, full)


def blame_checkpoint(outcome: Outcome, exc: BaseException, path: Path) -> Outcome:
    """A stage that could not continue from the resumed checkpoint's state (a ``SavedStateError`` raised
    while restoring it: a crafted or damaged ``state.json``) says so as the loader does, naming the file."""
    from dflash_flow.core import StageError
    from dflash_flow.core.errors import SavedStateError

    if not (isinstance(exc, StageError) and isinstance(exc.original, SavedStateError)):
        return outcome
    line = f"not a valid checkpoint: {path}: stage '{exc.stage}' replica {exc.replica}: {exc.original}"
    return attrs.evolve(outcome, shown=line)


def write_rank_outcome(output_dir: Path, dist_ctx, outcome: Outcome | None, run_id: str | None = None) -> None:
    """Under torchrun every rank keeps one record of its state: RUNNING from the start (a rank killed
    outright leaves it so), then how it ended; the launcher names the failing rank from these."""
    if dist_ctx is None:
        return
    from dflash_flow.util import atomic_write_text

    if outcome is None:
        record = {"rank": dist_ctx.rank, "status": "RUNNING", "code": None, "error": None}
    else:
        first = (outcome.shown or outcome.error or "").strip().splitlines()
        record = {"rank": dist_ctx.rank, "status": outcome.status, "code": outcome.code, "error": first[0] if first else None,
                  "stage": outcome.stage, "time": outcome.at, "lost_peer": outcome.lost_peer,
                  "held_up_by": outcome.held_up_by, "held_up_s": outcome.held_up_s}
    record["pid"] = os.getpid()  # a second stop signal reaches the ranks through it (app.launch)
    if run_id:
        record["mlflow_run_id"] = run_id
    from dflash_flow.app.launch import OUTCOME_DIR_ENV

    # `dflash-flow run --nproc` gives its job a folder of its own (an earlier or concurrent job's records,
    # or an output directory that cannot be made, never mix in); plain torchrun: OUTPUT/ranks.
    own = os.environ.get(OUTCOME_DIR_ENV)
    folder = Path(own) if own else output_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"rank{dist_ctx.rank}.json", json.dumps(record) + "\n")
