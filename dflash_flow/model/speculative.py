"""Speculative decoding's evaluation (evaluate_drafter), and the names of sampling, block_drafter, generation.

The decoding contract (greedy, sampled, DFlash 2, batch size 1) is ``model.generation``'s docstring.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn

from dflash_flow.core.seeding import derive_seed

from .batched import batchable, greedy_generate_batch, spec_generate_batch
from .block_drafter import BlockDrafter, DraftSettings, draft_settings, features
from .decoding import target_device
from .generation import SpecResult, greedy_continuations, greedy_generate, spec_generate
from .sampling import Sampling, sample_from, sampling_probs, verify_sampled

# The decoding names keep this module as their documented home; each is defined in the module named above.
__all__ = [
    "BlockDrafter",
    "DraftSettings",
    "Sampling",
    "SpecResult",
    "draft_settings",
    "features",
    "evaluate_drafter",
    "greedy_continuations",
    "greedy_generate",
    "sample_from",
    "sampling_probs",
    "spec_generate",
    "verify_sampled",
]


def evaluate_drafter(
    target: nn.Module,
    drafter: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    sampling: Sampling | None = None,
    seed: int = 0,
    on_unit: Callable[[int], None] | None = None,
    batch_size: int = 1,
) -> dict[str, float]:
    """Run speculative decoding on every prompt (greedy: beside plain greedy decoding, and compare).
    ``on_unit(tokens)`` is called after each prompt (progress; it may raise to abandon the evaluation).

    ``batch_size`` > 1: up to that many prompts decode together (``model.batched``: each prompt's output,
    acceptance lengths and forward counts are exactly its one-prompt ones), when the models allow it
    (``batched.batchable``; else one at a time). Every figure but the wall-clock ones is then the same;
    ``greedy_s`` / ``spec_s`` time the batched runs (``speedup_wall`` compares the two batched runs), and
    ``on_unit`` is called for each prompt of a batch once the batch is done.

    Returns (all numbers, so the dict logs as metrics):

    * ``tau``: mean tokens committed per verify step, bonus included, over all steps of all prompts
      (the DFlash "acceptance length"; 1.0 = the drafter never helps, B = every draft accepted);
    * ``speedup_forwards``: plain-decoding target forwards (one per new token, the prefill's included)
      / speculative target forwards; the upper bound on wall-clock speedup when the drafter is free;
    * ``tokens_generated``, ``num_prompts``, ``verify_steps``, ``target_forwards_spec``,
      ``drafter_forwards``, ``spec_s``;
    * greedy only: ``lossless`` (1.0 when every speculative output equals the greedy output token for
      token), ``mismatched_prompts``, ``target_forwards_greedy``, ``greedy_s``, ``speedup_wall``
      (wall-clock times are informative only on CPU);
    * sampled only: ``temperature``, ``top_p``, ``top_k``. Prompt ``i`` draws from a generator seeded
      with ``derive_seed(seed, 0, 0, "prompt", i)``: a prompt's output does not depend on the others.
    """
    if not prompts:
        raise ValueError("no prompts")
    sampling = sampling if sampling is not None else Sampling()
    decode = dict(max_new_tokens=max_new_tokens, block_size=block_size, mask_token_id=mask_token_id,
                  target_layer_ids=target_layer_ids, stop_token_ids=stop_token_ids, sampling=sampling)
    was_training = drafter.training
    drafter.eval()
    tally = _Tally()
    try:
        batches = batch_size > 1 and len(prompts) > 1 and batchable(target, drafter)
        if batches and draft_settings(drafter, block_size=block_size, mask_token_id=mask_token_id,
                                      target_layer_ids=target_layer_ids).block_size > 1:
            for lo in range(0, len(prompts), batch_size):
                part = _decode_batch(target, drafter, prompts, lo, min(len(prompts), lo + batch_size), seed=seed,
                                     **decode)
                tally.greedy_s += part["greedy_s"]
                tally.spec_s += part["spec_s"]
                for ref, res in part["pairs"]:
                    tally.add(ref, res, on_unit)
        else:
            for i, prompt in enumerate(prompts):
                ref, res, greedy_s, spec_s = _decode_one(target, drafter, prompt, i, seed=seed, **decode)
                tally.greedy_s += greedy_s
                tally.spec_s += spec_s
                tally.add(ref, res, on_unit)
    finally:
        drafter.train(was_training)
    return tally.metrics(sampling, len(prompts))


@attrs.define
class _Tally:
    """``evaluate_drafter``'s running sums over the prompts decoded so far."""

    steps: int = 0
    committed: int = 0
    fwd_greedy: int = 0
    fwd_spec: int = 0
    fwd_draft: int = 0
    tokens: int = 0
    mismatched: int = 0
    greedy_s: float = 0.0
    spec_s: float = 0.0

    def add(self, ref: SpecResult | None, res: SpecResult, on_unit: Callable[[int], None] | None) -> None:
        """One prompt's speculative result (and its greedy reference, greedy only)."""
        self.steps += len(res.accept_lengths)
        self.committed += sum(res.accept_lengths)
        self.fwd_spec += res.target_forwards
        self.fwd_draft += res.drafter_forwards
        self.tokens += res.num_new_tokens
        if ref is not None:
            self.fwd_greedy += ref.target_forwards
            self.mismatched += int(res.output_ids.tolist() != ref.output_ids.tolist())
        if on_unit is not None:
            on_unit(res.num_new_tokens)

    def metrics(self, sampling: Sampling, num_prompts: int) -> dict[str, float]:
        """The figures ``evaluate_drafter`` documents."""
        metrics = {
            "tau": self.committed / self.steps if self.steps else 1.0,
            # Plain decoding takes one target forward per new token (greedy_generate counts exactly that).
            "speedup_forwards": self.tokens / self.fwd_spec,
            "tokens_generated": float(self.tokens),
            "num_prompts": float(num_prompts),
            "verify_steps": float(self.steps),
            "target_forwards_spec": float(self.fwd_spec),
            "drafter_forwards": float(self.fwd_draft),
            "spec_s": self.spec_s,
        }
        if sampling.greedy:
            metrics.update(
                {
                    "lossless": float(self.mismatched == 0),
                    "mismatched_prompts": float(self.mismatched),
                    "target_forwards_greedy": float(self.fwd_greedy),
                    "greedy_s": self.greedy_s,
                    "speedup_wall": self.greedy_s / self.spec_s if self.spec_s > 0 else 0.0,
                }
            )
        else:
            metrics.update(
                {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": float(sampling.top_k)}
            )
        return metrics


def _decode_one(target, drafter, prompt, i: int, *, max_new_tokens, block_size, mask_token_id, target_layer_ids,
                stop_token_ids, sampling: Sampling, seed: int) -> tuple[SpecResult | None, SpecResult, float, float]:
    """Prompt ``i`` alone: (greedy reference or None, speculative result, greedy seconds, speculative seconds);
    sampled, with a generator seeded by ``seed`` and ``i``."""
    ref = None
    t0 = time.perf_counter()
    if sampling.greedy:
        ref = greedy_generate(target, prompt, max_new_tokens, stop_token_ids)
    generator = None
    if not sampling.greedy:
        generator = torch.Generator(device=target_device(target)).manual_seed(derive_seed(seed, 0, 0, "prompt", i))
    t1 = time.perf_counter()
    res = spec_generate(
        target,
        drafter,
        prompt,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=target_layer_ids,
        stop_token_ids=stop_token_ids,
        sampling=sampling,
        generator=generator,
    )
    t2 = time.perf_counter()
    return ref, res, t1 - t0, t2 - t1


def _decode_batch(target, drafter, prompts, lo: int, hi: int, *, max_new_tokens, block_size, mask_token_id,
                  target_layer_ids, stop_token_ids, sampling: Sampling, seed: int) -> dict:
    """Prompts ``lo`` .. ``hi - 1`` decoded together (``model.batched``), each with the generator the
    one-prompt loop gives it: ``pairs`` (greedy reference or None, speculative result) and the seconds."""
    device = target_device(target)
    part = list(prompts[lo:hi])
    t0 = time.perf_counter()
    refs = greedy_generate_batch(target, part, max_new_tokens, stop_token_ids) if sampling.greedy else [None] * len(part)
    t1 = time.perf_counter()
    generators = None
    if not sampling.greedy:
        generators = [torch.Generator(device=device).manual_seed(derive_seed(seed, 0, 0, "prompt", i))
                      for i in range(lo, hi)]
    results = spec_generate_batch(target, drafter, part, max_new_tokens=max_new_tokens, block_size=block_size,
                                  mask_token_id=mask_token_id, target_layer_ids=target_layer_ids,
                                  stop_token_ids=stop_token_ids, sampling=sampling, generators=generators,
                                  batch_size=len(part))
    t2 = time.perf_counter()
    return {"pairs": list(zip(refs, results, strict=True)), "greedy_s": t1 - t0, "spec_s": t2 - t1}
