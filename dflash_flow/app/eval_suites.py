"""``dflash-flow eval --suite NAME=PATH ...``: a drafter's acceptance on the standard suites, in process and
(``--server``) through a serving engine, checked to agree with ours. Writes ``--out`` (JSON), a PNG beside it,
a console table and an MLflow run. Exit 0; 1 when an engine disagreed with ours; 2 for bad input
(docs/eval.md)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.commands import model_path_problem
from dflash_flow.app.exits import EXIT_FAILED, EXIT_OK, report_user_error

log = logging.getLogger("dflash_flow")

__all__ = ["EvalSuitesOptions", "eval_mode_problem", "eval_suites_command", "plot_path"]


@attrs.frozen
class EvalSuitesOptions:
    """The command's settings (the CLI's options, checked by :meth:`problem` before anything loads)."""

    drafter: Path
    target: str
    suites: tuple[str, ...]
    out: Path
    max_new_tokens: int = 2048
    limit: int | None = None
    servers: tuple[str, ...] = ()
    launch_vllm: str | None = None  # the python of a vLLM environment: start a local server, stop it at the end
    launch_args: tuple[str, ...] = ()
    engine: str = "auto"
    served_model: str | None = None
    api_key_env: str | None = None
    tokenizer: str | None = None
    thinking: bool = False
    device: str = "cpu"
    tau_tolerance: float = 0.05
    rate_tolerance: float = 0.03
    request_timeout_s: float = 600.0
    mlflow: bool = True
    tracking_uri: str | None = None
    experiment: str = "dflash-flow-eval"
    torch_threads: int | None = None
    batch_size: int = 16  # prompts decoded together (model.batched); 1: one at a time

    def problem(self) -> str | None:
        """What is wrong with the settings, found before any model loads (None: nothing)."""
        for name, value in (("--max-new-tokens", self.max_new_tokens), ("--limit", self.limit),
                            ("--batch-size", self.batch_size)):
            if value is not None and int(value) < 1:
                return f"{name} must be at least 1, got {value}"
        for name, value in (("--tau-tolerance", self.tau_tolerance), ("--rate-tolerance", self.rate_tolerance)):
            if not value >= 0:
                return f"{name} must be >= 0, got {value}"
        if not self.suites:
            return "--suite: give at least one, NAME=PATH"
        if self.launch_vllm and self.servers:
            return "--launch-vllm starts its own server: not with --server"
        if self.launch_args and not self.launch_vllm:
            return "--launch-arg: only with --launch-vllm"
        if self.launch_vllm and not Path(self.launch_vllm).expanduser().is_file():
            return (f"--launch-vllm {self.launch_vllm}: no such file (the python of an environment with vLLM, "
                    "e.g. .venv-interop/bin/python)")
        if problem := model_path_problem(self.drafter, self.target, self.tokenizer):
            return problem
        if self.api_key_env and not os.environ.get(self.api_key_env):
            return f"--api-key-env: ${self.api_key_env} is not set in this environment"
        if self.out.suffix.lower() != ".json":
            return f"--out {self.out}: name a .json file (the plot goes beside it)"
        return None


#: ``eval``'s options that belong to one of its two modes (the others are shared).
PROMPTS_ONLY = ("--baseline/--no-baseline", "--temperature", "--top-p", "--top-k", "--horizon", "--walk-data",
                "--walk-limit", "--seed")
SUITES_ONLY = ("--server", "--engine", "--served-model", "--api-key-env", "--launch-vllm", "--launch-arg", "--thinking", "--device", "--tau-tolerance",
               "--rate-tolerance", "--no-mlflow", "--tracking-uri", "--experiment")


def eval_mode_problem(*, prompts: Path | None, suites: list[str], out: Path | None, given: dict[str, bool]) -> str | None:
    """What is wrong with ``eval``'s mode: exactly one of ``--prompts`` or ``--suite``, with only its own options
    (``given``: option -> whether the user set it). None when the combination is right."""
    if (prompts is None) == (not suites):
        return ("eval needs --prompts FILE (held-out prompts) or --suite NAME=PATH (the standard suites), not both"
                if prompts is not None else "eval needs --prompts FILE or --suite NAME=PATH (e.g. --suite gsm8k=test.jsonl)")
    if suites and out is None:
        return "--suite needs --out RESULTS.json"
    wrong = [k for k in (PROMPTS_ONLY if suites else (*SUITES_ONLY, "--out")) if given.get(k) or (k == "--out" and out)]
    if wrong:
        mode, other = ("--suite", "--prompts") if suites else ("--prompts", "--suite")
        return f"{', '.join(wrong)}: only with {other}, not with {mode}"
    return None


def plot_path(out: Path) -> Path:
    """``RESULTS.positions.png`` beside ``--out``."""
    return out.with_name(out.stem + ".positions.png")


def eval_suites_command(opts: EvalSuitesOptions) -> int:
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.data.reports import DataError
    from dflash_flow.data.suites import parse_suite_args, read_suite
    from dflash_flow.engine.launch import LaunchError

    from .eval_engine import EngineError, EngineServer

    problem = opts.problem()
    if problem:
        return report_user_error(problem)
    try:
        suites = parse_suite_args(opts.suites)
        prompts = {s.name: read_suite(s, p, limit=opts.limit) for s, p in suites}
    except (ValueError, DataError) as exc:
        return report_user_error(exc)
    headers = {"Authorization": f"Bearer {os.environ[opts.api_key_env]}"} if opts.api_key_env else None
    try:  # a wrong URL fails now, not after an hour of decoding
        servers = [EngineServer(u, kind=opts.engine, model=opts.served_model, timeout_s=opts.request_timeout_s,
                                headers=headers) for u in opts.servers]
    except EngineError as exc:
        return report_user_error(exc)
    if len({s.kind for s in servers}) > 1:
        return report_user_error("--server: " + ", ".join(f"{s.name} is {s.kind}" for s in servers)
                                 + "; one engine kind at a time (their counts differ)")
    try:
        loaded = _load(opts)
    except (CheckpointError, ValueError, OSError) as exc:
        return report_user_error(exc)
    local = None
    try:
        if opts.launch_vllm:  # started now: it warms up while we decode in process
            local = _launch(opts, loaded)
        results = _measure(opts, loaded, suites, prompts, servers, local)
    except (EngineError, LaunchError, ValueError, DataError) as exc:  # ValueError: ContextTooLong, CounterReset
        return report_user_error(exc)
    finally:
        if local is not None:
            local[0].stop()
    return _report(opts, results)


def _launch(opts: EvalSuitesOptions, m: _Loaded):
    """A local vLLM server serving the drafter beside the target (``engine.launch``), its log beside ``--out``."""
    from .eval_engine import free_port, launch_vllm, vllm_drafter_argv

    port = free_port()
    argv = vllm_drafter_argv(python=str(Path(opts.launch_vllm).expanduser()), target=m.facts["target"],
                             drafter=str(Path(opts.drafter).expanduser().resolve()), block_size=m.block_size, port=port,
                             dtype="float32" if opts.device == "cpu" else "auto", max_model_len=m.max_positions,
                             extra_args=opts.launch_args)
    log_path = Path(opts.out).expanduser().with_name(Path(opts.out).stem + ".vllm.log")
    servers, url = launch_vllm(argv, port=port, log_path=log_path, log=lambda line: print(line, file=sys.stderr))
    return servers, url, log_path


@attrs.frozen
class _Loaded:
    target: Any
    drafter: Any
    tokenizer: Any
    stops: list[int]
    block_size: int
    max_positions: int | None
    facts: dict


def _load(opts: EvalSuitesOptions) -> _Loaded:
    import torch
    from transformers import AutoTokenizer

    from dflash_flow.app.model_spec import resolve_target
    from dflash_flow.app.runner import quiet_libraries
    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.data.suites import thinking_switch
    from dflash_flow.model.block_drafter import draft_settings
    from dflash_flow.model.export import load_drafter
    from dflash_flow.model.target import load_target

    quiet_libraries()
    if opts.torch_threads:
        torch.set_num_threads(opts.torch_threads)
    spec = resolve_target(opts.target)
    tok_path = opts.tokenizer or (spec if isinstance(spec, str) and Path(spec).is_dir() else None)
    if tok_path is None:
        raise ValueError("--tokenizer is needed: the target is not a directory holding one")
    tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
    target = load_target(spec, device=opts.device, dtype=torch.float32)
    drafter = load_drafter(opts.drafter, device=opts.device, dtype=torch.float32, target_config=target.config)
    settings = draft_settings(drafter)
    if settings.block_size < 2:
        raise ValueError(f"--drafter {opts.drafter}: block size {settings.block_size}; a drafter drafts at least one token")
    facts = {
        "drafter": str(opts.drafter), "target": str(spec), "tokenizer": str(tok_path), "block_size": settings.block_size,
        "target_layer_ids": list(settings.layer_ids), "mask_token_id": settings.mask_token_id,
        "max_new_tokens": opts.max_new_tokens, "limit": opts.limit, "device": opts.device, "dtype": "float32",
        "decoding": "greedy (temperature 0); each request's figures its own, as at batch size 1",
        "batch_size": opts.batch_size,
        "chat_template": {"enable_thinking": opts.thinking, "template_reads_it": thinking_switch(tokenizer)},
    }
    return _Loaded(target, drafter, tokenizer, stop_token_ids(tokenizer), settings.block_size,
                   getattr(target.config, "max_position_embeddings", None), facts)


def _measure(opts: EvalSuitesOptions, m: _Loaded, suites, prompts, servers, local=None) -> dict[str, Any]:
    """Every suite decoded in process (a local server warms up meanwhile), then through the servers."""
    from dflash_flow.model.suite_eval import decode_suite, suite_figures
    from dflash_flow.observe.progress import ProgressBar

    from .eval_engine import EngineServer

    out: dict[str, Any] = {**m.facts, "stop_token_ids": m.stops, "suites": {}}
    decoded = {}
    bar = ProgressBar(sum(len(p.turns) for ps in prompts.values() for p in ps), label="eval", unit="requests",
                      stream=sys.stderr)
    t0 = time.perf_counter()
    try:
        for suite, path in suites:
            decoded[suite.name] = decode_suite(
                m.target, m.drafter, m.tokenizer, prompts[suite.name], max_new_tokens=opts.max_new_tokens,
                stop_token_ids=m.stops, enable_thinking=opts.thinking, max_positions=m.max_positions,
                on_request=lambda r: bar.update(1, tok=len(r.new_ids)), batch_size=opts.batch_size)
            out["suites"][suite.name] = {"path": str(path), "prompts": len(prompts[suite.name]),
                                         **suite_figures(decoded[suite.name], m.block_size)}
    finally:
        bar.close()
    out["seconds_in_process"] = round(time.perf_counter() - t0, 1)
    if local is not None:
        launched, url, log_path = local
        print(f"eval: waiting for the local vLLM server (log {log_path})", file=sys.stderr)
        launched.wait_ready()
        servers = [EngineServer(url, kind="vllm", model=None, timeout_s=opts.request_timeout_s)]
        out["launched"] = {"argv": list(launched.specs[0].argv[1:]), "log": str(log_path),
                           "start_s": launched.start_s}
    if servers:
        out["engine"] = {"servers": [s.name for s in servers], "kinds": sorted({s.kind for s in servers}),
                         "served_model": servers[0].model, "tau_tolerance": opts.tau_tolerance,
                         "rate_tolerance": opts.rate_tolerance}
        t0 = time.perf_counter()
        for suite, _ in suites:
            print(f"eval: {suite.name}: {len(decoded[suite.name])} requests through "
                  f"{', '.join(s.name for s in servers)}", file=sys.stderr)
            entry = out["suites"][suite.name]
            entry["engine"], entry["agreement"] = _through_engine(opts, servers, decoded[suite.name], entry, m.stops)
        out["seconds_engine"] = round(time.perf_counter() - t0, 1)
    return out


def _through_engine(opts: EvalSuitesOptions, servers, requests, ours: dict, stops: list[int]) -> tuple[dict, dict]:
    """The suite's requests through the servers, one at a time; the engine's figures and their agreement."""
    from dflash_flow.observe.engine_metrics import compare, request_summary, spec_delta

    from .eval_engine import scrape_all, wait_for_counters

    before = scrape_all(servers)
    specs, equal, got_ids = [], 0, 0
    for i, r in enumerate(requests):
        reply = servers[i % len(servers)].generate(r.prompt_ids, max_new_tokens=opts.max_new_tokens,
                                                   stop_token_ids=stops)
        if reply.spec is not None:
            specs.append(reply.spec)
        if reply.new_ids is not None:
            got_ids += 1
            equal += int(reply.new_ids == r.new_ids)
    per_request = request_summary(specs) if len(specs) == len(requests) else None
    expect = per_request["steps"] if per_request else ours["verify_steps"]
    engine: dict[str, Any] = {"lossless_vs_ours": f"{equal}/{got_ids}" if got_ids else None}
    kinds = {s.kind for s in servers}
    engine_tau, engine_rates = None, None
    if "vllm" in kinds:
        delta = spec_delta(before, wait_for_counters(servers, expect, before))
        engine["counters"] = delta.to_json()
        engine["tau_per_step"] = delta.tau_per_step
        engine["accept_rate_per_position"] = delta.accept_rate_per_position
        engine_tau, engine_rates = delta.tau_per_step, delta.accept_rate_per_position
        if per_request and per_request["steps"] != delta.drafts:
            engine["note"] = (f"the counters saw {delta.drafts:g} drafts, the replies {per_request['steps']} steps: "
                              "other requests reached the server meanwhile (its counters are not this suite's alone)")
    if per_request is not None:
        engine["per_request"] = per_request
        if engine_tau is None:  # SGLang: the per-request figures are all there is
            engine_tau, engine_rates = per_request["tau_per_step"], per_request["accept_rate_per_position"]
            engine["tau_per_step"], engine["accept_rate_per_position"] = engine_tau, engine_rates
        engine["tau_per_request"] = per_request["tau_per_request"]
        engine["tau_per_token"] = per_request["tau_per_token"]
    c = compare(ours["tau_engine_count"], ours["accept_rate_per_position"], engine_tau, engine_rates,
                tau_tolerance=opts.tau_tolerance, rate_tolerance=opts.rate_tolerance)
    agreement = c.to_json()
    if got_ids and equal != got_ids:
        agreement["ok"] = False
        agreement["problems"].append(f"the engine's outputs differ from ours on {got_ids - equal} of {got_ids} "
                                     "requests (greedy decoding of the same token ids should give the same tokens)")
    agreement["compared"] = "ours tau_engine_count and accept_rate_per_position against the engine's counts"
    return engine, agreement


def _report(opts: EvalSuitesOptions, results: dict[str, Any]) -> int:
    from dflash_flow.observe.engine_metrics import Comparison, dumps, mismatch_warning
    from dflash_flow.util import atomic_write_text

    out = Path(opts.out).expanduser()
    atomic_write_text(out, dumps(results) + "\n")
    plot = _plot(results, plot_path(out))
    print(_tables(results))
    disagree = []
    for name, s in results["suites"].items():
        a = s.get("agreement")
        if a is not None and not a["ok"]:
            disagree.append(name)
            e = s["engine"]
            c = Comparison(False, s["tau_engine_count"], e.get("tau_per_step"), tuple(s["accept_rate_per_position"]),
                           tuple(e.get("accept_rate_per_position") or ()), a["tau_tolerance"], a["rate_tolerance"],
                           tuple(a["problems"]))
            print(mismatch_warning(name, c), file=sys.stderr)
    if "engine" in results and not disagree:
        print(f"engine check: the engine's acceptance equals ours on every suite (tau within {opts.tau_tolerance:g}, "
              f"every position within {opts.rate_tolerance:g})")
    print(f"results: {out}" + (f"; plot: {plot}" if plot else ""))
    if opts.mlflow:
        _log_mlflow(opts, results, out, plot)
    return EXIT_FAILED if disagree else EXIT_OK


def _tables(results: dict[str, Any]) -> str:
    from dflash_flow.observe.console import render, table

    rows = []
    for name, s in results["suites"].items():
        e = s.get("engine") or {}
        rows.append([name, s["prompts"], s["requests"], s["tau_per_step"], s["tau_per_request"], s["tau_per_token"],
                     s["tau_engine_count"], s["speedup_forwards"], s["speedup_wall"], s["lossless"],
                     *([e.get("tau_per_step"), (s.get("agreement") or {}).get("ok")] if "engine" in results else [])])
    heads = ["suite", "prompts", "requests", "tau/step", "tau/request", "tau/token", "tau (vLLM count)",
             "forward speed-up", "wall speed-up", "lossless"]
    if "engine" in results:
        heads += ["engine tau (vLLM count)", "engine agrees"]
    parts = [table(rows, heads, title=f"acceptance at {results['max_new_tokens']} new tokens, block "
                                       f"{results['block_size']} (tokens per target step; docs/eval.md)")]
    width = results["block_size"] - 1
    pos_rows = []
    for name, s in results["suites"].items():
        pos_rows.append([name, "ours", *s["accept_rate_per_position"]])
        rates = (s.get("engine") or {}).get("accept_rate_per_position")
        if rates is not None:
            pos_rows.append([name, "engine", *rates])
    parts.append(table(pos_rows, ["suite", "counted by", *(f"pos {k + 1}" for k in range(width))],
                       title="accepted per draft position (share of verify steps)"))
    return render(*parts, width=160)


def _plot(results: dict[str, Any], path: Path) -> Path | None:
    from dflash_flow.observe.plots import plot_position_rates

    ours = {n: s["accept_rate_per_position"] for n, s in results["suites"].items()}
    engine = {n: (s.get("engine") or {}).get("accept_rate_per_position") or [] for n, s in results["suites"].items()}
    try:
        return plot_position_rates(ours, path, engine=engine,
                                   title=f"accepted per draft position by suite ({results['max_new_tokens']} new tokens)")
    except Exception as exc:  # noqa: BLE001 - a picture never costs the results
        log.warning("could not draw %s: %s", path, exc)
        return None


def _metrics(results: dict[str, Any]) -> tuple[dict[str, float], list[tuple[str, list[float]]]]:
    """Flat MLflow metrics (``suite/<name>/[engine/]<figure>``) and the per-position series."""
    flat: dict[str, float] = {}
    series: list[tuple[str, list[float]]] = []
    for name, s in results["suites"].items():
        for k in ("tau_per_step", "tau_per_request", "tau_per_token", "tau_engine_count", "speedup_forwards",
                  "speedup_wall", "verify_steps", "tokens", "requests", "prompts"):
            if isinstance(s.get(k), (int, float)):
                flat[f"suite/{name}/{k}"] = float(s[k])
        k_ok, n = (int(x) for x in s["lossless"].split("/"))
        flat[f"suite/{name}/lossless_fraction"] = k_ok / n if n else 1.0
        series.append((f"suite/{name}/accept_rate_per_position", s["accept_rate_per_position"]))
        e = s.get("engine")
        if e:
            for k in ("tau_per_step", "tau_per_request", "tau_per_token"):
                if isinstance(e.get(k), (int, float)):
                    flat[f"suite/{name}/engine/{k}"] = float(e[k])
            flat[f"suite/{name}/engine/agrees"] = float(bool(s["agreement"]["ok"]))
            if e.get("accept_rate_per_position"):
                series.append((f"suite/{name}/engine/accept_rate_per_position", e["accept_rate_per_position"]))
    return flat, series


def _log_mlflow(opts: EvalSuitesOptions, results: dict[str, Any], out: Path, plot: Path | None) -> None:
    from dflash_flow.observe.tracking import Tracker, TrackingError

    params = {k: v for k, v in results.items() if k not in ("suites", "engine") and not k.startswith("seconds")}
    params["suites"] = {n: s["path"] for n, s in results["suites"].items()}
    if "engine" in results:
        params["engine"] = results["engine"]
    try:
        tracker = Tracker.start(tracking_uri=opts.tracking_uri, experiment=opts.experiment,
                                run_name=f"eval-{Path(opts.drafter).name}", params=params,
                                tags={"dflash_flow.kind": "eval-suites"}, system_metrics=False,
                                spool_dir=out.parent / "mlflow-spool")
    except TrackingError as exc:
        log.warning("not logged to MLflow: %s", exc)
        return
    status = "FAILED"
    try:
        flat, series = _metrics(results)
        tracker.log_metrics(flat, step=0)
        for name, values in series:
            for k, v in enumerate(values, 1):
                tracker.log_metrics({name: float(v)}, step=k)
        tracker.log_artifact(out, "eval")
        if plot is not None:
            tracker.log_artifact(plot, "eval")
        status = "FINISHED"
    finally:
        tracker.end(status)
    print(f"MLflow: run {tracker.run_id} in experiment {opts.experiment!r} ({tracker.display_uri})")
