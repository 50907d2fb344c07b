"""Evaluation of an exported drafter against its target, as typed ``items.EvalReport``s in report order:
``trained`` / ``untrained`` (a fresh drafter of the same shape: what training bought) real greedy decoding,
lossless-checked; ``walk``, the trained drafter's teacher-forced walk (``model.walk``) on held-out replies;
then ``trained`` / ``untrained`` speculative sampling at each temperature > 0. Figures are keyed by horizon;
the names MLflow shows are made by ``observe.names``. :func:`evaluate_drafter` measures speculative decoding
against plain greedy decoding (the decoding contract is ``model.generation``'s); ``suite_eval`` shares
:func:`decode_both`.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_flow.core import derive_seed
from dflash_flow.data.chat import parse_conversation, prompt_turns, stop_token_ids
from dflash_flow.data.suites import template_ids
from dflash_flow.items import EvalReport

from .batched import batchable, greedy_generate_batch, spec_generate_batch
from .block_drafter import draft_settings
from .decoding import eval_mode, reply_until_stop, target_device, text_config
from .dflash2 import drafter_from_config
from .generation import Sampling, SpecResult, greedy_generate, spec_generate
from .walk import WALK, HeldoutProbe, evaluate_walk

__all__ = ["WALK", "decode_both", "decoding_report", "evaluate_drafter", "evaluate_exported", "prepare_probe",
           "read_prompt_ids", "read_walk_conversations"]


def read_prompt_ids(path: str | Path, tokenizer, limit: int, *, window: int | None = None,
                    reserve: int = 0) -> list[list[int]]:
    """Prompts from JSONL (``prompt`` or ``conversations`` up to the last user turn), chat-templated. With
    ``window`` (the target's context window), a prompt that does not leave ``reserve`` positions in it (the
    tokens to generate) is skipped, and the skipped are counted in one warning."""
    out: list[list[int]] = []
    skipped = 0
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                turns = prompt_turns(record)
            except (json.JSONDecodeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: {exc}") from None
            ids = template_ids(tokenizer, turns, enable_thinking=None)
            if window is not None and len(ids) + reserve > window:
                skipped += 1
                continue
            out.append(ids)
            if len(out) >= limit:
                break
    if skipped:
        logging.getLogger(__name__).warning(
            "%s: %d prompt(s) skipped: with %d new tokens they do not fit the target's context window of %d positions "
            "(max_position_embeddings)", path, skipped, reserve, window)
    if not out:
        raise ValueError(f"{path}: no prompts" + (f" that fit the target's context window of {window} positions with "
                                                  f"{reserve} new tokens ({skipped} longer)" if skipped else ""))
    return out


def read_walk_conversations(
    path: str | Path, tokenizer, limit: int, stop_token_ids: Sequence[int]
) -> list[tuple[list[int], list[int]]]:
    """``(prompt ids, reply ids)`` of conversations whose last turn is the target's own reply: the prompt as
    real decoding renders it, the reply what the full rendering adds, up to the first stop token (dropped for
    a ``"finish_reason": "length"`` reply: the target never chose it)."""
    out: list[tuple[list[int], list[int]]] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: invalid JSON ({exc.msg})") from None
            msgs, _, reason = parse_conversation(record) if isinstance(record, dict) else (None, "", "not an object")
            if msgs is None:
                raise ValueError(f"{where}: {reason}")
            if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
                raise ValueError(f"{where}: the last turn must be the target's reply (role 'assistant') after a prompt")
            turns = [{"role": m["role"], "content": m["content"]} for m in msgs]
            prompt = template_ids(tokenizer, turns[:-1], enable_thinking=None)
            full = template_ids(tokenizer, turns, enable_thinking=None, add_generation_prompt=False)
            if full[: len(prompt)] != prompt:
                raise ValueError(f"{where}: the chat template does not render the prompt as a prefix of the "
                                 "conversation, so the reply's tokens cannot be located")
            reply, stopped = reply_until_stop(full[len(prompt) :], stop_token_ids)
            if stopped and record.get("finish_reason") == "length":
                reply = reply[:-1]
            if reply:
                out.append((prompt, reply))
            if len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no conversations with a reply")
    return out


def prepare_probe(knobs: Any, path: str | Path, *, target: Any, tokenizer_path: str | None, trust_remote_code: bool,
                  layer_ids: Sequence[int], device: str, dtype: Any) -> HeldoutProbe:
    """The held-out probe (``walk.HeldoutProbe``) over the first ``knobs.heldout_limit`` conversations of ``path``
    (the target loaded for it, under the model-load lock, and freed)."""
    from transformers import AutoTokenizer

    from dflash_flow.model import MODEL_LOAD_LOCK

    from .target import load_target

    if tokenizer_path is None:
        raise ValueError("heldout_data needs a tokenizer (set model.tokenizer)")
    with MODEL_LOAD_LOCK:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        stops = stop_token_ids(tokenizer)
        conversations = read_walk_conversations(Path(path), tokenizer, knobs.heldout_limit, stops)
        # only as deep as the deepest feature layer: the layers above and the LM head are never read
        model = load_target(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                            num_layers=max(layer_ids) + 1)
        try:
            return HeldoutProbe.prepare(model, conversations, horizon=knobs.heldout_horizon, layer_ids=layer_ids,
                                        stop_token_ids=stops, device=device, dtype=dtype)
        finally:
            del model


def decode_both(target: nn.Module, drafter: nn.Module, prompts: list, *, together: bool,
                reference_tokens: int | None, stop_token_ids: Sequence[int] | None, generators: list | None = None,
                traces: list | None = None, accepted_drafts: list | None = None, **spec: Any) -> tuple:
    """``prompts`` by plain greedy decoding up to ``reference_tokens`` (None: no reference), then by speculative
    decoding (``spec``: :func:`spec_generate`'s settings; the lists per prompt), one by one or ``together``
    (``model.batched``): (references or Nones, results, greedy seconds, speculative seconds)."""
    n = len(prompts)
    t0 = time.perf_counter()
    if reference_tokens is None:
        refs = [None] * n
    elif together:
        refs = greedy_generate_batch(target, prompts, reference_tokens, stop_token_ids, batch_size=n)
    else:
        refs = [greedy_generate(target, p, reference_tokens, stop_token_ids) for p in prompts]
    t1 = time.perf_counter()
    if together:
        results = spec_generate_batch(target, drafter, prompts, stop_token_ids=stop_token_ids, generators=generators,
                                      traces=traces, accepted_drafts=accepted_drafts, batch_size=n, **spec)
    else:
        results = [spec_generate(target, drafter, p, stop_token_ids=stop_token_ids, **spec,
                                 generator=generators[i] if generators else None, trace=traces[i] if traces else None,
                                 accepted_drafts=accepted_drafts[i] if accepted_drafts else None)
                   for i, p in enumerate(prompts)]
    return refs, results, t1 - t0, time.perf_counter() - t1


def evaluate_drafter(target: nn.Module, drafter: nn.Module, prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int, block_size: int | None = None, mask_token_id: int | None = None,
                     target_layer_ids: Sequence[int] | None = None,
                     stop_token_ids: Sequence[int] | None = None, sampling: Sampling | None = None,
                     seed: int = 0, on_unit: Callable[[int], None] | None = None,
                     batch_size: int = 1) -> dict[str, float]:
    """Run speculative decoding on every prompt (greedy: beside plain greedy decoding, and compare).
    ``on_unit(tokens)`` follows each prompt (it may raise to abandon). ``batch_size`` > 1: that many prompts
    decode together where ``batched.batchable`` allows (the same figures but the wall-clock ones). Returns
    numbers (the dict logs as metrics): ``tau`` (tokens committed per verify step, bonus included: DFlash's
    "acceptance length"), ``speedup_forwards`` (plain-decoding target forwards / speculative ones),
    ``tokens_generated``, ``num_prompts``, ``verify_steps``, ``target_forwards_spec``, ``drafter_forwards``,
    ``spec_s``; greedy: ``lossless`` (1.0 when every output equals greedy decoding's), ``mismatched_prompts``,
    ``target_forwards_greedy``, ``greedy_s``, ``speedup_wall``; sampled: ``temperature``, ``top_p``, ``top_k``,
    prompt ``i`` drawing from its own generator seeded ``derive_seed(seed, 0, 0, "prompt", i)``."""
    if not prompts:
        raise ValueError("no prompts")
    sampling = sampling if sampling is not None else Sampling()
    settings = dict(block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids)
    device = target_device(target)
    pairs: list[tuple[SpecResult | None, SpecResult]] = []
    greedy_s = spec_s = 0.0
    with eval_mode(drafter):
        batched = batch_size > 1 and len(prompts) > 1 and batchable(target, drafter) and draft_settings(
            drafter, **settings).block_size > 1
        step = batch_size if batched else 1
        for lo in range(0, len(prompts), step):
            part = list(prompts[lo : lo + step])
            generators = None if sampling.greedy else [
                torch.Generator(device=device).manual_seed(derive_seed(seed, 0, 0, "prompt", i))
                for i in range(lo, lo + len(part))]
            refs, results, g_s, s_s = decode_both(
                target, drafter, part, together=batched, reference_tokens=max_new_tokens if sampling.greedy else None,
                stop_token_ids=stop_token_ids, generators=generators, max_new_tokens=max_new_tokens,
                sampling=sampling, **settings)
            greedy_s, spec_s = greedy_s + g_s, spec_s + s_s
            for ref, res in zip(refs, results, strict=True):
                pairs.append((ref, res))
                if on_unit is not None:
                    on_unit(res.num_new_tokens)
    return _metrics(pairs, sampling, greedy_s, spec_s)


def _metrics(pairs: list[tuple[SpecResult | None, SpecResult]], sampling: Sampling, greedy_s: float,
             spec_s: float) -> dict[str, float]:
    """The figures ``evaluate_drafter`` documents, from each prompt's (greedy reference, speculative result)."""
    results = [res for _, res in pairs]
    steps = sum(len(r.accept_lengths) for r in results)
    tokens = sum(r.num_new_tokens for r in results)
    fwd_spec = sum(r.target_forwards for r in results)
    metrics = {
        "tau": sum(sum(r.accept_lengths) for r in results) / steps if steps else 1.0,
        # Plain decoding takes one target forward per new token (greedy_generate counts exactly that).
        "speedup_forwards": tokens / fwd_spec,
        "tokens_generated": float(tokens),
        "num_prompts": float(len(pairs)),
        "verify_steps": float(steps),
        "target_forwards_spec": float(fwd_spec),
        "drafter_forwards": float(sum(r.drafter_forwards for r in results)),
        "spec_s": spec_s,
    }
    if not sampling.greedy:
        return metrics | {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": float(sampling.top_k)}
    mismatched = sum(res.output_ids.tolist() != ref.output_ids.tolist() for ref, res in pairs)
    return metrics | {
        "lossless": float(mismatched == 0),
        "mismatched_prompts": float(mismatched),
        "target_forwards_greedy": float(sum(ref.target_forwards for ref, _ in pairs)),
        "greedy_s": greedy_s,
        "speedup_wall": greedy_s / spec_s if spec_s > 0 else 0.0,
    }


#: Conversations walked together per prompt decoded together (the walk has no target forward per step).
WALK_BATCH_FACTOR = 4

#: What a decoding measures at every horizon (``by_horizon``); the rest at the first horizon only.
PER_HORIZON = ("tau", "speedup_forwards", "tokens_generated")
#: ``evaluate_drafter``'s entries that are settings or facts of the run, typed fields of the report.
_FACTS = ("lossless", "num_prompts", "temperature", "top_p", "top_k")


def decoding_report(name: str, target: Any, drafter: Any, prompts: Sequence[Sequence[int]], *,
                    horizons: Sequence[int], sampling: Any = None,
                    stop_token_ids: Sequence[int] | None = None, seed: int = 0,
                    on_unit: Callable[[int], None] | None = None, batch_size: int = 1) -> EvalReport:
    """:func:`evaluate_drafter` at each horizon, as the typed report ``name``: the first horizon's
    figures in ``metrics``, every horizon's ``PER_HORIZON`` figures in ``by_horizon``; greedy ``lossless``
    only when every horizon was lossless."""
    if not horizons:
        raise ValueError("no horizons")
    sampling = sampling if sampling is not None else Sampling()
    metrics: dict[str, float] = {}
    by_horizon: dict[int, dict[str, float]] = {}
    lossless: bool | None = None
    num_prompts = 0
    for i, h in enumerate(horizons):
        m = evaluate_drafter(target, drafter, prompts, max_new_tokens=int(h), stop_token_ids=stop_token_ids,
                             sampling=sampling, seed=seed, on_unit=on_unit, batch_size=batch_size)
        if "lossless" in m:
            lossless = bool(m["lossless"]) and lossless is not False
        if i == 0:
            metrics = {k: v for k, v in m.items() if k not in _FACTS}
            num_prompts = int(m["num_prompts"])
        by_horizon[int(h)] = {k: m[k] for k in PER_HORIZON}
    greedy = sampling.greedy
    return EvalReport(name=name, metrics=metrics, by_horizon=by_horizon,
                      temperature=0.0 if greedy else float(sampling.temperature),
                      top_p=None if greedy else float(sampling.top_p), top_k=None if greedy else int(sampling.top_k),
                      lossless=lossless, num_prompts=num_prompts)


def evaluate_exported(*, target: Any, drafter_path: str | Path, prompts_path: str | Path,
                      tokenizer_path: str | None = None, limit: int = 32,
                      max_new_tokens: int | Sequence[int] = 64, baseline: bool = True,
                      temperatures: Sequence[float] = (0.0,), top_p: float = 1.0, top_k: int = 0,
                      walk_data: str | Path | None = None, walk_limit: int = 64,
                      walk_horizons: Sequence[int] | None = None, seed: int = 0, device: str = "cpu",
                      progress: Callable[[int, int, int], None] | None = None,
                      batch_size: int = 16) -> list[EvalReport]:
    """The results named in the module docstring. ``target``: a ``model.target.load_target`` spec;
    ``max_new_tokens``: one horizon or several (``tau`` at the first); ``walk_horizons`` (None: the same);
    ``temperatures`` (0 = greedy); ``walk_data``: held-out conversations ending in the target's greedy reply
    (None: no walk). Both drafters sample with the same ``seed`` (common random numbers). ``progress(done,
    total, tokens)`` runs at 0 and after each unit; it may raise to abandon. ``batch_size``: prompts decoded
    together (``WALK_BATCH_FACTOR`` times as many conversations walked together)."""
    horizons, samplings = _decodings(max_new_tokens, temperatures, top_p, top_k)
    tokenizer, model, drafter = _load_models(target, tokenizer_path, drafter_path, device)
    window = getattr(text_config(model), "max_position_embeddings", None)
    prompts = read_prompt_ids(prompts_path, tokenizer, limit, window=window if isinstance(window, int) else None,
                              reserve=max(horizons))
    stops = stop_token_ids(tokenizer)
    walk_set = read_walk_conversations(walk_data, tokenizer, walk_limit, stops) if walk_data is not None else None

    drafters = {"trained": drafter}
    if baseline:
        drafters["untrained"] = _untrained_like(drafter, seed, device)
    total = len(drafters) * len(samplings) * len(prompts) * len(horizons) + (len(walk_set) if walk_set else 0)
    done = itertools.count(1)

    def on_unit(tokens: int) -> None:  # after each unit
        if progress is not None:
            progress(next(done), total, tokens)

    if progress is not None:
        progress(0, total, 0)
    return _decode_then_walk(model, drafters, samplings, prompts, walk_set, horizons=horizons,
                             walk_horizons=list(walk_horizons or horizons), stops=stops, seed=seed, on_unit=on_unit,
                             batch_size=batch_size)


def _decode_then_walk(model, drafters: dict[str, Any], samplings: list, prompts: list, walk_set: list | None, *,
                      horizons: list[int], walk_horizons: list[int], stops: Sequence[int], seed: int, on_unit: Any,
                      batch_size: int) -> list[EvalReport]:
    """Each drafter's decodings in turn, then the walk (its report after the trained drafter's first decoding),
    the walk's first target forwards beside the first sampled decoding (:func:`_walk_inputs_beside`)."""
    walk_batch = WALK_BATCH_FACTOR * batch_size if batch_size > 1 else 1  # 1: every conversation alone, as main
    results: list[EvalReport] = []
    walk_at = None
    with ThreadPoolExecutor(1, thread_name_prefix="dflash-walk-inputs") as pool:
        first_walk, started = None, False
        for name, d in drafters.items():
            for s in samplings:
                if not started and not s.greedy:  # beside a decoding that reports no wall-clock ratio
                    first_walk, started = _walk_inputs_beside(pool, model, drafters["trained"], walk_set,
                                                              max(walk_horizons), stops, walk_batch), True
                elif s.greedy and first_walk is not None:
                    wait([first_walk])  # done before a greedy decoding times itself (the baseline drafter's)
                results.append(decoding_report(
                    name, model, d, prompts, horizons=horizons, sampling=s, stop_token_ids=stops, seed=seed,
                    on_unit=on_unit, batch_size=batch_size,
                ))
                if walk_set is not None and name == "trained" and s is samplings[0]:
                    walk_at = len(results)
        if walk_at is not None:
            results.insert(walk_at, evaluate_walk(
                model, drafters["trained"], walk_set, horizons=walk_horizons, stop_token_ids=stops, on_unit=on_unit,
                batch_size=walk_batch, prepared=first_walk.result() if first_walk is not None else (),
            ))
    return results


def _walk_inputs_beside(pool: ThreadPoolExecutor, model: Any, drafter: Any, walk_set: list | None, longest: int,
                        stops: Sequence[int], walk_batch: int) -> Future | None:
    """The batched walk's first ``walk_batch`` target forwards (``walk.walk_inputs``) on ``pool``'s thread, run
    beside a sampled decoding (a greedy one times itself: ``speedup_wall``); None when the walk is not batched."""
    from .walk import batched_walk_settings, walk_inputs  # looked up per call, not bound at import

    settings = batched_walk_settings(model, drafter, len(walk_set), walk_batch) if walk_set is not None else None
    if settings is None:
        return None
    return pool.submit(walk_inputs, model, walk_set[:walk_batch], longest=longest, layer_ids=settings.layer_ids,
                       stop_token_ids=stops)


def _decodings(max_new_tokens: int | Sequence[int], temperatures: Sequence[float], top_p: float,
               top_k: int) -> tuple[list[int], list[Any]]:
    """The horizons and the samplings (one per distinct temperature; top-p / top-k only when sampled)."""
    horizons = [int(max_new_tokens)] if isinstance(max_new_tokens, int) else [int(h) for h in max_new_tokens]
    if not horizons or min(horizons) < 1:
        raise ValueError("max_new_tokens must be >= 1 (one horizon or a non-empty list)")
    samplings = [Sampling(t, top_p if t > 0 else 1.0, top_k if t > 0 else 0) for t in dict.fromkeys(temperatures)]
    if not samplings:
        raise ValueError("no temperatures to evaluate")
    return horizons, samplings


def _load_models(spec: Any, tokenizer_path: str | None, drafter_path: str | Path, device: str) -> tuple[Any, Any, Any]:
    """The tokenizer (``tokenizer_path``, else the target's directory), the target and the exported drafter, fp32."""
    from transformers import AutoTokenizer

    from .export import load_drafter
    from .target import load_target

    tok_path = tokenizer_path or (spec if isinstance(spec, str) and Path(spec).is_dir() else None)
    if tok_path is None:
        raise ValueError("evaluation needs a tokenizer: pass tokenizer (the target is not a directory)")
    tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
    model = load_target(spec, device=device, dtype=torch.float32)
    drafter = load_drafter(drafter_path, device=device, dtype=torch.float32, target_config=model.config)
    return tokenizer, model, drafter


def _untrained_like(drafter: Any, seed: int, device: str) -> Any:
    """A fresh drafter of ``drafter``'s shape, initialised from ``seed`` (the global RNG left as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return drafter_from_config(drafter.config).to(device=device, dtype=torch.float32)
