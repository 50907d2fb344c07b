"""Speculative decoding of a standard suite in process, counted every way users count acceptance.

One request is one user turn (mt-bench's second turn follows the target's own first reply, as z-lab does),
decoded by ``generation.spec_generate`` (greedy) and by plain greedy decoding (the lossless reference and the
wall-clock baseline). The speculative run goes ``block_size - 1`` tokens past ``max_new_tokens`` and its steps
are counted up to the output's end, so the last step verifies a whole block as a serving engine's does; per
step it records the tokens committed (cut at the end: our count) and the drafts accepted (not cut: vLLM's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
from torch import nn

from dflash_flow.data.suites import SuitePrompt, template_ids

from .block_drafter import draft_settings
from .decoding import eval_mode
from .generation import greedy_generate, spec_generate

__all__ = ["ContextTooLong", "RequestResult", "decode_request", "decode_suite", "suite_figures"]


class ContextTooLong(ValueError):
    """A prompt and the new tokens asked for do not fit the target's context."""


@attrs.define
class RequestResult:
    """One request (one user turn): ``committed[i]`` tokens step i committed, bonus included, cut at the
    output's end (1..B); ``accepted[i]`` drafts it accepted, not cut (0..B-1); ``new_ids`` the speculative output
    (its stop token included); ``greedy_ids`` plain greedy decoding's (equal when ``lossless``)."""

    prompt_id: str
    turn: int
    prompt_ids: list[int]
    new_ids: list[int]
    greedy_ids: list[int]
    committed: list[int]
    accepted: list[int]
    lossless: bool
    finish: str
    spec_s: float
    spec_tokens: int
    greedy_s: float
    drafter_forwards: int

    @property
    def steps(self) -> int:
        return len(self.committed)

    @property
    def target_forwards(self) -> int:
        """The prefill and one verify forward per step (plain decoding takes one per new token)."""
        return 1 + self.steps


def decode_request(target: nn.Module, drafter: nn.Module, prompt_ids: Sequence[int], *, max_new_tokens: int,
                   stop_token_ids: Sequence[int], prompt_id: str = "", turn: int = 0,
                   max_positions: int | None = None) -> RequestResult:
    """Decode one request both ways (see the module docstring)."""
    block = draft_settings(drafter).block_size
    _check_fits(prompt_ids, max_new_tokens, block, max_positions, prompt_id, turn)
    return _decode(target, drafter, [(prompt_id, turn, list(prompt_ids))], max_new_tokens=max_new_tokens,
                   stops=list(stop_token_ids), block=block, together=False)[0]


def _check_fits(prompt_ids, max_new_tokens: int, block: int, max_positions: int | None, prompt_id: str,
                turn: int) -> None:
    n = len(prompt_ids)
    if max_positions is not None and n + max_new_tokens + block > max_positions:
        raise ContextTooLong(
            f"prompt {prompt_id or '?'} (turn {turn + 1}): {n} prompt tokens + {max_new_tokens} new + a block of "
            f"{block} exceed the target's {max_positions} positions; pass a smaller --max-new-tokens")


def _result(prompt_id, turn, prompt_ids, greedy_ids, res, trace, accepted, max_new_tokens, stops, spec_s,
            greedy_s) -> RequestResult:
    """One request's figures from its speculative run (``trace`` / ``accepted`` its steps) and greedy ids."""
    n = len(prompt_ids)
    long_ids = res.new_ids
    new_ids = long_ids[:max_new_tokens]
    stop_set = set(stops)
    finish = "stop" if new_ids and new_ids[-1] in stop_set else "length"
    end = n + len(new_ids)  # the output's end: tokens at positions < end
    committed, kept = [], []
    for (start, _drafts), a in zip(trace, accepted, strict=True):
        if start + 1 >= end:
            break
        committed.append(min(a + 1, end - 1 - start))
        kept.append(a)
    return RequestResult(prompt_id, turn, list(prompt_ids), new_ids, list(greedy_ids), committed, kept,
                         new_ids == list(greedy_ids), finish, spec_s, len(long_ids), greedy_s, len(kept))


def _decode(target, drafter, requests: list[tuple[str, int, list[int]]], *, max_new_tokens: int,
            stops: list[int], block: int, together: bool = True) -> list[RequestResult]:
    """``(prompt id, turn, prompt ids)`` each decoded both ways, one by one or ``together`` (``model.batched``)."""
    from .batched import greedy_generate_batch, spec_generate_batch

    prompts = [ids for _, _, ids in requests]
    traces: list[list] = [[] for _ in prompts]
    accepted: list[list] = [[] for _ in prompts]
    spec = dict(max_new_tokens=max_new_tokens + block - 1, stop_token_ids=stops)
    t0 = time.perf_counter()
    refs = (greedy_generate_batch(target, prompts, max_new_tokens, stops, batch_size=len(prompts)) if together
            else [greedy_generate(target, p, max_new_tokens, stops) for p in prompts])
    t1 = time.perf_counter()
    results = (spec_generate_batch(target, drafter, prompts, traces=traces, accepted_drafts=accepted,
                                   batch_size=len(prompts), **spec) if together
               else [spec_generate(target, drafter, p, trace=tr, accepted_drafts=acc, **spec)
                     for p, tr, acc in zip(prompts, traces, accepted, strict=True)])
    t2 = time.perf_counter()
    spec_tokens = sum(r.num_new_tokens for r in results) or 1
    greedy_tokens = sum(r.num_new_tokens for r in refs) or 1
    return [_result(pid, turn, ids, ref.new_ids, res, trace, acc, max_new_tokens, stops,
                    (t2 - t1) * res.num_new_tokens / spec_tokens, (t1 - t0) * ref.num_new_tokens / greedy_tokens)
            for (pid, turn, ids), ref, res, trace, acc in zip(requests, refs, results, traces, accepted, strict=True)]


def decode_suite(target: nn.Module, drafter: nn.Module, tokenizer: Any, prompts: Sequence[SuitePrompt], *,
                 max_new_tokens: int, stop_token_ids: Sequence[int], enable_thinking: bool = False,
                 max_positions: int | None = None,
                 on_request: Callable[[RequestResult], None] | None = None,
                 batch_size: int = 16) -> list[RequestResult]:
    """Every turn of every prompt, in prompt order; a later turn follows the target's own earlier replies.
    ``on_request`` follows each request (it may raise to stop). ``batch_size`` > 1: the same turn of that many
    prompts decodes together where the models allow (each request's counts its own; a batch's seconds shared
    in proportion to tokens)."""
    from .batched import batchable

    out: list[RequestResult] = []
    with eval_mode(drafter):
        block = draft_settings(drafter).block_size
        if batch_size > 1 and len(prompts) > 1 and block > 1 and batchable(target, drafter):
            return _decode_suite_batched(target, drafter, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                         stops=list(stop_token_ids), enable_thinking=enable_thinking,
                                         max_positions=max_positions, on_request=on_request,
                                         batch_size=batch_size, block=block)
        for p in prompts:
            messages: list[dict] = []
            for turn, text in enumerate(p.turns):
                messages.append({"role": "user", "content": text})
                ids = template_ids(tokenizer, messages, enable_thinking=enable_thinking)
                r = decode_request(target, drafter, ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids,
                                   prompt_id=p.id, turn=turn, max_positions=max_positions)
                out.append(r)
                if on_request is not None:
                    on_request(r)
                messages.append({"role": "assistant", "content": tokenizer.decode(r.greedy_ids, skip_special_tokens=True)})
    return out


def _decode_suite_batched(target, drafter, tokenizer, prompts, *, max_new_tokens, stops, enable_thinking,
                          max_positions, on_request, batch_size, block) -> list[RequestResult]:
    """``decode_suite``'s requests turn by turn, each turn's requests ``batch_size`` at a time."""
    messages: list[list[dict]] = [[] for _ in prompts]
    done: dict[tuple[int, int], RequestResult] = {}
    for turn in range(max((len(p.turns) for p in prompts), default=0)):
        live = [i for i, p in enumerate(prompts) if turn < len(p.turns)]
        requests = []
        for i in live:
            messages[i].append({"role": "user", "content": prompts[i].turns[turn]})
            ids = template_ids(tokenizer, messages[i], enable_thinking=enable_thinking)
            _check_fits(ids, max_new_tokens, block, max_positions, prompts[i].id, turn)
            requests.append((i, ids))
        for lo in range(0, len(requests), batch_size):
            part = requests[lo : lo + batch_size]
            results = _decode(target, drafter, [(prompts[i].id, turn, ids) for i, ids in part],
                                    max_new_tokens=max_new_tokens, stops=stops, block=block)
            for (i, _), r in zip(part, results, strict=True):
                done[(i, turn)] = r
                if on_request is not None:
                    on_request(r)
        for i in live:
            reply = tokenizer.decode(done[(i, turn)].greedy_ids, skip_special_tokens=True)
            messages[i].append({"role": "assistant", "content": reply})
    return [done[(i, turn)] for i, p in enumerate(prompts) for turn in range(len(p.turns))]


def suite_figures(requests: Sequence[RequestResult], block_size: int) -> dict[str, Any]:
    """Our figures for one suite, named by how they count:

    * ``tau_per_step``: committed tokens per verify step (the ``eval`` command's); ``tau_per_request``: the mean
      of each request's (z-lab's); ``tau_per_token``: new tokens per step (SpecForge's / SGLang's);
      ``tau_engine_count``: ``1 + accepted drafts / steps`` (vLLM's counters);
    * ``accept_rate_per_position``: per draft position k (1..B-1), the share of steps that accepted it
      (vLLM's ``num_accepted_tokens_per_pos / num_drafts``);
    * ``histogram``: steps by tokens committed, index 0..B (z-lab's layout; index 0 is always 0);
      ``histogram_accepted_drafts``: steps by drafts accepted, index 0..B-1 (vLLM's and SGLang's layout);
    * ``lossless`` ``"k/n"`` outputs equal to greedy decoding's; ``speedup_forwards``: new tokens / target
      forwards; ``speedup_wall``: speculative over plain tokens/s;
    * counts: ``requests``, ``verify_steps``, ``tokens``, ``target_forwards``, ``drafter_forwards``.
    """
    steps = sum(r.steps for r in requests)
    tokens = sum(len(r.new_ids) for r in requests)
    hist = [0] * (block_size + 1)
    hist_acc = [0] * block_size
    per_pos = [0] * (block_size - 1)
    for r in requests:
        for c, a in zip(r.committed, r.accepted, strict=True):
            hist[c] += 1
            hist_acc[min(a, block_size - 1)] += 1
            for k in range(min(a, block_size - 1)):
                per_pos[k] += 1
    with_steps = [r for r in requests if r.steps]
    spec_s = sum(r.spec_s for r in requests)
    greedy_s = sum(r.greedy_s for r in requests)
    spec_rate = sum(r.spec_tokens for r in requests) / spec_s if spec_s > 0 else None
    greedy_rate = tokens / greedy_s if greedy_s > 0 else None
    return {
        "requests": len(requests),
        "tau_per_step": sum(sum(r.committed) for r in requests) / steps if steps else 1.0,
        "tau_per_request": (sum(sum(r.committed) / r.steps for r in with_steps) / len(with_steps)
                            if with_steps else 1.0),
        "tau_per_token": tokens / steps if steps else None,
        "tau_engine_count": 1.0 + sum(sum(r.accepted) for r in requests) / steps if steps else 1.0,
        "accept_rate_per_position": [x / steps if steps else 0.0 for x in per_pos],
        "histogram": hist,
        "histogram_accepted_drafts": hist_acc,
        "lossless": f"{sum(r.lossless for r in requests)}/{len(requests)}",
        "speedup_forwards": tokens / sum(r.target_forwards for r in requests) if requests else None,
        "speedup_wall": spec_rate / greedy_rate if spec_rate and greedy_rate else None,
        "verify_steps": steps,
        "tokens": tokens,
        "target_forwards": sum(r.target_forwards for r in requests),
        "drafter_forwards": sum(r.drafter_forwards for r in requests),
        "finish": {k: sum(r.finish == k for r in requests) for k in ("stop", "length")},
        "spec_s": spec_s,
        "greedy_s": greedy_s,
    }
