"""Speculative decoding of a standard suite in process, counted every way users count acceptance.

One request is one user turn (mt-bench's second turn follows the target's own first reply, as z-lab does),
decoded by ``generation.spec_generate`` (greedy) and by plain greedy decoding (the lossless reference and the
wall-clock baseline). The speculative run goes ``block_size - 1`` tokens past ``max_new_tokens`` and its steps
are counted up to the output's end, so the last step verifies a whole block as a serving engine's does; per
step it records the tokens committed (cut at the end: our count) and the drafts accepted (not cut: vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from torch import nn

from dflash_flow.data.suites import SuitePrompt, template_ids

from .block_drafter import draft_settings
from .decoding import eval_mode
from .evaluation import decode_both

__all__ = ["ContextTooLong", "RequestResult", "decode_suite", "suite_figures"]


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
            stops: list[int], block: int, together: bool) -> list[RequestResult]:
    """``(prompt id, turn, prompt ids)`` each decoded both ways, one by one or ``together`` (``model.batched``)."""
    prompts = [ids for _, _, ids in requests]
    traces: list[list] = [[] for _ in prompts]
    accepted: list[list] = [[] for _ in prompts]
    refs, results, greedy_s, spec_s = decode_both(
        target, drafter, prompts, together=together, reference_tokens=max_new_tokens, stop_token_ids=stops,
        traces=traces, accepted_drafts=accepted, max_new_tokens=max_new_tokens + block - 1)
    spec_tokens = sum(r.num_new_tokens for r in results) or 1
    greedy_tokens = sum(r.num_new_tokens for r in refs) or 1
    return [_result(pid, turn, ids, ref.new_ids, res, trace, acc, max_new_tokens, stops,
                    spec_s * res.num_new_tokens / spec_tokens, greedy_s * ref.num_new_tokens / greedy_tokens)
            for (pid, turn, ids), ref, res, trace, acc in zip(requests, refs, results, traces, accepted, strict=True)]


def decode_suite(target: nn.Module, drafter: nn.Module, tokenizer: Any, prompts: Sequence[SuitePrompt], *,
                 max_new_tokens: int, stop_token_ids: Sequence[int], enable_thinking: bool = False,
                 max_positions: int | None = None,
                 on_request: Callable[[RequestResult], None] | None = None,
                 batch_size: int = 16) -> list[RequestResult]:
    """Every turn of every prompt (see the module docstring), in prompt order; a later turn follows the target's
    own earlier replies. ``on_request`` follows each request (it may raise to stop). ``batch_size`` > 1: the same
    turn of that many prompts decodes together where the models allow (each request's counts its own; a batch's
    seconds shared in proportion to tokens); else prompt by prompt."""
    from .batched import batchable

    messages: list[list[dict]] = [[] for _ in prompts]
    done: dict[tuple[int, int], RequestResult] = {}
    with eval_mode(drafter):
        block = draft_settings(drafter).block_size
        together = batch_size > 1 and len(prompts) > 1 and block > 1 and batchable(target, drafter)
        for group in [range(len(prompts))] if together else [[i] for i in range(len(prompts))]:
            for turn in range(max((len(prompts[i].turns) for i in group), default=0)):
                live = [i for i in group if turn < len(prompts[i].turns)]
                requests = []
                for i in live:
                    messages[i].append({"role": "user", "content": prompts[i].turns[turn]})
                    ids = template_ids(tokenizer, messages[i], enable_thinking=enable_thinking)
                    _check_fits(ids, max_new_tokens, block, max_positions, prompts[i].id, turn)
                    requests.append((i, ids))
                for lo in range(0, len(requests), batch_size):
                    part = requests[lo : lo + batch_size]
                    results = _decode(target, drafter, [(prompts[i].id, turn, ids) for i, ids in part],
                                      max_new_tokens=max_new_tokens, stops=list(stop_token_ids), block=block,
                                      together=together)
                    for (i, _), r in zip(part, results, strict=True):
                        done[(i, turn)] = r
                        if on_request is not None:
                            on_request(r)
                for i in live:
                    reply = tokenizer.decode(done[(i, turn)].greedy_ids, skip_special_tokens=True)
                    messages[i].append({"role": "assistant", "content": reply})
    return [done[(i, turn)] for i, p in enumerate(prompts) for turn in range(len(p.turns))]


def suite_figures(requests: Sequence[RequestResult], block_size: int) -> dict[str, Any]:
    """Our figures for one suite, named by how they count (docs/eval.md's table says whose count each is), and
    the counts: ``requests``, ``verify_steps``, ``tokens``, ``target_forwards``, ``drafter_forwards``."""
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
