"""The ``export``, ``eval``, ``regenerate``, ``import-spool`` and ``serve-target`` commands: each one function from
CLI arguments to an exit code (user errors are one line and exit 2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from dflash_flow.app.exits import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, report_user_error, user_error


def _run_target(checkpoint: Path) -> str | None:
    """The target of the run that wrote ``checkpoint`` (its output directory's resolved YAML), or None."""
    import yaml

    for parent in list(checkpoint.resolve().parents)[:3]:
        resolved = parent / "pipeline.resolved.yaml"
        if not resolved.is_file():
            continue
        try:
            doc = yaml.safe_load(resolved.read_text()) or {}
        except (OSError, yaml.YAMLError):
            return None
        target = (doc.get("model") or {}).get("target")
        for stage in doc.get("stages") or []:
            if target is None and isinstance(stage, dict) and stage.get("type") == "DrafterStep":
                target = (stage.get("config") or {}).get("target")
        from dflash_flow.app.model_spec import resolve_target

        return resolve_target(target) if isinstance(target, str) else None
    return None


def latest_marker_dir(path: Path) -> Path:
    """``.../checkpoints/latest`` (the file) as the checkpoints directory; any other path as given."""
    from dflash_flow.app.checkpoint_format import LATEST

    path = Path(path).expanduser()
    return path.parent if path.name == LATEST and path.is_file() else path


def export_checkpoint(checkpoint: Path, out: Path, target: str | None = None) -> int:
    """``dflash-flow export``: a training checkpoint into the layout engines load (never into or over an input)."""
    # torch and transformers only once the checkpoint and the destination checked out: a mistake fails at once.
    from dflash_flow.app.checkpoint import Checkpointer
    from dflash_flow.app.checkpoint_format import LATEST, load_checkpoint
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.model.export_contract import check_destination, format_serve_commands, serve_commands

    checkpoint = latest_marker_dir(checkpoint)
    try:
        check_destination(out, (checkpoint,))
        path = Checkpointer(checkpoint).resolve(checkpoint)
        inputs = (checkpoint, path)
        if (path.parent / LATEST).is_file():  # and the checkpoints directory it lies in
            inputs += (path.parent,)
        check_destination(out, inputs)
        load_checkpoint(path)  # verifies every checksum before anything is read
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json (written by an older version?)")
        from dflash_flow.model.export import load_drafter, save_drafter

        drafter = load_drafter(path)
        save_drafter(drafter, out, inputs=inputs)
    except (CheckpointError, OSError) as exc:  # OSError: OUT cannot be written (read-only, full, a file)
        return report_user_error(exc)
    n = sum(p.numel() for p in drafter.parameters())
    print(f"exported {path} -> {out} ({n / 1e6:.2f} M drafter parameters; checked against the vLLM and SGLang "
          "contract)")
    print(format_serve_commands(serve_commands(out, target or _run_target(path))))
    return EXIT_OK


def write_output_text(path: Path, text: str, what: str) -> None:
    """Write a command's output file, checked before (``prepare.check_output_file``); a full disk exits 2."""
    from dflash_flow.util import atomic_write_text

    try:
        atomic_write_text(path, text, durable=False)
    except OSError as exc:
        user_error(f"{what} {path}: {exc.strerror or exc}")


def import_spool_command(spool: Path, tracking_uri: str | None) -> int:
    """``dflash-flow import-spool``: replay what a run spooled while its tracking store was unreachable."""
    from dflash_flow.observe.spool import SpoolError, import_spool

    try:
        run_id = import_spool(spool, tracking_uri)
    except SpoolError as exc:  # one line naming the spool, never a traceback
        return report_user_error(exc)
    print(f"imported {spool} into run {run_id}")
    return EXIT_OK


def eval_command(drafter: Path, target: str, prompts: Path, max_new_tokens: int, limit: int, baseline: bool,
                 tokenizer: str | None, *, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
                 horizons: list[int] | None = None, walk_data: str | None = None, walk_limit: int = 64,
                 seed: int = 0, torch_threads: int | None = None, batch_size: int = 16) -> int:
    """``dflash-flow eval``: real speculative decoding, greedy and sampled, at each horizon; and the walk."""
    from dflash_flow.app.model_spec import resolve_target
    from dflash_flow.app.runner import quiet_libraries
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.model.evaluation import evaluate_exported
    from dflash_flow.observe.console import render_table as summary_table

    try:
        drafter = _drafter_dir(drafter)
    except CheckpointError as exc:
        return report_user_error(exc)
    problem = _eval_argument_problem(drafter, target, prompts, tokenizer, walk_data, limit=limit,
                                     max_new_tokens=max_new_tokens, horizons=horizons or [], walk_limit=walk_limit)
    if problem:
        return report_user_error(problem)
    quiet_libraries()
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    extra = [h for h in horizons or [] if h != max_new_tokens]
    try:
        if walk_data == "embedded":
            from dflash_flow.stages.spec_eval import embedded_walk_data

            walk_data = str(embedded_walk_data())
        results = evaluate_exported(
            target=resolve_target(target), drafter_path=drafter, prompts_path=prompts, tokenizer_path=tokenizer,
            limit=limit, max_new_tokens=[max_new_tokens, *extra], baseline=baseline,
            temperatures=[0.0, temperature] if temperature > 0 else [0.0], top_p=top_p, top_k=top_k,
            walk_data=walk_data, walk_limit=walk_limit, seed=seed, batch_size=batch_size,
        )
    except (CheckpointError, ValueError, OSError) as exc:
        return report_user_error(exc)
    from dflash_flow.observe.names import eval_label

    rows = [[eval_label(r), r.metrics.get("tau"), *(r.at(h) for h in extra), r.metrics.get("speedup_forwards"),
             r.lossless, r.metrics.get("tokens_generated"), r.num_prompts if r.num_prompts is not None
             else r.num_conversations, r.metrics.get("speedup_wall")] for r in results]
    headers = ["drafter", "acceptance_length", *(f"acceptance@{h}" for h in extra), "forward_speedup", "lossless",
               "tokens", "prompts", "wall_speedup"]
    print(f"acceptance_length at {max_new_tokens} new tokens (tokens per target step); walk = teacher-forced walk")
    print(summary_table(rows, headers, width=160))
    return EXIT_OK


def _drafter_dir(drafter: Path) -> Path:
    """``eval --drafter``: an export, a checkpoint, or a checkpoints directory (or its ``latest``): its newest."""
    from dflash_flow.app.checkpoint import Checkpointer, holds_checkpoints

    path = latest_marker_dir(drafter)
    if path.is_dir() and not (path / "config.json").is_file() and holds_checkpoints(path):
        return Checkpointer(path).resolve("latest")
    return path


def _eval_argument_problem(drafter: Path, target: str, prompts: Path, tokenizer: str | None, walk_data: str | None,
                           *, limit: int, max_new_tokens: int, horizons: list[int], walk_limit: int) -> str | None:
    """What is wrong with ``eval``'s arguments, found before any model loads (None: nothing)."""
    for name, value in (("--limit", limit), ("--max-new-tokens", max_new_tokens), ("--walk-limit", walk_limit),
                        *(("--horizon", h) for h in horizons)):
        if int(value) < 1:
            return f"{name} must be at least 1, got {value}"
    if problem := model_path_problem(drafter, target, tokenizer):
        return problem
    if not Path(prompts).expanduser().is_file():
        return f"--prompts {prompts}: no such file"
    if walk_data not in (None, "embedded") and not Path(walk_data).expanduser().is_file():
        return f"--walk-data {walk_data}: no such file"
    return None


def model_path_problem(drafter: Path, target: str | None, tokenizer: str | None) -> str | None:
    """A ``--target`` or ``--tokenizer`` path (absolute, relative, home; anything else is a preset name or a hub
    id) that does not exist, or a ``--drafter`` that is not a directory (None: neither)."""
    for name, value in (("--target", target), ("--tokenizer", tokenizer)):
        if value and value != "embedded" and value.startswith(("/", ".", "~")) and not Path(value).expanduser().exists():
            return f"{name} {value} does not exist (a local model directory, a preset name or a hub id)"
    if not Path(drafter).expanduser().is_dir():
        return (f"--drafter {drafter} does not exist" if not Path(drafter).expanduser().exists()
                else f"--drafter {drafter} is not a directory (an exported drafter is one)")
    return None


class _ReplyProgress:
    """The regenerate commands' progress bar (made once the total is known), log lines, and Ctrl-C's note."""

    def __init__(self) -> None:
        self.bar = None

    def __call__(self, done: int, total: int, tokens: int) -> None:
        from dflash_flow.observe.progress import ProgressBar

        if self.bar is None:
            self.bar = ProgressBar(total, label="regenerate", unit="replies", done=done)
        else:
            self.bar.update(done - self.bar.done, tok=tokens)

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.message(text)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def stopped(self, out: Path) -> int:
        self.close()
        print(f"stopped: {out} holds every reply finished so far; the same command continues from there",
              file=sys.stderr)
        return EXIT_INTERRUPTED


def regenerate_command(prompts: Path, target: str | None, out: Path, batch_size: int, max_new_tokens: int, resume: bool,
                       system_prompt: str | None, server_only: list[str] | None = None) -> int:
    """``dflash-flow regenerate``: replies regenerated greedily by the target (batched, resumable)."""
    from dflash_flow.app.model_spec import resolve_target
    from dflash_flow.app.runner import quiet_libraries
    from dflash_flow.embedded import regenerate

    if server_only:
        return report_user_error(f"{', '.join(server_only)} only apply with --server (regeneration through serving "
                                 "engines); drop them, or add --server URL")
    if target is None:
        return report_user_error("regenerate needs --target (a model directory, or 'embedded'), or --server URL "
                                 "to regenerate through serving engines")
    quiet_libraries()
    replies = _ReplyProgress()
    try:
        stats = regenerate(prompts, resolve_target(target), out, batch_size=batch_size, max_new_tokens=max_new_tokens,
                           resume=resume, progress=replies, system_prompt=system_prompt)
    except (ValueError, OSError) as exc:
        return report_user_error(exc)
    except KeyboardInterrupt:
        return replies.stopped(out)
    finally:
        replies.close()
    print(f"wrote {out}: {stats.total} records ({stats.generated} generated now)")
    if stats.moved_aside is not None:
        print(f"the old {out} was moved aside to {stats.moved_aside} (--no-resume)")
    if stats.stale:
        print(f"{stats.stale} rows were written for prompts that have changed since: generated again")
    for line in regenerate_warnings(stats, max_new_tokens):
        print(f"warning: {line}", file=sys.stderr)
    _warn_error_rows(stats)
    return EXIT_OK


def regenerate_served_command(prompts: Path, servers: list[str], out: Path, *, target: str | None,
                              max_new_tokens: int, resume: bool, system_prompt: str | None, served_model: str | None,
                              concurrency: int, sampling: str, thinking: bool | None, timeout: float,
                              max_attempts: int, retry_errors: bool, seed: int, api_key_env: str | None = None,
                              in_process_only: list[str] | None = None) -> int:
    """``dflash-flow regenerate --server URL ...``: replies from OpenAI-compatible servers (resumable)."""
    from dflash_flow.app.model_spec import resolve_target
    from dflash_flow.embedded.served import AllServersDown, regenerate_served

    if in_process_only:
        return report_user_error(f"{', '.join(in_process_only)} only applies in process (without --server); the "
                                 "servers batch requests themselves: use --concurrency")
    from dflash_flow.engine.http import api_key_from_env

    replies = _ReplyProgress()
    try:
        stats = regenerate_served(
            prompts, servers, out, max_new_tokens=max_new_tokens, concurrency=concurrency, model=served_model,
            sampling=sampling, target=None if target is None else resolve_target(target), enable_thinking=thinking,
            seed=seed, timeout_s=timeout, max_attempts=max_attempts, resume=resume, retry_errors=retry_errors,
            system_prompt=system_prompt, progress=replies, log=replies.message,
            api_key=api_key_from_env(api_key_env))
    except (ValueError, OSError) as exc:
        return report_user_error(exc)
    except AllServersDown as exc:
        replies.close()
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return replies.stopped(out)
    finally:
        replies.close()
    print(served_summary(stats, out))
    for line in regenerate_warnings(stats, max_new_tokens):
        print(f"warning: {line}", file=sys.stderr)
    _warn_error_rows(stats, "; --retry-errors tries them again")
    return EXIT_OK


def _warn_error_rows(stats, again: str = "") -> None:
    if stats.errors:
        shown = "; ".join(f"{rid!r}: {err}" for rid, err in stats.errors[:3])
        more = f" (and {len(stats.errors) - 3} more)" if len(stats.errors) > 3 else ""
        print(f"warning: {len(stats.errors)} rows failed and are written with finish_reason \"error\" and no reply "
              f"(training counts them as bad records and skips them): {shown}{more}{again}", file=sys.stderr)


def served_summary(stats, out: Path) -> str:
    """The accounting of a regeneration through servers, one paragraph."""
    reasons = ", ".join(f"{r} {stats.reasons.get(r, 0)}" for r in ("stop", "length", "empty", "error"))
    lines = [f"wrote {out}: {stats.total} records ({stats.skipped} already there, {stats.generated} now: {reasons}); "
             f"{stats.new_tokens} tokens in {stats.seconds:.1f} s ({stats.tokens_per_s:.1f} tokens/s)"]
    if stats.moved_aside is not None:
        lines.append(f"  the old {out} was moved aside to {stats.moved_aside} (--no-resume)")
    if stats.stale:
        lines.append(f"  {stats.stale} rows were written for prompts that have changed since: asked again")
    if stats.dropped_errors:
        lines.append(f"  {stats.dropped_errors} error rows dropped to be tried again")
    if stats.failures:
        lines.append(f"  failed attempts: {', '.join(f'{k} {v}' for k, v in sorted(stats.failures.items()))} "
                     f"({stats.retries} retried)")
    for s in stats.servers:
        fails = sum(s["failures"].values())
        lines.append(f"  {s['url']}: {s['ok']} answered, {fails} failed, taken out {s['taken_out']}x, now {s['state']}")
    return "\n".join(lines)


def regenerate_warnings(stats, max_new_tokens: int) -> list[str]:
    """Warnings of a finished regeneration: empty replies and replies cut at ``--max-new-tokens``."""
    lines = []
    if stats.empty:
        lines.append(f"{stats.empty} of {stats.replies} replies generated now are empty (the target ended its "
                     "turn at once): they teach the drafter nothing; check the chat template and --system-prompt, "
                     "or drop those records")
    if stats.truncated:
        lines.append(f"{stats.truncated} of {stats.replies} replies stopped at --max-new-tokens {max_new_tokens} "
                     "(finish_reason \"length\"); raise it for whole replies")
    return lines


def serve_target_line(v: Any, *, tp: int = 1, port: int = 8000, host: str | None = None, python: str = "python",
                      dtype: str | None = None, max_model_len: int | None = None) -> tuple[str, list[str]]:
    """(the shell line (stdout alone), notes (stderr)) for ``v``; ValueError when its target cannot be served."""
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.engine.config import (
        EngineConfig,
        package_root,
        shell_line,
        to_engine_layer_ids,
        vllm_server_argv,
    )
    from dflash_flow.model.facts import preset_params

    spec = build_model_spec(v.graph)
    target = spec.require_target("serve-target")
    if not isinstance(target, str) or (preset_params(target) is not None and not os.path.isdir(target)):
        raise ValueError(f"model.target {spec.declared!r} is a preset: it exists only in this process, a vLLM server "
                         "cannot load it (use a model directory or hub id)")
    depth = spec.facts.depth if spec.facts is not None else None
    if depth is None and spec.explicit_layer_ids is None:
        raise ValueError(f"the depth of {target} is not readable here (no local config.json): set "
                         "model.target_layer_ids, or run serve-target where the model directory is")
    ids = spec.layer_ids(depth)
    engine_ids = to_engine_layer_ids(ids, depth)
    cfg = spec.engine if spec.engine is not None else EngineConfig()
    launch = cfg.launch
    argv = vllm_server_argv(
        python=python, target=target, engine_layer_ids=engine_ids, features_dir=cfg.server_features_dir(), port=port,
        host=host, tp=tp, dtype=dtype or (launch.dtype if launch is not None else "auto"),
        max_model_len=max_model_len or (launch.max_model_len if launch is not None else None),
        prefix_caching=cfg.prefix_caching, trust_remote_code=spec.trust_remote_code,
        served_model=cfg.served_model or "target")
    line = shell_line(argv, {"PYTHONPATH": package_root()}, api_key_env=cfg.api_key_env)
    notes = [
        f"target layers {ids} (ours) -> vLLM {engine_ids}; chunked prefill off; prefix caching "
        f"{'on' if cfg.prefix_caching else 'off'}; our connector writes features to {cfg.server_features_dir()}",
        f"PYTHONPATH lets vLLM import dflash_flow.engine.vllm_connector from {package_root()}; on another node "
        "point it at a copy of dflash-flow there (or pip install --no-deps dflash-flow in the vLLM environment)",
        "then list each server in model.engine.servers (http://<node>:<port>) and keep model.engine.features_dir "
        "the same directory as seen by the trainer (path_map where it is mounted elsewhere)",
    ]
    if spec.engine is None:
        notes.append("the pipeline has no model.engine section yet: add one (servers: [...]) to train from these servers")
    return line, notes


def serve_target_command(v: Any, **options: Any) -> int:
    try:
        line, notes = serve_target_line(v, **options)
    except ValueError as exc:
        return report_user_error(exc)
    for n in notes:
        print(f"# {n}", file=sys.stderr)
    print(line)
    return 0
