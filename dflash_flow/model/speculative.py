"""Speculative decoding's evaluation: :func:`evaluate_drafter` (the decoding contract is ``model.generation``'s)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from dflash_flow.core import derive_seed

from .batched import batchable, greedy_generate_batch, spec_generate_batch
from .block_drafter import draft_settings
from .decoding import eval_mode, target_device
from .generation import SpecResult, greedy_generate, spec_generate
from .sampling import Sampling

__all__ = ["evaluate_drafter"]


def evaluate_drafter(target: nn.Module, drafter: nn.Module, prompts: Sequence[Sequence[int]], *,
                     max_new_tokens: int, block_size: int | None = None, mask_token_id: int | None = None,
                     target_layer_ids: Sequence[int] | None = None,
                     stop_token_ids: Sequence[int] | None = None, sampling: Sampling | None = None,
                     seed: int = 0, on_unit: Callable[[int], None] | None = None,
                     batch_size: int = 1) -> dict[str, float]:
    """Run speculative decoding on every prompt (greedy: beside plain greedy decoding, and compare).
    ``on_unit(tokens)`` follows each prompt (it may raise to abandon). ``batch_size`` > 1: that many prompts
    decode together where ``batched.batchable`` allows (the same figures but the wall-clock ones).

    Returns (all numbers, so the dict logs as metrics):

    * ``tau``: mean tokens committed per verify step, bonus included (the DFlash "acceptance length");
    * ``speedup_forwards``: plain-decoding target forwards / speculative ones (the bound with a free drafter);
    * ``tokens_generated``, ``num_prompts``, ``verify_steps``, ``target_forwards_spec``,
      ``drafter_forwards``, ``spec_s``;
    * greedy only: ``lossless`` (1.0 when every output equals greedy decoding's), ``mismatched_prompts``,
      ``target_forwards_greedy``, ``greedy_s``, ``speedup_wall``;
    * sampled only: ``temperature``, ``top_p``, ``top_k``; prompt ``i`` draws from its own generator seeded
      ``derive_seed(seed, 0, 0, "prompt", i)``.
    """
    if not prompts:
        raise ValueError("no prompts")
    sampling = sampling if sampling is not None else Sampling()
    decode = dict(max_new_tokens=max_new_tokens, block_size=block_size, mask_token_id=mask_token_id,
                  target_layer_ids=target_layer_ids, stop_token_ids=stop_token_ids, sampling=sampling)
    pairs: list[tuple[SpecResult | None, SpecResult]] = []
    seconds = [0.0, 0.0]  # greedy, speculative
    with eval_mode(drafter):
        batched = batch_size > 1 and len(prompts) > 1 and batchable(target, drafter) and draft_settings(
            drafter, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids
        ).block_size > 1
        step = batch_size if batched else 1
        for lo in range(0, len(prompts), step):
            refs, results, *took = (_decode_batch if batched else _decode_one)(
                target, drafter, prompts, lo, min(len(prompts), lo + step), seed=seed, **decode)
            seconds = [a + b for a, b in zip(seconds, took, strict=True)]
            for ref, res in zip(refs, results, strict=True):
                pairs.append((ref, res))
                if on_unit is not None:
                    on_unit(res.num_new_tokens)
    return _metrics(pairs, sampling, *seconds)


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


def _generator(device: torch.device, seed: int, i: int) -> torch.Generator:
    """Prompt ``i``'s generator: a prompt's sampled output does not depend on the others."""
    return torch.Generator(device=device).manual_seed(derive_seed(seed, 0, 0, "prompt", i))


def _decode_one(target, drafter, prompts, lo: int, hi: int, *, sampling: Sampling, seed: int, **decode) -> tuple:
    """Prompt ``lo`` alone (``hi`` is ``lo + 1``): ``_decode_batch``'s result, by ``spec_generate``."""
    prompt = prompts[lo]
    t0 = time.perf_counter()
    ref = greedy_generate(target, prompt, decode["max_new_tokens"], decode["stop_token_ids"]) if sampling.greedy else None
    generator = None if sampling.greedy else _generator(target_device(target), seed, lo)
    t1 = time.perf_counter()
    res = spec_generate(target, drafter, prompt, sampling=sampling, generator=generator, **decode)
    return [ref], [res], t1 - t0, time.perf_counter() - t1


def _decode_batch(target, drafter, prompts, lo: int, hi: int, *, sampling: Sampling, seed: int, **decode) -> tuple:
    """Prompts ``lo`` .. ``hi - 1`` decoded together (``model.batched``), each with the generator the
    one-prompt loop gives it: (greedy references or Nones, speculative results, greedy and speculative seconds)."""
    device = target_device(target)
    part = list(prompts[lo:hi])
    t0 = time.perf_counter()
    refs = (greedy_generate_batch(target, part, decode["max_new_tokens"], decode["stop_token_ids"]) if sampling.greedy
            else [None] * len(part))
    t1 = time.perf_counter()
    generators = None if sampling.greedy else [_generator(device, seed, i) for i in range(lo, hi)]
    results = spec_generate_batch(target, drafter, part, sampling=sampling, generators=generators,
                                  batch_size=len(part), **decode)
    return refs, results, t1 - t0, time.perf_counter() - t1
