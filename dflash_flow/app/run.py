"""Running a validated pipeline as an application: the run services, resume, the MLflow run, the end
of run (report files, artifact uploads, the printed summary), run statuses and exit codes.

The core runtime stays generic; this layer builds the ``RunServices`` the DFlash stages use and owns
everything that happens before the first stage thread starts and after the last one ends.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USER_ERROR, is_user_input_error
from dflash_flow.core.validate import Validated

log = logging.getLogger("dflash_flow")


def resume_config_hash(graph) -> str:
    """What must match to resume: the seed and every stage's type, shape and config."""
    from dflash_flow.observe.runinfo import config_hash

    d = graph.to_dict()
    return config_hash({"seed": d.get("seed"), "stages": d.get("stages")})


def build_resume_state(v: Validated, ckpt) -> dict[str, list[dict[str, Any]]]:
    """Per-stage resume states. Stages that plan data ahead of the trainer resume from the trainer's
    position (``resume_state_for``), not from how far they had run ahead when the checkpoint was taken."""
    if ckpt is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    for spec in v.graph.stages:
        cls = v.classes[spec.name]
        derive = getattr(cls, "resume_state_for", None)
        state = derive(ckpt.data_position) if derive is not None and ckpt.data_position else None
        if state is not None:
            out[spec.name] = [state] * spec.replicas
        elif spec.name in ckpt.stage_states:
            out[spec.name] = ckpt.stage_states[spec.name]
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
    logging.getLogger("mlflow").setLevel(logging.WARNING)


def _device_summary(pipeline) -> str:
    devs: dict[str, int] = {}
    for reps in pipeline.replicas.values():
        for r in reps:
            devs[r.ctx.device] = devs.get(r.ctx.device, 0) + 1
    return ", ".join(f"{d} x{n}" for d, n in sorted(devs.items()))


@attrs.define
class Outcome:
    """How a run ended: MLflow status, exit code, the full error text (summary.json) and what the console
    shows when that differs (a user error's one line instead of its traceback)."""

    status: str = "FINISHED"
    code: int = EXIT_OK
    error: str | None = None
    shown: str | None = None


def _outcome(exc: BaseException | None) -> Outcome:
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
    return Outcome("FAILED", EXIT_FAILED, "".join(traceback.format_exception(exc)))


def _write_pictures(graph, output_dir: Path) -> list[tuple[Path, str]]:
    """The resolved YAML and the DAG (Mermaid text, a PNG), as (file, artifact folder) pairs."""
    from dflash_flow.core.render import render_image, to_mermaid

    files = [(output_dir / "pipeline.resolved.yaml", "config"), (output_dir / "pipeline.mmd", "dag")]
    files[0][0].write_text(graph.to_yaml())
    files[1][0].write_text(to_mermaid(graph))
    try:
        image = render_image(graph, output_dir / "pipeline.png")
        if image is None:  # no graphviz: draw it ourselves
            from dflash_flow.observe.dagplot import render_dag_png

            image = render_dag_png(graph, output_dir / "pipeline.png")
        files.append((image, "dag"))
    except Exception as exc:  # a picture must never stop a run; the Mermaid file is there
        log.warning("could not draw the DAG image: %s", exc)
    return files


def _end_of_run(pipeline, services, outcome: Outcome, output_dir: Path) -> None:
    """Everything after the last stage thread ended: run summary, the Monitor's record turned into report
    files and plots, artifact uploads, the printed table."""
    from dflash_flow.observe.report import summary_table, write_run_report

    tracker = services.tracker
    snapshot = pipeline.snapshot()
    summary = {
        "status": outcome.status,
        "elapsed_s": snapshot.elapsed_s,
        "error": outcome.error,
        "stages": {
            name: {"replicas": len(st.replicas), **{k: round(v, 4) for k, v in st.fractions().items()},
                   "items_in": sum(r.items_in for r in st.replicas), "items_out": sum(r.items_out for r in st.replicas)}
            for name, st in snapshot.stages.items()
        },
        "mlflow_run_id": tracker.run_id,
    }
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    tracker.log_artifact(output_dir / "summary.json")
    record = services.record
    try:
        write_run_report(record, output_dir=output_dir, tracker=tracker)
    except Exception as exc:  # the run's outcome stands; a report that cannot be drawn is a warning
        log.warning("could not write the run report: %s", exc)
    for name, path in record.artifacts.items():
        if Path(path).exists():
            tracker.log_artifact(path, name)
    if record.history or record.evals or record.train:
        print(summary_table(record), file=sys.stderr)
    for name, m in record.evals.items():
        if "tau" in m:
            print(f"speculative decoding ({name} drafter): acceptance length {m['tau']:.2f}, target forwards "
                  f"{m.get('speedup_forwards', float('nan')):.2f}x fewer, lossless={bool(m.get('lossless'))}",
                  file=sys.stderr)


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
        record = {"rank": dist_ctx.rank, "status": outcome.status, "code": outcome.code, "error": first[0] if first else None}
    if run_id:
        record["mlflow_run_id"] = run_id
    folder = output_dir / "ranks"
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_text(folder / f"rank{dist_ctx.rank}.json", json.dumps(record) + "\n")


def run_validated(v: Validated, *, config_path: Path | None = None, resume: str | None = None, overrides: list[str] | None = None) -> int:
    """Run ``v`` with tracking and checkpoints (one rank of a torchrun job, or the whole job). Returns
    the process exit code. Under torchrun rank 0 owns the MLflow run, the console and the end of run;
    the other ranks print nothing but errors."""
    from dflash_flow.app.checkpoint import Checkpointer, CheckpointError, CheckpointService
    from dflash_flow.app.distributed import init_distributed, shutdown_distributed
    from dflash_flow.core.runtime import Pipeline
    from dflash_flow.observe.runinfo import redact_uri, run_tags
    from dflash_flow.observe.tracking import Tracker
    from dflash_flow.services import RunServices

    graph = v.graph
    dist_ctx = init_distributed(graph.sections["distributed"], use_cuda=_uses_cuda(v))
    main = dist_ctx is None or dist_ctx.is_main
    logging.basicConfig(level=logging.INFO if main else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    quiet_libraries()
    output_dir = Path(graph.output_dir or f"runs/{graph.name}")
    tracking = graph.sections["tracking"]
    ck = graph.sections["checkpoint"]
    chash = resume_config_hash(graph)
    checkpointer = Checkpointer(Path(ck.dir) if ck.dir else output_dir / "checkpoints", keep_last=ck.keep_last, config_hash=chash)
    ckpt = None
    if resume == "auto":  # torchrun --max-restarts: the first attempt starts fresh, a restart continues
        resume = "latest" if checkpointer.list() else None
    if resume:
        try:
            ckpt = checkpointer.load(resume)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            shutdown_distributed(dist_ctx, failed=True)
            return EXIT_USER_ERROR
        if main:
            print(f"resuming from {ckpt.path} (step {ckpt.step}, epoch {ckpt.epoch})", file=sys.stderr)

    services = RunServices(resume=ckpt, dist=dist_ctx)
    pipeline = Pipeline(v, services=services, resume_state=build_resume_state(v, ckpt), output_dir=output_dir)
    services.checkpoints = CheckpointService(checkpointer, ck, stage_states=pipeline.state_dict, dist=dist_ctx)
    output_dir.mkdir(parents=True, exist_ok=True)
    pictures = _write_pictures(graph, output_dir) if main else []
    resolved = graph.to_dict()
    if resolved.get("tracking", {}).get("tracking_uri"):
        resolved["tracking"]["tracking_uri"] = redact_uri(resolved["tracking"]["tracking_uri"])
    # The MLflow run is created last, right before the pipeline starts: every path after this line ends it.
    tracker = Tracker.start(
        enabled=tracking.enabled and main,
        tracking_uri=tracking.tracking_uri,
        experiment=tracking.experiment,
        run_name=tracking.run_name or graph.name,
        params=resolved,
        tags={
            **run_tags(resolved, world_size=pipeline.world_size, device_summary=_device_summary(pipeline)),
            "config_hash": chash,
            "config_file": str(config_path) if config_path else "",
        },
        resume_run_id=ckpt.mlflow_run_id if ckpt else None,
        system_metrics=tracking.system_metrics,
        spool_dir=output_dir / "mlflow-spool",
    )
    checkpointer.tracker = tracker
    services.tracker = tracker
    outcome = Outcome()
    _write_rank_outcome(output_dir, dist_ctx, None, tracker.run_id)
    try:
        for path, folder in pictures:
            tracker.log_artifact(path, folder)
        pipeline.run()
    except BaseException as exc:
        outcome = _outcome(exc)
        if not isinstance(exc, Exception) and not isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        try:
            _write_rank_outcome(output_dir, dist_ctx, outcome, tracker.run_id)  # first: the end of run may be cut short
            if main:
                _end_of_run(pipeline, services, outcome, output_dir)
        finally:
            tracker.end(outcome.status)
            shutdown_distributed(dist_ctx, failed=outcome.code != EXIT_OK)
    if outcome.error:
        text = outcome.shown or outcome.error
        where = f"rank {dist_ctx.rank}: " if dist_ctx is not None else ""
        print(f"error: {where}{text}" if outcome.code != EXIT_INTERRUPTED else f"stopped: {where}{text}", file=sys.stderr)
    last = services.checkpoints.last_path
    if main and outcome.status == "KILLED" and last is not None:
        print(f"checkpoint saved to {last}; resume with --resume latest", file=sys.stderr)
    if tracker.run_id:
        print(f"mlflow run: {tracker.run_id} ({tracker.display_uri})", file=sys.stderr)
    return outcome.code
