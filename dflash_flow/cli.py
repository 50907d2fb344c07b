"""The `dflash-flow` command line: parsing, messages and exit codes (no torch or mlflow at module level)."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Optional

import typer

from dflash_flow.app.exits import guard_console, user_error
from dflash_flow.app.runner import EXTEND_RULE

app = typer.Typer(name="dflash-flow", help="Train DFlash speculative-decoding drafters as a typed dataflow pipeline.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)

SetOpt = typer.Option(None, "--set", "-s", help="Override a value: key.path=value (repeatable).")


def _check_output_file(path: Path, what: str, *, make_parents: bool = False) -> None:
    """Exit 2 with one line, before any work, when ``path`` cannot be written as a file."""
    from dflash_flow.app.exits import UserError
    from dflash_flow.app.prepare import check_output_file

    try:
        check_output_file(path, what, make_parents=make_parents)
    except UserError as exc:
        user_error(str(exc))


def _load(file: Path, overrides: Optional[list[str]], **options):
    """Load and validate (``app.runner.load``); print one line per problem and exit 2 on user errors."""
    from dflash_flow.app.runner import load
    from dflash_flow.core import ConfigError

    try:
        return load(file, overrides=overrides, **options)
    except ConfigError as exc:
        lines = [p.format() for p in exc.problems]
        user_error(f"error: {file}: {len(lines)} problem(s)\n" + "\n".join(lines))


@app.command()
def validate(
    file: Path = typer.Argument(..., help="Pipeline YAML file."),
    set_: Optional[list[str]] = SetOpt,
    no_device_check: bool = typer.Option(False, "--no-device-check", help="Validate for another machine: skip the checks of this machine's devices and files."),
    no_path_check: bool = typer.Option(False, "--no-path-check", help="Skip only the checks that data files and model directories exist."),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Check the GPU placement for N ranks per node."),
    gpus: Optional[int] = typer.Option(None, "--gpus", min=0, help="Check the placement as if N GPUs were visible (another machine: files are not checked)."),
) -> None:
    """Check a pipeline file without running it."""
    # --gpus simulates the devices, so the placement is checked against it even with --no-device-check.
    v = _load(file, set_, check_devices=not no_device_check or gpus is not None, local_world_size=nproc, gpu_count=gpus,
              check_paths=not (no_device_check or no_path_check or gpus is not None))
    n = sum(s.replicas for s in v.graph.stages)
    typer.echo(f"ok: {file}: {len(v.graph.stages)} stages, {n} replicas")


@app.command()
def graph(
    file: Path = typer.Argument(..., help="Pipeline YAML file."),
    format: str = typer.Option("mermaid", "--format", "-f", help="mermaid or dot"),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write here; .png/.svg renders an image (needs graphviz)."),
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Print the DAG as Mermaid or Graphviz dot (or render an image)."""
    from dflash_flow.core.graph import render_image, to_dot, to_mermaid

    v = _load(file, set_, check_devices=False)
    if format not in ("mermaid", "dot"):
        user_error(f"error: --format must be mermaid or dot, got {format!r}")
    text = to_mermaid(v.graph) if format == "mermaid" else to_dot(v.graph)
    if output is None:
        return typer.echo(text, nl=False)
    _check_output_file(output, "--output")
    if output.suffix.lower() in (".png", ".svg", ".pdf"):
        if render_image(v.graph, output) is None:
            user_error("error: rendering an image needs graphviz's `dot` (apt-get install graphviz); use --format dot")
    else:
        from dflash_flow.app.commands import write_output_text

        write_output_text(output, text, "--output")
    typer.echo(f"wrote {output}")


@app.command()
def stages(name: Optional[str] = typer.Argument(None, help="Show one stage type in detail.")) -> None:
    """List registered stage types with their ports and config fields."""
    from dflash_flow.core import registry
    from dflash_flow.core.graph import describe_stage

    names = registry.available()
    if name is not None:
        if name not in names:
            user_error(f"error: unknown stage type '{name}'; registered: {', '.join(names)}")
        names = [name]
    blocks = []
    for n in names:
        try:
            blocks.append(describe_stage(n))
        except Exception as exc:  # a broken plugin is reported, the others still listed
            blocks.append(f"{n}\n  (failed to load: {type(exc).__name__}: {exc})")
    typer.echo("\n\n".join(blocks))


@app.command()
def run(
    file: Path = typer.Argument(..., help="Pipeline YAML file."),
    set_: Optional[list[str]] = SetOpt,
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Resume from a checkpoint path, 'latest', or 'auto' (latest if there is one). A "
        "checkpoint of another output_dir starts a new MLflow run tagged with its parent."
    ),
    extend: bool = typer.Option(False, "--extend", help=EXTEND_RULE),
    nproc: Optional[int] = typer.Option(None, "--nproc", min=1, help="Start the job under torchrun with N processes per node."),
    nnodes: str = typer.Option("1", "--nnodes", help="With --nproc: nodes (or MIN:MAX), passed to torchrun."),
    rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint", help="With --nproc: HOST:PORT of the rendezvous."),
    rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id", help="With --nproc: job id shared by the nodes."),
    max_restarts: int = typer.Option(0, "--max-restarts", min=0, help="With --nproc: torchrun restarts (use --resume auto)."),
) -> None:
    """Run a pipeline (in this process, or under torchrun with --nproc)."""
    from dflash_flow.core.stopping import controller

    guard_console()
    v = _load(file, set_, local_world_size=nproc)
    if nproc is not None:
        from dflash_flow.app.launch import launch

        tracking = v.graph.sections["tracking"]
        code = launch(file, nproc=nproc, nnodes=nnodes, rdzv_endpoint=rdzv_endpoint, rdzv_id=rdzv_id,
                      tracking_uri=tracking.tracking_uri if tracking.enabled else None, max_restarts=max_restarts,
                      overrides=set_ or [], resume=resume, extend=extend)
        controller().decide(code)
        raise typer.Exit(code)
    from dflash_flow.app.runner import run_validated

    code = run_validated(v, config_path=file, resume=resume, overrides=set_ or [], extend=extend).exit_code
    controller().decide(code)  # a signal from here on ends the process with this code (the status is written)
    _exit_now_if_threads_stuck(code)
    raise typer.Exit(code)


def _exit_now_if_threads_stuck(code: int) -> None:
    """A stage stuck in its own code cannot be interrupted; the run is reported, so end the process now."""
    stuck = [t for t in threading.enumerate() if t.name.startswith("dflash-flow:") and t.is_alive()]
    if stuck:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 1)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="Training checkpoint directory (or a checkpoints directory, or its 'latest' file: the newest checkpoint)."),
    out: Path = typer.Argument(..., help="Output directory (Hugging Face layout); new, empty or an earlier export."),
    target: Optional[str] = typer.Option(None, "--target", help="Target path for the printed serve commands (default: the run's)."),
) -> None:
    """Turn a training checkpoint into the layout vLLM and SGLang load; prints the commands that serve it."""
    from dflash_flow.app.commands import export_checkpoint

    guard_console()
    raise typer.Exit(export_checkpoint(checkpoint, out, target))


@app.command(name="eval")
def eval_(
    drafter: Path = typer.Option(..., "--drafter", help="Exported drafter directory (or a training checkpoint, a checkpoints directory or its 'latest' file)."),
    target: str = typer.Option(..., "--target", help="Target model path (or preset)."),
    prompts: Optional[Path] = typer.Option(None, "--prompts", help="JSONL of prompts ({'prompt': ...} or {'conversations': [...]}); or --suite."),
    max_new_tokens: Optional[int] = typer.Option(None, help="Tokens to generate per prompt (default 64; 2048 with --suite, z-lab's)."),
    limit: Optional[int] = typer.Option(None, help="Evaluate at most this many prompts (default 32; with --suite: every one, per suite)."),
    baseline: bool = typer.Option(True, help="Also evaluate an untrained drafter of the same shape."),
    tokenizer: Optional[str] = typer.Option(None, help="Tokenizer path (default: the target's)."),
    temperature: float = typer.Option(0.0, min=0.0, help="Also decode by speculative sampling at this temperature, beside greedy (0: greedy only)."),
    top_p: float = typer.Option(1.0, help="Nucleus mass kept when sampling, in (0, 1]."),
    top_k: int = typer.Option(0, min=0, help="Most likely tokens kept when sampling (0: all)."),
    horizon: Optional[list[int]] = typer.Option(None, "--horizon", help="Another horizon (new tokens) to measure beside --max-new-tokens; repeatable."),
    walk_data: Optional[str] = typer.Option(None, help="JSONL of held-out conversations with the target's own replies for the teacher-forced walk ('embedded': the embedded eval split)."),
    walk_limit: int = typer.Option(64, min=1, help="Conversations to walk."),
    seed: int = typer.Option(0, help="Seed of the sampled decoding and of the untrained baseline."),
    torch_threads: int = typer.Option(1, min=1, help="torch intra-op threads on CPU (batch-1 decoding of a small model is fastest on 1)."),
    batch_size: int = typer.Option(16, min=1, help="Prompts decoded together (each one's figures exactly its own one-at-a-time figures; only seconds change); 1: one at a time."),
    suite: Optional[list[str]] = typer.Option(None, "--suite", help="A standard suite as NAME=PATH (gsm8k, math500, humaneval, mbpp, mt-bench; JSONL, Parquet or a datasets directory); repeatable. See docs/eval.md."),
    out: Optional[Path] = typer.Option(None, "--out", help="With --suite: the results JSON (the per-position plot goes beside it)."),
    server: Optional[list[str]] = typer.Option(None, "--server", help="With --suite: base URL of a vLLM or SGLang server already serving this drafter; the same prompts go through it and its acceptance is checked against ours. Repeatable."),
    engine: str = typer.Option("auto", help="With --server: 'vllm', 'sglang' or 'auto' (asked of the server)."),
    served_model: Optional[str] = typer.Option(None, help="With --server: the model name to request (default: the one vLLM lists)."),
    launch_vllm: Optional[str] = typer.Option(None, help="With --suite: the python of an environment with vLLM (e.g. .venv-interop/bin/python): start a local server serving this drafter beside the target, measure through it, stop it."),
    launch_arg: Optional[list[str]] = typer.Option(None, "--launch-arg", help="With --launch-vllm: one more argument for the server (e.g. --launch-arg=--gpu-memory-utilization=0.8); repeatable."),
    api_key_env: Optional[str] = typer.Option(None, help="With --server: the environment variable holding the server's API key (sent as a Bearer token, never written)."),
    thinking: bool = typer.Option(False, "--thinking/--no-thinking", help="With --suite: the chat template's enable_thinking (z-lab: off); recorded in the results."),
    device: str = typer.Option("cpu", help="With --suite: where the target and drafter run (cpu, cuda:0)."),
    tau_tolerance: float = typer.Option(0.05, help="With an engine (--server, --launch-vllm): largest |engine tau - ours| (tokens per step) that still agrees."),
    rate_tolerance: float = typer.Option(0.03, help="With an engine: largest difference of a position's acceptance rate that still agrees."),
    mlflow: bool = typer.Option(True, "--mlflow/--no-mlflow", help="With --suite: log the results to MLflow."),
    tracking_uri: Optional[str] = typer.Option(None, help="With --suite: MLflow tracking URI (default: MLflow's, ./mlflow.db)."),
    experiment: str = typer.Option("dflash-flow-eval", help="With --suite: MLflow experiment."),
) -> None:
    """Measure real speculative decoding: acceptance length and speedup in target forward passes; with
    --suite, on the standard suites, counted as vLLM, SGLang and z-lab count it, and (--server) through a
    serving engine, checked against ours."""
    from dflash_flow.app.commands import eval_command
    from dflash_flow.app.eval_suites import EvalSuitesOptions, eval_mode_problem, eval_suites_command

    guard_console()
    problem = eval_mode_problem(prompts=prompts, suites=suite or [], out=out, given={
        "--baseline/--no-baseline": not baseline, "--temperature": temperature != 0.0, "--top-p": top_p != 1.0,
        "--top-k": top_k != 0, "--horizon": bool(horizon), "--walk-data": walk_data is not None,
        "--walk-limit": walk_limit != 64, "--seed": seed != 0, "--server": bool(server), "--engine": engine != "auto",
        "--served-model": served_model is not None, "--api-key-env": api_key_env is not None,
        "--launch-vllm": launch_vllm is not None, "--launch-arg": bool(launch_arg), "--thinking": thinking, "--device": device != "cpu",
        "--tau-tolerance": tau_tolerance != 0.05, "--rate-tolerance": rate_tolerance != 0.03,
        "--no-mlflow": not mlflow, "--tracking-uri": tracking_uri is not None,
        "--experiment": experiment != "dflash-flow-eval"})
    if problem:
        user_error(problem)
    if suite:
        _check_output_file(out, "--out")
        raise typer.Exit(eval_suites_command(EvalSuitesOptions(
            drafter=drafter, target=target, suites=tuple(suite), out=out, max_new_tokens=max_new_tokens or 2048,
            limit=limit, servers=tuple(server or ()), launch_vllm=launch_vllm, tokenizer=tokenizer,
            launch_args=tuple(launch_arg or ()), engine=engine, served_model=served_model, api_key_env=api_key_env,
            thinking=thinking, device=device, tau_tolerance=tau_tolerance, rate_tolerance=rate_tolerance, mlflow=mlflow,
            tracking_uri=tracking_uri, experiment=experiment, torch_threads=torch_threads, batch_size=batch_size)))
    raise typer.Exit(eval_command(
        drafter, target, prompts, 64 if max_new_tokens is None else max_new_tokens, 32 if limit is None else limit,
        baseline, tokenizer, temperature=temperature, top_p=top_p, top_k=top_k, horizons=horizon or [],
        walk_data=walk_data, walk_limit=walk_limit, seed=seed, torch_threads=torch_threads, batch_size=batch_size))


@app.command()
def regenerate(
    prompts: Path = typer.Argument(..., help="JSONL of prompts or conversations."),
    target: Optional[str] = typer.Option(None, "--target", help="Target model path ('embedded': the shipped one). In process: required. With --server: only read for --sampling target (its generation_config.json)."),
    out: Path = typer.Option(..., "--out", help="Output JSONL (appended to; resumable; never the input)."),
    batch_size: int = typer.Option(16, min=1, help="Replies decoded together in process (a finished one's slot takes the next at once; the replies are the same at any size)."),
    max_new_tokens: int = typer.Option(256, help="Longest reply."),
    resume: bool = typer.Option(True, help="Skip records already in --out (--no-resume: start over; an old --out that regenerate wrote is moved aside to OUT.old, any other is refused)."),
    system_prompt: Optional[str] = typer.Option(None, help="System prompt to prepend."),
    server: Optional[list[str]] = typer.Option(None, "--server", help="Base URL of an OpenAI-compatible server (vllm serve, SGLang), e.g. http://host:8000; repeatable. Regenerates through /v1/chat/completions instead of in process."),
    served_model: Optional[str] = typer.Option(None, help="Model name to request (default: the one the servers list)."),
    concurrency: int = typer.Option(32, min=1, help="Requests in flight per server."),
    sampling: str = typer.Option("greedy", help="'greedy' (temperature 0) or 'target' (the target's generation_config.json with --target, else the server's defaults). With --server."),
    thinking: Optional[bool] = typer.Option(None, "--thinking/--no-thinking", help="Reasoning on/off for chat templates that have it (chat_template_kwargs enable_thinking); default: the template's own. With --server."),
    timeout: float = typer.Option(900.0, min=0.001, help="Seconds one request may take. With --server."),
    max_attempts: int = typer.Option(5, min=1, help="Attempts per row before it is written as an error. With --server."),
    retry_errors: bool = typer.Option(False, help="Drop the rows written as errors from --out and try them again. With --server."),
    seed: int = typer.Option(0, help="Seed of sampled regeneration (each row's seed derives from it and its id). With --server."),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", help="With --server: the environment variable holding the servers' API key (sent as a Bearer token, never written); default: $OPENAI_API_KEY when set. Credentials in a --server URL are sent as Basic authentication."),
) -> None:
    """Regenerate assistant replies with the target (greedy), as the DFlash recipe does: in process, or
    through OpenAI-compatible serving engines (--server)."""
    from dflash_flow.app.commands import regenerate_command, regenerate_served_command

    guard_console()
    if server:
        raise typer.Exit(regenerate_served_command(
            prompts, server, out, target=target, max_new_tokens=max_new_tokens, resume=resume,
            system_prompt=system_prompt, served_model=served_model, concurrency=concurrency, sampling=sampling,
            thinking=thinking, timeout=timeout, max_attempts=max_attempts, retry_errors=retry_errors, seed=seed,
            api_key_env=api_key_env, in_process_only=["--batch-size"] if batch_size != 16 else []))
    given = {"--served-model": served_model is not None, "--concurrency": concurrency != 32,
             "--sampling": sampling != "greedy", "--thinking/--no-thinking": thinking is not None,
             "--timeout": timeout != 900.0, "--max-attempts": max_attempts != 5, "--retry-errors": retry_errors,
             "--seed": seed != 0, "--api-key-env": api_key_env is not None}
    raise typer.Exit(regenerate_command(prompts, target, out, batch_size, max_new_tokens, resume, system_prompt,
                                        server_only=[k for k, v in given.items() if v]))


@app.command(name="serve-target")
def serve_target(
    file: Path = typer.Argument(..., help="Pipeline YAML file (its model: section names the target and its layers)."),
    tp: int = typer.Option(1, "--tp", min=1, help="Tensor parallel size: GPUs per server."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, help="Port the server listens on."),
    host: Optional[str] = typer.Option(None, "--host", help="Address to bind (default: vLLM's, all interfaces)."),
    python: str = typer.Option("python", "--python", help="The Python that has vLLM on the server's node."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="The server's --dtype (default: model.engine.launch.dtype, else auto)."),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", min=16, help="The server's --max-model-len."),
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Print the exact vLLM server command for the pipeline's target (layer ids mapped, chunked prefill off, our
    KV connector writing features for model.engine)."""
    from dflash_flow.app.commands import serve_target_command

    v = _load(file, set_, check_devices=False, check_paths=False)
    raise typer.Exit(serve_target_command(v, tp=tp, port=port, host=host, python=python, dtype=dtype,
                                          max_model_len=max_model_len))


@app.command(name="import-spool")
def import_spool(
    spool: Path = typer.Argument(..., help="Spool file left behind when the tracking server was unreachable."),
    tracking_uri: Optional[str] = typer.Option(None, help="Where to import (default: the URI recorded in the spool)."),
) -> None:
    """Send what a run spooled while its tracking store was unreachable (metrics, params, artifacts) to MLflow."""
    from dflash_flow.app.commands import import_spool_command

    raise typer.Exit(import_spool_command(spool, tracking_uri))


@app.command()
def profile(
    file: Path = typer.Argument(..., help="Pipeline YAML file."),
    steps: int = typer.Option(20, "--steps", min=1, help="Optimizer steps to measure (after the warm-up)."),
    set_: Optional[list[str]] = SetOpt,
    warmup: int = typer.Option(1, "--warmup", min=0, help="Steps before the window opens (setup, first-step costs)."),
    interval: float = typer.Option(0.1, "--interval", min=0.01, max=60.0, help="Seconds between snapshot polls."),
    step_stage: Optional[str] = typer.Option(None, "--step-stage", help="The trainer stage (default: DrafterStep, else the sink)."),
    tracking: bool = typer.Option(False, "--tracking/--no-tracking", help="Also log the run and the profile to MLflow."),
    out: Optional[Path] = typer.Option(None, "--out", help="Where the JSON goes (default: OUTPUT_DIR/profile.json)."),
    windows: int = typer.Option(6, "--windows", min=1, max=1000, help="Equal parts of the window; their spread gives `plan` its interval (2 or more)."),
    precision: Optional[float] = typer.Option(None, "--precision", min=0.001, max=0.5, help="Measure on, a part at a time, until the rate's 90% interval is within +- this fraction (0.05: 5%)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="With --precision: the most steps to measure (default 10 x --steps)."),
) -> None:
    """Run N trainer steps and show where the time goes: per-replica load, items/s, queues, bottleneck."""
    from dflash_flow.app.profile import profile_command

    guard_console()
    v = _load(file, set_)
    if out is not None:  # checked now, not after the whole profile has run
        _check_output_file(out, "--out", make_parents=True)
    code = profile_command(file, v, steps=steps, warmup_steps=warmup, interval_s=interval, step_stage=step_stage,
                           tracking=tracking, out=out, windows=windows, precision=precision, max_steps=max_steps)
    _exit_now_if_threads_stuck(code)
    raise typer.Exit(code)


@app.command()
def plan(
    file: Path = typer.Argument(..., help="Pipeline YAML file."),
    gpus: int = typer.Option(..., "--gpus", min=2, help="GPUs to split between TargetForward replicas and drafter ranks."),
    profile_path: Optional[Path] = typer.Option(None, "--profile", help="A profile.json (default: OUTPUT_DIR/profile.json, else profile now)."),
    allreduce_s: float = typer.Option(0.0, "--allreduce-s", min=0.0, max=3600.0, help="Exposed all-reduce seconds per step at 2 ranks (bench/scale_bench.py)."),
    steps: int = typer.Option(20, "--steps", min=1, help="Steps to profile when there is no profile."),
    target_stage: Optional[str] = typer.Option(None, "--target-stage", help="The stage placed one replica per GPU (default: the TargetForward)."),
    padder_stage: Optional[str] = typer.Option(None, "--padder-stage", help="The CPU stage sized per rank (default: the Padder)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write the plan (every split, its 90% interval, the notes) as JSON here."),
    cores: Optional[int] = typer.Option(None, "--cores", min=1, help="CPU cores the ranks share (default: the profiled machine's)."),
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Predict steps/s and samples/s (with a 90% interval) for each split of N GPUs and recommend one."""
    from dflash_flow.app.splitplan import plan_command

    v = _load(file, set_, check_devices=False)
    if out is not None:
        _check_output_file(out, "--out", make_parents=True)
    raise typer.Exit(plan_command(file, v, gpus=gpus, profile_path=profile_path, allreduce_at_two=allreduce_s,
                                  steps=steps, target_stage=target_stage, padder_stage=padder_stage, out=out,
                                  cores=cores))


features_app = typer.Typer(help="The target's features on disk: build a store for a pipeline, check one (docs/features.md).",
                           no_args_is_help=True)
app.add_typer(features_app, name="features")


@features_app.command("build")
def features_build(
    file: Path = typer.Argument(..., help="Pipeline YAML file: its sources and target compute the store."),
    store: Optional[str] = typer.Option(None, "--store", help="The store's directory (default: model.features.path)."),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="auto | fp32 | bf16 | fp16 | fp8 (default: model.features.dtype)."),
    shard_mb: Optional[float] = typer.Option(None, "--shard-mb", min=0.001, help="Size of a shard file (default: model.features.shard_mb)."),
    margin_mb: Optional[float] = typer.Option(None, "--margin-mb", min=0.0, help="Space to leave free (default: model.features.free_space_margin_mb)."),
    wait: bool = typer.Option(False, "--wait", help="Wait for another build of the same store to end instead of refusing."),
    device: Optional[str] = typer.Option(None, "--device", help="Where the target runs (default: this rank's GPU, else cpu)."),
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Compute the target's features of every sample of a pipeline into a store (resumable; under torchrun each rank
    computes its share)."""
    from dflash_flow.app.features_commands import features_build_command

    guard_console()
    raise typer.Exit(features_build_command(file, set_, store=store, dtype=dtype, shard_mb=shard_mb, wait=wait,
                                            device=device, margin_mb=margin_mb))


@features_app.command("check")
def features_check(
    store: Path = typer.Argument(..., help="The store's directory."),
    pipeline: Optional[Path] = typer.Option(None, "--pipeline", help="Also compare with this pipeline: identity field by field, rows computed again."),
    recompute: int = typer.Option(8, "--recompute", min=0, help="Rows to compute again with the pipeline's target."),
    tolerance: Optional[float] = typer.Option(None, "--tolerance", min=0.0, help="Largest difference allowed, relative to a token's largest value (default: by dtype)."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Scan this many rows (random) instead of all."),
    digests: bool = typer.Option(False, "--digests", help="Also read every shard against its digest."),
    device: Optional[str] = typer.Option(None, "--device", help="Where the target runs (default: a GPU, else cpu)."),
    set_: Optional[list[str]] = SetOpt,
) -> None:
    """Check a feature store: its files, every row for zeros/NaN/inf, and (--pipeline) that it is this pipeline's."""
    from dflash_flow.app.features_commands import features_check_command

    guard_console()
    raise typer.Exit(features_check_command(store, pipeline=pipeline, overrides=set_, recompute=recompute,
                                            tolerance=tolerance, limit=limit, digests=digests, device=device))


def main() -> None:
    from dflash_flow.core.stopping import controller

    stopping = controller()
    stopping.install()  # the process's signal handlers, from its first line to its exit (core.stopping)
    try:
        app()
    except KeyboardInterrupt:  # a stop signal (Ctrl-C, SIGTERM, SIGHUP) before the command handled it
        sys.exit(130)
    finally:
        stopping.end_process()


if __name__ == "__main__":
    main()
