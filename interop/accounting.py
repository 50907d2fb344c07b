"""The interop check's bookkeeping, pure and stdlib-only (``interop/check.py`` and its unit test import it).

An engine's speculative decoding of one request is known from outside by two things: the tokens it
output and the drafts it proposed, in order (one list per verify step). From those, :func:`replay`
rebuilds its verify steps as our decoding counts them (``generation.spec_generate``): step ``i``'s block
opens at ``start`` (the first at the prompt's length: the prefill's token), its accepted drafts are the
longest prefix equal to the output after ``start``, and it commits those plus the target's own token,
capped at the output's end. vLLM counts differently (:func:`engine_tau`: every draft it accepted, past
``max_tokens`` or a stop token too), so its mean acceptance runs a little above ours on the same steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Step", "compare_drafts", "compare_outputs", "engine_tau", "replay", "tau"]


@dataclass(frozen=True)
class Step:
    """One verify step: the block's first position, the drafts verified, the tokens committed (bonus
    included)."""

    start: int
    drafts: tuple[int, ...]
    committed: int


def replay(tokens: Sequence[int], n_prompt: int, drafts: Sequence[Sequence[int]]) -> list[Step]:
    """The verify steps of one request from ``tokens`` (prompt + output) and the drafts proposed for it,
    in order. Drafts proposed once the output is complete (an engine drafts again for a request that just
    finished) are no step and are dropped."""
    if not 0 < n_prompt <= len(tokens):
        raise ValueError(f"n_prompt {n_prompt} does not fit {len(tokens)} tokens")
    end = len(tokens)
    start = n_prompt
    steps: list[Step] = []
    for proposed in drafts:
        if start + 1 >= end:
            break
        accepted = 0
        while accepted < len(proposed) and start + 1 + accepted < end and proposed[accepted] == tokens[start + 1 + accepted]:
            accepted += 1
        committed = min(accepted + 1, end - 1 - start)
        steps.append(Step(start, tuple(int(t) for t in proposed), committed))
        start += committed
    return steps


def tau(steps: Sequence[Step]) -> float:
    """Tokens committed per verify step (1.0 with no steps: nothing was drafted)."""
    return sum(s.committed for s in steps) / len(steps) if steps else 1.0


def engine_tau(counters: Mapping[str, float]) -> float:
    """vLLM's mean acceptance length from its spec-decode counters: ``1 + accepted / drafts``."""
    drafts = counters.get("num_drafts", 0)
    return 1.0 + counters.get("num_accepted_tokens", 0) / drafts if drafts else 1.0


def compare_drafts(ours: Sequence[tuple[int, Sequence[int]]], theirs: Sequence[Step]) -> dict:
    """Our ``(start, drafts)`` per step against an engine's replayed steps, in order: how many of the
    engine's steps opened at the same position with the same drafts, and the first that did not."""
    equal = 0
    first = None
    for i, step in enumerate(theirs):
        mine = ours[i] if i < len(ours) else None
        if mine is not None and mine[0] == step.start and tuple(mine[1]) == step.drafts:
            equal += 1
        elif first is None:
            first = {"step": i, "start": step.start, "engine": list(step.drafts),
                     "ours": None if mine is None else {"start": mine[0], "drafts": list(mine[1])}}
    return {"steps": len(theirs), "equal": equal, "first_difference": first}


def compare_outputs(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> list[int]:
    """Indices of the prompts whose outputs differ (a different number of prompts differs everywhere)."""
    if len(a) != len(b):
        return list(range(max(len(a), len(b))))
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if list(x) != list(y)]
