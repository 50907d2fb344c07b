"""Running a validated pipeline as an application: the run services, resume, the MLflow run, the end
of run (report files, artifact uploads, the printed summary), run statuses and exit codes.

The core runtime stays generic; this layer builds the ``RunServices`` the DFlash stages use and owns
everything that happens before the first stage thread starts and after the last one ends.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, is_user_input_error
from dflash_flow.core.validate import Validated

log = logging.getLogger("dflash_flow")


#: MLflow tags of a run resumed from another run directory's checkpoint (a fork): the run it continues
#: from and that checkpoint. Only a resume in place continues the checkpoint's own MLflow run.
PARENT_RUN_TAG = "dflash_flow.parent_run_id"
PARENT_CHECKPOINT_TAG = "dflash_flow.parent_checkpoint"


#: What ``--extend`` does (the CLI's help and the docs say the same).
EXTEND_RULE = (
    "Extend a finished or stopped run: with --resume, accept a longer (or shorter) run length than the "
    "checkpoint's (stages.bucketer.epochs, stages.interleaver.max_batches) and train on to it. The "
    "learning-rate schedule is re-planned over the new total: from the resumed step on, the learning rate "
    "is the one a run planned with the new total from the start has at that step (same warmup steps, the "
    "cosine reaching its floor at the new last step), so a finished run's rises from its floor."
)


def resume_config_hash(graph) -> str:
    """The hash of what must match to resume: the settings that can change the trained weights or the data
    order (``core.identity.result_settings``: declared at each field and stage, defaults filled in; a value
    declared once in a section, e.g. ``model.target``, counts as the stage's)."""
    from dflash_flow.core.identity import result_settings
    from dflash_flow.util import config_hash

    return config_hash(result_settings(graph))


def legacy_config_hash(graph) -> str:
    """The hash checkpoints written before they recorded their settings carry (the seed and every stage's
    spec as written, placement and capacity included): such a checkpoint resumes when it matches."""
    from dflash_flow.core.fill import legacy_stage_configs
    from dflash_flow.util import config_hash

    d = graph.to_dict()
    configs = legacy_stage_configs(graph)
    stages = [{**s, "config": configs[s["name"]]} if configs.get(s["name"]) else s for s in d.get("stages", [])]
    return config_hash({"seed": d.get("seed"), "stages": stages})


def build_resume_state(v: Validated, ckpt) -> dict[str, list[dict[str, Any]]]:
    """Per-stage resume states. Stages that plan data ahead of the trainer resume from the trainer's
    position (``resume_state_for``), not from how far they had run ahead when the checkpoint was taken."""
    from dflash_flow.app.checkpoint_format import InvalidCheckpoint
    from dflash_flow.core import Stage

    if ckpt is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in v.graph.stages:
        cls = v.classes[spec.name]
        try:
            state = cls.resume_state_for(ckpt.data_position) if ckpt.data_position else None
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
            raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json: 'data_position' does not give "
                                    f"stage '{spec.name}' a state ({type(exc).__name__}: {exc})") from None
        if state is not None:
            out[spec.name] = [state] * spec.replicas
        elif spec.name in ckpt.stage_states:
            out[spec.name] = ckpt.stage_states[spec.name]
        elif ckpt.stage_states and cls.affects_result and cls.get_state is not Stage.get_state:
            # The checkpoint has the other stages' states but not this one's, which keeps a state (the
            # trainer's step and weights): it would start over while the data continues from the checkpoint.
            raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json has no state for stage "
                                    f"'{spec.name}' ({spec.type})")
    return out


def quiet_libraries() -> None:
    """Per-call progress bars and info logs of libraries would drown the run's own progress line."""
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked workers + tokenizers threads deadlock
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_warning()
    except ImportError:  # pragma: no cover
        pass
    # mlflow sets its loggers' level from MLFLOW_LOGGING_LEVEL when it is imported (later than this, for
    # the store's "Creating initial MLflow database tables..." lines): both, so neither order prints them.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)


def _device_summary(pipeline) -> str:
    devs: dict[str, int] = {}
    for reps in pipeline.replicas.values():
        for r in reps:
            devs[r.ctx.device] = devs.get(r.ctx.device, 0) + 1
    return ", ".join(f"{d} x{n}" for d, n in sorted(devs.items()))


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


def _outcome(exc: BaseException | None) -> Outcome:
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
        # Ctrl-C / SIGTERM before the pipeline's own handling started (stage imports in preload).
        return Outcome("KILLED", EXIT_INTERRUPTED, "pipeline interrupted (before it started)")
    full = "".join(traceback.format_exception(exc))
    if is_user_input_error(exc):  # e.g. the disk filled up while the run's own files were written
        return Outcome("FAILED", EXIT_USER_ERROR, full, str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return Outcome("FAILED", EXIT_FAILED, full)


def _blame_checkpoint(outcome: Outcome, exc: BaseException, path: Path) -> Outcome:
    """A stage that could not continue from the resumed checkpoint's state (a ``SavedStateError`` raised
    while restoring it: a crafted or damaged ``state.json``) says so as the loader does, naming the file."""
    from dflash_flow.core import StageError
    from dflash_flow.core.errors import SavedStateError

    if not (isinstance(exc, StageError) and isinstance(exc.original, SavedStateError)):
        return outcome
    line = f"not a valid checkpoint: {path}: stage '{exc.stage}' replica {exc.replica}: {exc.original}"
    return attrs.evolve(outcome, shown=line)


class DeferredSignals:
    """SIGINT and SIGTERM recorded instead of raised, while a stretch of code must not be cut in half: the
    creation of the MLflow run (a run created but never ended would stay RUNNING forever) and the end of
    run. ``release()`` puts the previous handlers back and raises KeyboardInterrupt if a signal came.
    Outside the main thread (tests driving ``run_validated``) it does nothing."""

    def __init__(self) -> None:
        import threading

        self.received: list[int] = []
        self._previous: dict[int, Any] = {}
        self._active = threading.current_thread() is threading.main_thread()

    def install(self) -> DeferredSignals:
        import signal

        if self._active:
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def __enter__(self) -> DeferredSignals:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.restore()

    def _record(self, signum, frame) -> None:  # noqa: ARG002
        self.received.append(signum)

    def restore(self) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous = {}

    def release(self) -> None:
        self.restore()
        if self.received:
            raise KeyboardInterrupt()


def flush_tracking(record, tracker, step: int, timeout_s: float = 5.0) -> None:
    """Before a checkpoint of ``step`` commits: the Monitor has handed the tracker the metrics of every
    step up to it, and they are written to the store (or its spool). A run killed after the checkpoint
    then has them, and its resume logs only the steps after it."""
    if not record.wait_logged(step, timeout_s):
        log.warning("the Monitor had not logged step %d after %.0fs; checkpointing without waiting for it", step, timeout_s)
    tracker.flush()


def _uses_cuda(v: Validated) -> bool:
    return any("cuda" in str(spec.devices) or spec.devices == "auto" for spec in v.graph.stages)


def _write_rank_outcome(output_dir: Path, dist_ctx, outcome: Outcome | None, run_id: str | None = None) -> None:
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
                  "stage": outcome.stage, "time": outcome.at, "lost_peer": outcome.lost_peer}
    if run_id:
        record["mlflow_run_id"] = run_id
    import os

    from dflash_flow.app.launch import OUTCOME_DIR_ENV

    # `dflash-flow run --nproc` gives its job a folder of its own (an earlier or concurrent job's records,
    # or an output directory that cannot be made, never mix in); plain torchrun: OUTPUT/ranks.
    own = os.environ.get(OUTCOME_DIR_ENV)
    folder = Path(own) if own else output_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"rank{dist_ctx.rank}.json", json.dumps(record) + "\n")


def _resolve_checkpoint_dir(ck, output_dir: Path) -> tuple[Path, Path]:
    """(checkpoint directory, the root its writes must stay in): OUTPUT/checkpoints inside the output
    directory by default; a directory the user chose explicitly is its own root."""
    if ck.dir:
        d = Path(ck.dir).expanduser()
        return d, d
    return output_dir / "checkpoints", output_dir


def _prepare(v: Validated, dist_ctx, output_dir: Path, resume: str | None, extend: bool = False):
    """Everything before the MLflow run that can fail on the user's input or machine; raises UserError.
    Returns (lock, checkpointer, checkpoint or None)."""
    from dflash_flow.app.checkpointer import Checkpointer
    from dflash_flow.app.exits import UserError
    from dflash_flow.app.preflight import (
        OutputLock,
        check_free_space,
        check_stage_outputs,
        check_writable_dir,
        checkpoint_bytes,
        data_fingerprint,
        escaping_links,
        prepare_output_dir,
    )
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.observe.store import check_tracking_uri

    graph = v.graph
    main = dist_ctx is None or dist_ctx.is_main
    if dist_ctx is not None:  # every rank, before anything is written: one job, one config, one data set
        from importlib.metadata import version

        from dflash_flow.app.distributed import disagreement
        from dflash_flow.core.identity import result_settings

        # The settings field by field (not their hash), so that a disagreement names the field: "seed".
        facts = {"config": result_settings(graph), "data_files": data_fingerprint(v),
                 "version": version("dflash-flow")}
        problem = disagreement(dist_ctx.all_gather_object(facts))
        if problem:
            raise UserError(f"rank {dist_ctx.rank}: {problem}")
    lock = None
    if main:
        prepare_output_dir(output_dir)
        # Under torchrun the ranks of one job share the output directory: rank 0 holds the lock for them.
        lock = OutputLock.acquire(output_dir)
    else:
        try:
            output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"cannot create output_dir {output_dir}: {exc.strerror or exc}") from None
    try:
        tracking = graph.sections["tracking"]
        if main and tracking.enabled:
            problem = check_tracking_uri(tracking.tracking_uri)
            if problem:
                raise UserError(f"tracking: {problem}")
        ck = graph.sections["checkpoint"]
        ck_dir, ck_root = _resolve_checkpoint_dir(ck, output_dir)
        if main:
            check_stage_outputs(v, output_dir)
            check_writable_dir(ck_dir, "checkpoint.dir" if ck.dir else "the checkpoint directory")
            if ck.dir and ck_dir.is_dir() and escaping_links(ck_dir):
                link, target = escaping_links(ck_dir)[0]
                raise UserError(f"checkpoint.dir {ck_dir}: {link.relative_to(ck_dir)} is a symbolic link to {target}, "
                                "outside it; checkpoints are written and pruned only inside their directory")
        from dflash_flow.core.identity import moved_setting_keys, result_settings, run_length_keys

        checkpointer = Checkpointer(ck_dir, keep_last=ck.keep_last, config_hash=resume_config_hash(graph),
                                    settings=result_settings(graph), legacy_hash=legacy_config_hash(graph),
                                    length_keys=run_length_keys(graph), extend=extend, moved=moved_setting_keys(graph),
                                    data_files=data_fingerprint(v) if main else {}, root=ck_root)
        ckpt = None
        if resume == "auto":  # torchrun --max-restarts: the first attempt starts fresh, a restart continues
            resume = "latest" if checkpointer.list() else None
        if extend and not resume:
            raise UserError("--extend lengthens a resumed run: pass it with --resume latest (or a checkpoint path)")
        if not resume and main:
            earlier = checkpointer.candidates()
            if earlier:  # a fresh run would mix its checkpoints with another run's
                raise UserError(
                    f"{ck_dir} holds the checkpoints of an earlier run (newest: {earlier[0].name}); pass --resume latest "
                    "to continue it (with --extend to train it longer), or choose another output_dir "
                    "(--set output_dir=...)")
        if resume:
            try:
                ckpt = checkpointer.load(resume)
            except CheckpointError as exc:
                raise UserError(str(exc)) from None
            change = ckpt.data_change(checkpointer.data_files)
            if change:
                raise UserError(change)
            try:
                build_resume_state(v, ckpt)  # every stage's state can be derived from it (built again later)
            except CheckpointError as exc:
                raise UserError(str(exc)) from None
            ckpt.extend = extend
            if ckpt.run_uid:
                checkpointer.run_uid = ckpt.run_uid  # the resumed run prunes the checkpoints of its lineage
        if main:
            need_ckpt, need_export = checkpoint_bytes(v)
            if need_ckpt:
                check_free_space(ck_dir, need_ckpt + (need_export if ck_root == output_dir else 0),
                                 "one checkpoint and the export")
                if ck_root != output_dir:
                    check_free_space(output_dir, need_export, "the exported drafter")
        return lock, checkpointer, ckpt
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def run_validated(v: Validated, *, config_path: Path | None = None, resume: str | None = None,
                  overrides: list[str] | None = None, extend: bool = False) -> RunReport:
    """Run ``v`` with tracking and checkpoints (one rank of a torchrun job, or the whole job). Returns a
    :class:`RunReport` (its ``exit_code`` is the process's). Under torchrun rank 0 owns the MLflow run, the console and the end of run;
    the other ranks print nothing but errors.

    Order: the output directory is made, checked and locked, the checkpoint and the data verified and the
    free space measured; then the services and the pipeline are built; the MLflow run is created last,
    with signals deferred, and every path after that ends it.

    ``extend`` (with ``resume``): :data:`EXTEND_RULE`."""
    from dflash_flow.app.checkpoint import CheckpointService
    from dflash_flow.app.distributed import init_distributed, shutdown_distributed
    from dflash_flow.app.endrun import ContainedUploads, end_of_run, write_pictures
    from dflash_flow.app.exits import EXIT_USER_ERROR, UserError, report_user_error
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.core.fill import complete_stage_configs
    from dflash_flow.core.runtime import Pipeline
    from dflash_flow.model.export import DrafterExporter
    from dflash_flow.observe.runinfo import redact_uri, run_params, run_tags
    from dflash_flow.observe.schema import HEADLINE_METRICS
    from dflash_flow.observe.tracking import Tracker, TrackingError
    from dflash_flow.services import RunServices

    graph = v.graph
    dist_ctx = init_distributed(graph.sections["distributed"], use_cuda=_uses_cuda(v))
    main = dist_ctx is None or dist_ctx.is_main
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    output_dir = graph.run_dir
    tracking = graph.sections["tracking"]
    ck = graph.sections["checkpoint"]
    lock = None
    try:
        try:
            lock, checkpointer, ckpt = _prepare(v, dist_ctx, output_dir, resume, extend)
            fork = ckpt is not None and not checkpointer.holds(ckpt)
            if ckpt is not None and main:
                print(f"resuming from {ckpt.path} (step {ckpt.step}, epoch {ckpt.epoch})"
                      + (" as a new run: the checkpoint is another run directory's, whose MLflow run stays as it is"
                         if fork else ""), file=sys.stderr)
            # Under torchrun the ranks agree on the step they stop after (the Distributed is the consensus);
            # the export is written inside the output directory only.
            services = RunServices(model=build_model_spec(graph), resume=ckpt, dist=dist_ctx, stop_consensus=dist_ctx,
                                   exporter=DrafterExporter(output_dir))
            pipeline = Pipeline(v, services=services, resume_state=build_resume_state(v, ckpt), output_dir=output_dir)
            services.checkpoints = CheckpointService(checkpointer, ck, stage_states=pipeline.state_dict, dist=dist_ctx)
            pictures = write_pictures(graph, output_dir) if main else []
            resolved = graph.to_dict(complete_stage_configs(graph))  # every default written out
            if resolved.get("tracking", {}).get("tracking_uri"):
                resolved["tracking"]["tracking_uri"] = redact_uri(resolved["tracking"]["tracking_uri"])
            tags = {
                **run_tags(resolved, world_size=pipeline.world_size, device_summary=_device_summary(pipeline)),
                "config_hash": checkpointer.config_hash,
                "config_file": str(config_path) if config_path else "",
                "headline_metrics": ", ".join(HEADLINE_METRICS),  # docs/metrics.md: "Chart these first"
            }
            if fork:  # a resume into another directory: a run of its own, tagged with where it came from
                tags[PARENT_CHECKPOINT_TAG] = str(ckpt.path.resolve())
                if ckpt.mlflow_run_id:
                    tags[PARENT_RUN_TAG] = ckpt.mlflow_run_id
        except UserError as exc:
            if dist_ctx is not None:  # the launcher names this rank and its reason, not a rank that "died"
                try:
                    _write_rank_outcome(output_dir, dist_ctx, Outcome("FAILED", EXIT_USER_ERROR, str(exc),
                                                                      at=time.time()))
                except OSError:
                    pass
            shutdown_distributed(dist_ctx, failed=True)
            return RunReport("FAILED", report_user_error(exc), str(exc), output_dir=output_dir)
        # The MLflow run is created last, right before the pipeline starts, with Ctrl-C and SIGTERM held
        # back (recorded, not raised) until the pipeline runs: every path after this line ends the run, and no
        # signal lands in the middle of a store write (a connection or a lock left taken would hang the end).
        startup = DeferredSignals().install()
        try:
            tracker = Tracker.start(
                enabled=tracking.enabled and main,
                tracking_uri=tracking.tracking_uri,
                experiment=tracking.experiment,
                run_name=tracking.run_name or graph.name,
                params=run_params(resolved),
                tags=tags,
                resume_run_id=ckpt.mlflow_run_id if ckpt is not None and not fork else None,
                system_metrics=tracking.system_metrics,
                spool_dir=output_dir / "mlflow-spool",
            )
        except TrackingError as exc:
            startup.restore()
            shutdown_distributed(dist_ctx, failed=True)
            return RunReport("FAILED", report_user_error(f"tracking: {exc}"), f"tracking: {exc}", output_dir=output_dir)
        except BaseException:
            startup.restore()
            raise
        uploads = ContainedUploads(tracker, output_dir)
        checkpointer.tracker = tracker
        services.tracker = uploads
        if tracker.enabled:
            services.checkpoints.before_commit = lambda step: flush_tracking(services.record, tracker, step)
        outcome = Outcome()
        try:
            _write_rank_outcome(output_dir, dist_ctx, None, tracker.run_id)
            for path, folder in pictures:
                uploads.log_artifact(path, folder)
            startup.release()  # a signal that came while the run was being created is raised here
            pipeline.run()
        except BaseException as exc:
            outcome = _outcome(exc)
            if ckpt is not None:
                outcome = _blame_checkpoint(outcome, exc, ckpt.path)
            if not isinstance(exc, Exception) and not isinstance(exc, KeyboardInterrupt):
                raise
        finally:
            startup.restore()  # (already done when the pipeline ran; not when an upload before it failed)
            # The outcome is decided: the pipeline's. From here on a signal does not interrupt in the middle of
            # a write or an upload: it is recorded and cuts the end of run short (the uploads left are
            # skipped), but the status stays the one summary.json, MLflow and the exit code all carry.
            with DeferredSignals() as late:
                try:
                    try:
                        _write_rank_outcome(output_dir, dist_ctx, outcome, tracker.run_id)  # first: the end may be cut short
                    except OSError as exc:
                        log.warning("could not write this rank's outcome: %s", exc)
                    if main:
                        end_of_run(pipeline, services, outcome, output_dir, late)
                finally:
                    tracker.end(outcome.status)
                    shutdown_distributed(dist_ctx, failed=outcome.code != EXIT_OK)
                    if late.received and main:
                        print(f"interrupted during the end of the run: the rest of the report and uploads were "
                              f"skipped; the run stays {outcome.status}", file=sys.stderr)
        if outcome.error:
            text = outcome.shown or outcome.error
            where = f"rank {dist_ctx.rank}: " if dist_ctx is not None else ""
            if outcome.code == EXIT_USER_ERROR:
                report_user_error(f"{where}{text}")
            else:
                print(f"error: {where}{text}" if outcome.code != EXIT_INTERRUPTED else f"stopped: {where}{text}", file=sys.stderr)
        last = services.checkpoints.last_path
        if main and outcome.status == "KILLED" and last is not None:
            print(f"checkpoint saved to {last}; resume with --resume latest", file=sys.stderr)
        if tracker.run_id:
            print(f"mlflow run: {tracker.run_id} ({tracker.display_uri})", file=sys.stderr)
        return RunReport(outcome.status, outcome.code, outcome.shown or outcome.error, output_dir=output_dir,
                         mlflow_run_id=tracker.run_id, checkpoint=last, record=services.record)
    finally:
        if lock is not None:
            lock.release()
