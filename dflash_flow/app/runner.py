"""The Python runner: ``run(...)`` does what ``dflash-flow run`` does (README shows it), and a failed or
interrupted run is a report with its status and exit code, not an exception. ``run_validated`` runs
in phases: prepare (``app.prepare``), open (the MLflow run), build (the ``RunServices``, then the pipeline),
run, end (``app.endrun``)."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.endrun import Outcome, RunReport, blame_checkpoint, outcome_of, write_rank_outcome
from dflash_flow.app.exits import EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, UserError, report_user_error
from dflash_flow.core.graph import Graph
from dflash_flow.core.validate import Validated

log = logging.getLogger("dflash_flow")


def load(source: str | Path | Graph, *, overrides: list[str] | None = None, check_devices: bool = True,
         check_paths: bool | None = None, local_world_size: int | None = None, gpu_count: int | None = None) -> Validated:
    """A pipeline file or a Graph, with ``overrides`` (``key.path=value``) applied, validated like ``dflash-flow
    validate`` (ConfigError with every problem; ``check_paths``, default ``check_devices``: files exist)."""
    import dflash_flow.app  # noqa: F401 - registers the application sections
    from dflash_flow.app.model_spec import preflight_problems, preflight_warnings
    from dflash_flow.core.config import apply_overrides, graph_from_dict, load_graph
    from dflash_flow.core.errors import ConfigError
    from dflash_flow.core.validate import validated

    if isinstance(source, Graph):
        graph = source
        if overrides:
            graph = graph_from_dict(apply_overrides(source.to_dict(), overrides), source.locator)
            graph.instances = dict(source.instances)  # used only where the config still matches
    else:
        graph = load_graph(source, overrides or [])
    v = validated(graph, check_devices=check_devices, local_world_size=local_world_size, gpu_count=gpu_count)
    problems = preflight_problems(v, check_paths=check_devices if check_paths is None else check_paths,
                                  local_world_size=local_world_size, gpu_count=gpu_count)
    if problems:
        raise ConfigError(problems)
    for line in preflight_warnings(v):
        log.warning(line)
    return v


def model_services(source: Validated | Graph):
    """Run services holding only the model facts of ``source`` (its ``model:`` section resolved): what the
    DFlash stages need under a bare ``Pipeline(v, services=model_services(v))`` (no tracking, no checkpoints)."""
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.services import RunServices

    return RunServices(model=build_model_spec(source.graph if isinstance(source, Validated) else source))


def run(source: str | Path | Graph, *, overrides: list[str] | None = None, resume: str | None = None,
        extend: bool = False, check_devices: bool = True) -> Any:
    """Run a pipeline as ``dflash-flow run`` does (under torchrun, as this rank) and return its
    :class:`RunReport`. ``resume``: a checkpoint path, ``"latest"``, or ``"auto"`` (latest if there is one);
    ``extend``: :data:`EXTEND_RULE`. Raises ConfigError before anything runs when the pipeline is invalid."""
    v = load(source, overrides=overrides, check_devices=check_devices)
    config_path = None if isinstance(source, Graph) else Path(source)
    return run_validated(v, config_path=config_path, resume=resume, overrides=overrides or [], extend=extend)


#: MLflow tags of a run forked from another run directory's checkpoint: the run and checkpoint it came from.
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


def quiet_libraries() -> None:
    """Per-call progress bars and info logs of libraries would drown the run's own progress line."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked workers + tokenizers threads deadlock
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_warning()
    except ImportError:  # pragma: no cover
        pass
    # mlflow sets its loggers' level from MLFLOW_LOGGING_LEVEL when imported: both, so neither order prints.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    logging.getLogger("mlflow").setLevel(logging.WARNING)


def flush_tracking(record, tracker, step: int, timeout_s: float = 5.0) -> None:
    """Before a checkpoint of ``step`` commits, every step's metrics up to it are written to the store (or
    its spool): a run killed after the checkpoint has them, and its resume logs only the steps after it."""
    if not record.wait_logged(step, timeout_s):
        log.warning("the Monitor had not logged step %d after %.0fs; checkpointing without waiting for it", step, timeout_s)
    tracker.flush()


def _announce_stop(reason: str, forced: bool) -> None:
    """Said at once when a stop signal arrives (the drain after it can take seconds)."""
    from dflash_flow.observe.progress import notice

    if forced:
        notice(f"{reason} again: forcing the stop; the batches in flight are dropped (no stop checkpoint: a resume "
               "continues from the last one)")
    elif reason == "SIGINT":
        notice("stopping after the batch in flight (Ctrl-C again to force)")
    else:
        notice(f"{reason}: stopping after the batch in flight ({reason} again to force)")


@attrs.define
class _Plan:
    """What the prepare phase hands on: everything decided before the MLflow run exists."""

    lock: Any
    checkpointer: Any
    ckpt: Any
    fork: bool
    pictures: list
    params: dict
    tags: dict


def run_validated(v: Validated, *, config_path: Path | None = None, resume: str | None = None,
                  overrides: list[str] | None = None, extend: bool = False) -> RunReport:
    """Run ``v`` with tracking and checkpoints (rank 0 owns the MLflow run, the console and the end of run). A user
    error in **prepare** ends it with no MLflow run; from **open** on every path ends the MLflow run."""
    from dflash_flow.app.distributed import init_distributed
    from dflash_flow.core.stopping import Phase, controller

    graph = v.graph
    use_cuda = any("cuda" in str(spec.devices) or spec.devices == "auto" for spec in graph.stages)
    dist_ctx = init_distributed(graph.sections["distributed"], use_cuda=use_cuda, runtime=graph.runtime)
    main = dist_ctx is None or dist_ctx.is_main
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    stopping = controller()
    with stopping.scope(announce=_announce_stop if main else None, after_running=Phase.ENDING):
        try:
            plan = _prepare_run(v, dist_ctx, config_path, resume, extend)
        except UserError as exc:
            return _refused(exc, dist_ctx, graph.run_dir)
        try:
            return _open_and_run(v, plan, dist_ctx, stopping)
        finally:
            if plan.lock is not None:
                plan.lock.release()


def _refused(exc: Exception, dist_ctx, output_dir: Path) -> RunReport:
    """A user error before the MLflow run exists: one line, exit 2; under torchrun this rank's record says
    why (so the launcher names it, not a rank that "died")."""
    from dflash_flow.app.distributed import shutdown_distributed

    if dist_ctx is not None:
        with contextlib.suppress(OSError):
            write_rank_outcome(output_dir, dist_ctx, Outcome("FAILED", EXIT_USER_ERROR, str(exc), at=time.time()))
    shutdown_distributed(dist_ctx, failed=True)
    return RunReport("FAILED", report_user_error(exc), str(exc), output_dir=output_dir)


def _prepare_run(v: Validated, dist_ctx, config_path: Path | None, resume: str | None, extend: bool) -> _Plan:
    """Phase **prepare**: ``app.prepare.prepare``, the pictures, the MLflow params and tags; raises UserError."""
    from dflash_flow.app.endrun import write_pictures
    from dflash_flow.app.prepare import prepare
    from dflash_flow.core.identity import complete_stage_configs
    from dflash_flow.observe.schema import HEADLINE_METRICS
    from dflash_flow.observe.store import redact_value, run_params, run_tags

    graph = v.graph
    output_dir = graph.run_dir
    main = dist_ctx is None or dist_ctx.is_main
    lock, checkpointer, ckpt = prepare(v, dist_ctx, output_dir, resume, extend)
    try:
        fork = ckpt is not None and not checkpointer.holds(ckpt)
        if ckpt is not None and main:
            print(f"resuming from {ckpt.path} (step {ckpt.step}, epoch {ckpt.epoch})"
                  + (" as a new run: the checkpoint is another run directory's, whose MLflow run stays as it is"
                     if fork else ""), file=sys.stderr)
        pictures = write_pictures(graph, output_dir) if main else []
        # every default written out; every credential in it (URLs, in lists and dicts too) redacted
        resolved = redact_value(graph.to_dict(complete_stage_configs(graph)))
        tags = {
            **run_tags(resolved),  # the device summary is tagged once the pipeline has placed its replicas
            "config_hash": checkpointer.expected.config_hash,
            "config_file": str(config_path) if config_path else "",
            "headline_metrics": ", ".join(HEADLINE_METRICS),  # docs/metrics.md: "Chart these first"
        }
        if fork:  # a resume into another directory: a run of its own, tagged with where it came from
            tags[PARENT_CHECKPOINT_TAG] = str(ckpt.path.resolve())
            if ckpt.mlflow_run_id:
                tags[PARENT_RUN_TAG] = ckpt.mlflow_run_id
        return _Plan(lock, checkpointer, ckpt, fork, pictures, run_params(resolved), tags)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _open_and_run(v: Validated, plan: _Plan, dist_ctx, stopping) -> RunReport:
    """Phases **open**, **build**, **run** and **end** (see ``run_validated``)."""
    from dflash_flow.app.distributed import blame_stalled_peer, shutdown_distributed
    from dflash_flow.observe.store import default_run_name
    from dflash_flow.observe.tracking import Tracker, TrackingError

    graph, output_dir = v.graph, v.graph.run_dir
    tracking = graph.sections["tracking"]
    main = dist_ctx is None or dist_ctx.is_main
    tracker = services = pipeline = peers = None
    outcome = Outcome()
    try:
        with stopping.hold():  # no stop signal cuts a store write in half; one held is raised as the hold ends
            tracker = Tracker.start(
                enabled=tracking.enabled and main, tracking_uri=tracking.tracking_uri, experiment=tracking.experiment,
                run_name=tracking.run_name or default_run_name(graph.name, output_dir), params=plan.params,
                tags=plan.tags, resume_run_id=plan.ckpt.mlflow_run_id if plan.ckpt is not None and not plan.fork else None,
                system_metrics=tracking.system_metrics, spool_dir=output_dir / "mlflow-spool")
            services, pipeline = _build(v, plan, dist_ctx, tracker)
            if dist_ctx is not None:  # every rank's progress shared with the others
                from dflash_flow.app.distributed import PeerProgress
                from dflash_flow.core.replica import progress_count

                peers = PeerProgress(dist_ctx, lambda: progress_count(pipeline.replicas)).start()
            devs = collections.Counter(r.ctx.device for reps in pipeline.replicas.values() for r in reps)
            tracker.set_tags({"device_summary": ", ".join(f"{d} x{n}" for d, n in sorted(devs.items()))})
            write_rank_outcome(output_dir, dist_ctx, None, tracker.run_id)
            for path, folder in plan.pictures:
                services.tracker.log_artifact(path, folder)
        pipeline.run()
    except BaseException as exc:
        if tracker is None:  # the MLflow run was never created: nothing to end
            shutdown_distributed(dist_ctx, failed=True)
            if isinstance(exc, TrackingError):
                return RunReport("FAILED", report_user_error(f"tracking: {exc}"), f"tracking: {exc}",
                                 output_dir=output_dir)
            raise
        stopping.enter_ending()  # first: a signal from now on cannot stop this outcome from being recorded
        outcome = blame_stalled_peer(outcome_of(exc), peers)  # a collective that waited in vain names whom for
        if plan.ckpt is not None:
            outcome = blame_checkpoint(outcome, exc, plan.ckpt.path)
        if not isinstance(exc, (Exception, KeyboardInterrupt)):
            raise
    finally:
        if peers is not None:
            peers.stop()
        if tracker is not None:
            _end(pipeline, services, outcome, tracker, dist_ctx, output_dir, stopping.enter_ending())
    return _report(outcome, services, tracker, dist_ctx, output_dir)


def _build(v: Validated, plan: _Plan, dist_ctx, tracker):
    """Phase **build**: the complete run services, then the pipeline built with them."""
    from dflash_flow.app.checkpoint import CheckpointService
    from dflash_flow.app.endrun import ContainedUploads, RunExporter
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.app.prepare import build_resume_state
    from dflash_flow.core.runtime import Pipeline
    from dflash_flow.observe.record import RunRecord
    from dflash_flow.services import RunServices

    graph, output_dir = v.graph, v.graph.run_dir
    # The seconds the resumed runs had run (their checkpoint's clock); 0 when there is none.
    before = plan.ckpt.extra.get("elapsed_s") if plan.ckpt is not None and isinstance(plan.ckpt.extra, dict) else None
    valid = isinstance(before, (int, float)) and not isinstance(before, bool) and 0 <= before < float("inf")
    record = RunRecord(elapsed_before_s=float(before) if valid else 0.0)
    pipeline = None  # built below, from the complete services

    def stage_states() -> dict[str, list[dict[str, Any]]]:
        return pipeline.state_dict()

    def elapsed_s() -> float:
        return record.elapsed_before_s + pipeline.snapshot().elapsed_s

    checkpoints = CheckpointService(
        plan.checkpointer, graph.sections["checkpoint"], stage_states=stage_states, dist=dist_ctx, tracker=tracker,
        before_commit=functools.partial(flush_tracking, record, tracker) if tracker.enabled else None,
        elapsed_s=elapsed_s)
    # Under torchrun the Distributed is the stop consensus; the export stays inside the output directory.
    services = RunServices(model=build_model_spec(graph), tracker=ContainedUploads(tracker, output_dir),
                           checkpoints=checkpoints, resume=plan.ckpt, record=record, dist=dist_ctx,
                           stop_consensus=dist_ctx, exporter=RunExporter(output_dir, record))
    pipeline = Pipeline(v, services=services, resume_state=build_resume_state(v, plan.ckpt), output_dir=output_dir)
    return services, pipeline


def _end(pipeline, services, outcome: Outcome, tracker, dist_ctx, output_dir: Path, ending) -> None:
    """Phase **end**: the outcome is decided; a stop signal from here on (``ending``) skips the uploads left,
    never changes the status summary.json, MLflow and the exit code carry."""
    from dflash_flow.app.distributed import shutdown_distributed
    from dflash_flow.app.endrun import end_of_run

    main = dist_ctx is None or dist_ctx.is_main
    try:
        try:
            write_rank_outcome(output_dir, dist_ctx, outcome, tracker.run_id)  # first: the end may be cut short
        except OSError as exc:
            log.warning("could not write this rank's outcome: %s", exc)
        if main and pipeline is not None:
            end_of_run(pipeline, services, outcome, output_dir, ending)
    finally:
        tracker.end(outcome.status)
        shutdown_distributed(dist_ctx, failed=outcome.code != EXIT_OK)
        if ending.received and main:
            print(f"interrupted during the end of the run: the rest of the report and uploads were skipped; the "
                  f"run stays {outcome.status}", file=sys.stderr)


def _report(outcome: Outcome, services, tracker, dist_ctx, output_dir: Path) -> RunReport:
    """The console's last lines (the error, where the checkpoint is, the MLflow run) and the report."""
    main = dist_ctx is None or dist_ctx.is_main
    if outcome.error:
        text = outcome.shown or outcome.error
        where = f"rank {dist_ctx.rank}: " if dist_ctx is not None else ""
        if outcome.code == EXIT_USER_ERROR:
            report_user_error(f"{where}{text}")
        else:
            print(f"error: {where}{text}" if outcome.code != EXIT_INTERRUPTED else f"stopped: {where}{text}", file=sys.stderr)
    last = services.checkpoints.last_path if services is not None else None
    if main and outcome.status == "KILLED" and last is not None:
        print(f"checkpoint saved to {last}; resume with --resume latest", file=sys.stderr)
    if tracker.run_id:
        print(f"mlflow run: {tracker.run_id} ({tracker.display_uri})", file=sys.stderr)
    return RunReport(outcome.status, outcome.code, outcome.shown or outcome.error, output_dir=output_dir,
                     mlflow_run_id=tracker.run_id, checkpoint=last,
                     record=services.record if services is not None else None)
