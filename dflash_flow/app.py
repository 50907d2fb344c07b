"""Running a validated pipeline as an application: MLflow run, checkpoints, resume, exit codes.

The core runtime stays generic; this layer wires the run services (tracker, checkpointer) that DFlash
stages use, and turns outcomes into run statuses and exit codes.
"""

from __future__ import annotations

import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Any

from dflash_flow.core.validate import Validated

log = logging.getLogger("dflash_flow")

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


def resume_config_hash(graph) -> str:
    """What must match to resume: the seed and every stage's type, shape and config."""
    from dflash_flow.observe.tracking import config_hash

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


def preflight_problems(v: Validated) -> list:
    """DFlash checks across stages that the generic validation cannot know: a Bucketer token budget
    smaller than the longest sample an upstream source may emit (it would fail after reading all data)."""
    import math

    from dflash_flow.core.errors import Problem
    from dflash_flow.stages.bucketer import Bucketer

    graph = v.graph
    loc = graph.locator
    problems = []
    for i, spec in enumerate(graph.stages):
        conf = v.configs.get(spec.name)
        if not isinstance(conf, Bucketer):
            continue
        todo, seen = [inp.stage for inp in spec.inputs], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            up = v.configs.get(name)
            max_length = getattr(up, "max_length", None)
            if isinstance(max_length, int):
                multiple = max(int(getattr(conf, "pad_to_multiple", 1)), 1)
                padded = math.ceil(max_length / multiple) * multiple
                if conf.max_tokens < padded:
                    problems.append(Problem(
                        f"max_tokens={conf.max_tokens} is smaller than one sample: stage '{name}' emits samples "
                        f"of up to max_length={max_length} tokens ({padded} padded); raise max_tokens or lower max_length",
                        file=loc.filename if loc is not None else None,
                        line=loc.line("stages", i, "config", "max_tokens") if loc is not None else None,
                        stage=spec.name,
                        field="max_tokens",
                    ))
                continue
            todo.extend(inp.stage for inp in graph.stage(name).inputs)
    return problems


def is_user_input_error(exc: BaseException) -> bool:
    """Errors that mean "your input is wrong" (exit code 2) rather than "the program failed" (1)."""
    from dflash_flow.core.errors import DflashFlowError
    from dflash_flow.data.records import DataError

    return isinstance(exc, (DataError, DflashFlowError))


def _quiet_libraries() -> None:
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


def run_validated(v: Validated, *, config_path: Path | None = None, resume: str | None = None, overrides: list[str] | None = None) -> int:
    """Run ``v`` with tracking and checkpoints. Returns the process exit code."""
    from dflash_flow import sections  # noqa: F401
    from dflash_flow.checkpoint import Checkpointer, CheckpointError
    from dflash_flow.core import PipelineInterrupted, PipelineStalled, StageError
    from dflash_flow.core.render import render_image, to_mermaid
    from dflash_flow.core.runtime import Pipeline
    from dflash_flow.observe.tracking import Tracker, run_tags

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    graph = v.graph
    output_dir = Path(graph.output_dir or f"runs/{graph.name}")
    tracking = graph.sections["tracking"]
    ck = graph.sections["checkpoint"]
    chash = resume_config_hash(graph)
    checkpointer = Checkpointer(Path(ck.dir) if ck.dir else output_dir / "checkpoints", keep_last=ck.keep_last, config_hash=chash)
    ckpt = None
    if resume:
        try:
            ckpt = checkpointer.load(resume)
        except CheckpointError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return EXIT_USER_ERROR
        print(f"resuming from {ckpt.path} (step {ckpt.step}, epoch {ckpt.epoch})", file=sys.stderr)

    resolved = graph.to_dict()
    pipeline = Pipeline(
        v,
        services={},
        resume_state=build_resume_state(v, ckpt),
        output_dir=output_dir,
    )
    tracker = Tracker.start(
        enabled=tracking.enabled,
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
    pipeline.services.update(
        {"tracker": tracker, "checkpointer": checkpointer, "checkpoint_config": ck, "resume": ckpt}
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "pipeline.resolved.yaml").write_text(graph.to_yaml())
    (output_dir / "pipeline.mmd").write_text(to_mermaid(graph))
    tracker.log_artifact(output_dir / "pipeline.resolved.yaml", "config")
    tracker.log_artifact(output_dir / "pipeline.mmd", "dag")
    try:
        image = render_image(graph, output_dir / "pipeline.png")
        if image is None:  # no graphviz: draw it ourselves
            from dflash_flow.observe.dagplot import render_dag_png

            image = render_dag_png(graph, output_dir / "pipeline.png")
    except Exception as exc:  # a picture must never stop a run; the Mermaid file is there
        log.warning("could not draw the DAG image: %s", exc)
        image = None
    if image is not None:
        tracker.log_artifact(image, "dag")
    status, code, error_text = "FINISHED", EXIT_OK, None
    shown = None  # what the console gets when it differs from error_text (summary.json keeps everything)
    try:
        pipeline.run()
    except StageError as exc:
        status, code = "FAILED", EXIT_FAILED
        original = "".join(traceback.format_exception(exc.original))
        error_text = f"{exc}\n\nOriginal traceback ({exc.stage}[{exc.replica}], {exc.phase}):\n{original}"
        notes = "".join(f"\n{note}" for note in getattr(exc, "__notes__", []))
        error_text += notes
        if is_user_input_error(exc.original):
            # Bad input data (a file that is missing, empty, truncated, not JSON...): the message names the
            # file and line; a traceback would only bury it. summary.json keeps the traceback.
            code, shown = EXIT_USER_ERROR, f"{exc}{notes}"
    except PipelineStalled as exc:
        status, code, error_text = "FAILED", EXIT_FAILED, str(exc)
    except PipelineInterrupted as exc:
        status, code, error_text = "KILLED", EXIT_INTERRUPTED, str(exc)
    except KeyboardInterrupt:
        # Ctrl-C / SIGTERM before the pipeline's own handling started (stage imports in preload).
        status, code, error_text = "KILLED", EXIT_INTERRUPTED, "pipeline interrupted (before it started)"
    except BaseException as exc:
        status, code = "FAILED", EXIT_FAILED
        error_text = "".join(traceback.format_exception(exc))
        raise
    finally:
        snapshot = pipeline.snapshot()
        summary = {
            "status": status,
            "elapsed_s": snapshot.elapsed_s,
            "error": error_text,
            "stages": {
                name: {"replicas": len(st.replicas), **{k: round(v, 4) for k, v in st.fractions().items()},
                       "items_in": sum(r.items_in for r in st.replicas), "items_out": sum(r.items_out for r in st.replicas)}
                for name, st in snapshot.stages.items()
            },
            "mlflow_run_id": tracker.run_id,
        }
        (output_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        tracker.log_artifact(output_dir / "summary.json")
        tracker.end(status)
    if error_text:
        text = shown or error_text
        print(f"error: {text}" if code != EXIT_INTERRUPTED else f"stopped: {text}", file=sys.stderr)
    if tracker.run_id:
        print(f"mlflow run: {tracker.run_id} ({tracker.tracking_uri})", file=sys.stderr)
    return code


def export_checkpoint(checkpoint: Path, out: Path) -> int:
    """``dflash-flow export``: a training checkpoint (or a checkpoints directory: its latest) into the
    layout inference engines load (config.json + model.safetensors with the drafter weights only)."""
    from dflash_flow.checkpoint import Checkpointer, CheckpointError, load_checkpoint
    from dflash_flow.model.export import CheckpointError as DrafterCheckpointError
    from dflash_flow.model.export import load_drafter, save_drafter

    try:
        path = Checkpointer(checkpoint).resolve(checkpoint)
        load_checkpoint(path)  # verifies every checksum before anything is read
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (written by an older version?)")
        drafter = load_drafter(path)
        save_drafter(drafter, out)
    except (CheckpointError, DrafterCheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    n = sum(p.numel() for p in drafter.parameters())
    print(f"exported {path} -> {out} ({n / 1e6:.2f} M drafter parameters)")
    return EXIT_OK


def eval_command(drafter: Path, target: str, prompts: Path, max_new_tokens: int, limit: int, baseline: bool,
                 tokenizer: str | None) -> int:
    """``dflash-flow eval``: real speculative decoding with any exported drafter and its target."""
    from dflash_flow.model.evaluation import evaluate_exported
    from dflash_flow.model.export import CheckpointError as DrafterCheckpointError

    _quiet_libraries()
    try:
        results = evaluate_exported(
            target=target, drafter_path=drafter, prompts_path=prompts, tokenizer_path=tokenizer,
            limit=limit, max_new_tokens=max_new_tokens, baseline=baseline,
        )
    except (DrafterCheckpointError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    from dflash_flow.observe.progress import summary_table

    keys = ["tau", "speedup_forwards", "lossless", "tokens_generated", "num_prompts", "speedup_wall"]
    rows = [[name] + [m[k] for k in keys] for name, m in results.items()]
    print(summary_table(rows, ["drafter", "acceptance_length", "forward_speedup", "lossless", "tokens", "prompts", "wall_speedup"]))
    return EXIT_OK


def regenerate_command(prompts: Path, target: str, out: Path, batch_size: int, max_new_tokens: int, resume: bool,
                       system_prompt: str | None) -> int:
    """``dflash-flow regenerate``: replies regenerated greedily by the target (batched, resumable)."""
    from dflash_flow.embedded.regenerate import regenerate
    from dflash_flow.stages.target_forward import target_spec

    _quiet_libraries()
    try:
        stats = regenerate(prompts, target_spec(target), out, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           resume=resume, progress=True, system_prompt=system_prompt)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out}: {stats.total} records ({stats.generated} generated now)")
    return EXIT_OK
