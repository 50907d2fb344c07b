"""The end of a run: its ``Outcome`` decided from what the pipeline raised, the ``RunReport``, each rank's outcome
record under torchrun; and what it uploads (never from outside the output directory) and prints."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, is_user_input_error

log = logging.getLogger("dflash_flow")


@attrs.define
class RunReport:
    """What a run did: how it ended (MLflow status, exit code, the error shown), where it wrote, its MLflow run,
    the last checkpoint, and the Monitor's record (``record.evals``, ``record.train``: the last metrics)."""

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
    # Where and when it failed (the launcher blames the first fault, not the ranks that lost their peer).
    stage: str | None = None
    at: float | None = None
    lost_peer: bool = False
    # The rank that held this one up in a collective, and for how long (app.distributed.PeerProgress).
    held_up_by: int | None = None
    held_up_s: float | None = None


def outcome_of(exc: BaseException) -> Outcome:
    from dflash_flow.app.distributed import lost_peer
    from dflash_flow.core import PipelineInterrupted, PipelineStalled, StageError
    from dflash_flow.core.stopping import StopSignal

    if isinstance(exc, StageError):
        original = "".join(traceback.format_exception(exc.original))
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", []))
        error = f"{exc}\n\nOriginal traceback ({exc.stage}[{exc.replica}], {exc.phase}):\n{original}{notes}"
        # Bad input: the message names the file and line (summary.json keeps the traceback).
        out = (Outcome("FAILED", EXIT_USER_ERROR, error, f"{exc}{notes}") if is_user_input_error(exc.original)
               else Outcome("FAILED", EXIT_FAILED, error))
    elif isinstance(exc, PipelineStalled):
        out = Outcome("FAILED", EXIT_FAILED, str(exc))
    elif isinstance(exc, PipelineInterrupted):
        out = Outcome("KILLED", EXIT_INTERRUPTED, str(exc))
    elif isinstance(exc, KeyboardInterrupt):
        # A stop signal before the pipeline's own handling started (the MLflow run's creation, stage imports).
        name = f"{exc.name}, " if isinstance(exc, StopSignal) else ""
        out = Outcome("KILLED", EXIT_INTERRUPTED, f"pipeline interrupted ({name}before it started)")
    else:
        full = "".join(traceback.format_exception(exc))
        out = Outcome("FAILED", EXIT_FAILED, full)
        if is_user_input_error(exc):  # e.g. the disk filled up while the run's own files were written
            out = Outcome("FAILED", EXIT_USER_ERROR, full, str(exc).strip().splitlines()[0] if str(exc).strip()
                          else type(exc).__name__)
    return attrs.evolve(out, stage=exc.stage if isinstance(exc, StageError) else None, at=time.time(),
                        lost_peer=lost_peer(exc))


def blame_checkpoint(outcome: Outcome, exc: BaseException, path: Path) -> Outcome:
    """A stage that cannot restore the resumed checkpoint's state (``SavedStateError``) says so as the loader does."""
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

    # `dflash-flow run --nproc` gives its job a folder of its own; plain torchrun: OUTPUT/ranks.
    own = os.environ.get(OUTCOME_DIR_ENV)
    folder = Path(own) if own else output_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"rank{dist_ctx.rank}.json", json.dumps(record) + "\n")


def write_pictures(graph, output_dir: Path) -> list[tuple[Path, str]]:
    """The resolved YAML and the DAG (Mermaid text, a PNG), as (file, artifact folder) pairs."""
    from dflash_flow.app.exits import UserError, describe_os_error
    from dflash_flow.core.graph import render_image, to_mermaid
    from dflash_flow.core.identity import complete_stage_configs
    from dflash_flow.core.redact import redact_text

    files = [(output_dir / "pipeline.resolved.yaml", "config"), (output_dir / "pipeline.mmd", "dag")]
    try:
        # every default written out; credentials redacted (the one redaction: core.redact)
        files[0][0].write_text(redact_text(graph.to_yaml(complete_stage_configs(graph))))
        files[1][0].write_text(to_mermaid(graph))
    except OSError as exc:
        raise UserError(f"cannot write into output_dir: {describe_os_error(exc)}") from None
    try:
        image = render_image(graph, output_dir / "pipeline.png")
        if image is None:  # no graphviz: draw it ourselves
            from dflash_flow.observe.plots import render_dag_png

            image = render_dag_png(graph, output_dir / "pipeline.png")
        files.append((image, "dag"))
    except Exception as exc:  # a picture must never stop a run; the Mermaid file is there
        log.warning("could not draw the DAG image: %s", exc)
    return files


class ContainedUploads:
    """The run's tracker for uploads: nothing whose real location is outside the output directory goes up."""

    def __init__(self, tracker: Any, root: Path) -> None:
        self._tracker = tracker
        self._root = root

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tracker, name)

    def escapes(self, path: Path) -> Path | None:
        """The first path (``path`` itself, or a link under it) that leads out of the root, if any."""
        from dflash_flow.util import is_within

        if not is_within(path, self._root):
            return path
        if path.is_dir():
            for dirpath, dirnames, filenames in os.walk(path, followlinks=False):
                for name in (*dirnames, *filenames):
                    p = Path(dirpath) / name
                    if p.is_symlink() and not is_within(p, self._root):
                        return p
        return None

    def log_artifact(self, path: Any, artifact_path: str | None = None) -> None:
        bad = self.escapes(Path(path))
        if bad is not None:
            log.warning("not uploading %s: it leads outside output_dir %s (to %s)", path, self._root, os.path.realpath(bad))
            return
        self._tracker.log_artifact(path, artifact_path)


def end_of_run(pipeline, services, outcome: Any, output_dir: Path, late: Any = None) -> None:
    """Summary, report files and plots, uploads, the printed table: never changing the outcome (a file that
    cannot be written is a warning; a signal, ``late``, cuts the rest short)."""
    from dflash_flow.app.exits import describe_os_error
    from dflash_flow.observe.report import summary_table, write_run_report
    from dflash_flow.util import atomic_write_text

    def interrupted() -> bool:
        return late is not None and bool(late.received)

    tracker = services.tracker
    snapshot = pipeline.snapshot()
    summary = {
        "status": outcome.status,
        # The run's clock: a resumed run goes on from its checkpoint's (``elapsed_resumed_s`` of it).
        "elapsed_s": services.record.elapsed_before_s + snapshot.elapsed_s,
        "elapsed_resumed_s": services.record.elapsed_before_s,
        "error": outcome.error,
        "stages": {
            name: {"replicas": len(st.replicas), **{k: round(v, 4) for k, v in st.fractions().items()},
                   "items_in": sum(r.items_in for r in st.replicas), "items_out": sum(r.items_out for r in st.replicas)}
            for name, st in snapshot.stages.items()
        },
        "mlflow_run_id": tracker.run_id,
    }
    try:
        atomic_write_text(output_dir / "summary.json", json.dumps(summary, indent=1, default=str))
        tracker.log_artifact(output_dir / "summary.json")
    except OSError as exc:
        log.warning("could not write the run summary: %s", describe_os_error(exc))
    record = services.record
    if interrupted():
        return
    try:
        write_run_report(record, output_dir=output_dir, tracker=tracker)
    except Exception as exc:  # the run's outcome stands; a report that cannot be drawn is a warning
        log.warning("could not write the run report: %s", exc)
    for name, path in record.artifacts.items():
        if interrupted():
            return
        if Path(path).exists():
            tracker.log_artifact(path, name)
    if record.history or record.evals or record.train:
        print(summary_table(record), file=sys.stderr)
    for label, r in record.evals.items():
        if r.lossless is not None:  # real greedy decoding; the walk and sampled runs are in the summary table
            print(f"speculative decoding ({label} drafter): acceptance length {r.metrics['tau']:.2f}, target "
                  f"forwards {r.metrics.get('speedup_forwards', float('nan')):.2f}x fewer, lossless={r.lossless}",
                  file=sys.stderr)
    trained = record.evals.get("trained")
    if trained is not None and "tau" in trained.metrics:  # a drafter that barely helps never ends without a word
        from dflash_flow.observe.engine_metrics import weak_drafter_note

        note = weak_drafter_note("trained", trained.metrics["tau"])
        if note:
            print(note, file=sys.stderr)
            tracker.set_tags({"verdict": note})
    if record.serve_commands:
        from dflash_flow.model.export_contract import format_serve_commands

        print(format_serve_commands(record.serve_commands), file=sys.stderr)


class RunExporter:
    """The run's export (``services.Exporter``), inside the output directory, recorded for the end of run."""

    def __init__(self, output_dir: Path, record: Any) -> None:
        from dflash_flow.model.export import DrafterExporter

        self._exporter = DrafterExporter(output_dir)
        self._record = record

    def export(self, drafter: Any, state: dict[str, Any], out: str, *, target: str | None,
               check_stop: Any = None) -> Any:
        done = self._exporter.export(drafter, state, out, target=target, check_stop=check_stop)
        self._record.artifacts["drafter"] = str(done.path)
        self._record.serve_commands = done.serve_commands
        return done
