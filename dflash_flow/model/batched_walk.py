"""The teacher-forced walk, batched: ``walk._walk_horizons`` of many conversations, their drafter calls
in one row-exact forward per step (``batch_drafter.BatchDrafter``), each conversation's result its own."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .batch_drafter import BatchDrafter
from .block_drafter import DraftSettings

__all__ = ["walk_batch"]


@attrs.define
class _WalkRow:
    """One walk (a conversation at one horizon) of :func:`walk_batch`: ``walk._walk``'s state."""

    conv: int
    horizon: int
    start: int
    pending: torch.Tensor
    lengths: list[int]
    forks: list[int]
    draft_row: int
    calls: int = 0


@torch.inference_mode()
def walk_batch(target: nn.Module, drafter: nn.Module, inputs: Sequence[Any], horizons: Sequence[int],
               settings: DraftSettings) -> list[tuple[dict[int, Any], int]]:
    """``walk._walk_horizons`` of every prepared conversation (``walk.WalkInput``), the walks of all of them
    drafting together: per conversation its results per horizon (``walk.WalkResult``'s fields: accept
    lengths, tokens, complete) and the drafter calls they took, each the one-conversation result (the forks
    of the shorter horizons are rows forked from the longest one's, at the same step the one-conversation
    walk forks them)."""
    longest, *shorter = sorted({int(h) for h in horizons}, reverse=True)
    block_size = settings.block_size
    mask = settings.mask_token_id if settings.mask_token_id is not None else 0
    drafts = BatchDrafter(target, drafter, settings)
    results: list[dict[int, Any]] = [{} for _ in inputs]
    calls = [0] * len(inputs)
    rows: list[_WalkRow] = []
    for c, inp in enumerate(inputs):
        rows.append(_WalkRow(c, longest, inp.n_in, inp.feats[:, : inp.n_in], [], list(shorter), drafts.new_row()))

    def fork(r: _WalkRow, h: int) -> _WalkRow:
        return _WalkRow(r.conv, h, r.start, r.pending, list(r.lengths), [], drafts.fork(r.draft_row))

    def settle(r: _WalkRow, work: list[_WalkRow]) -> int | None:
        """Advance ``r`` to its next drafter call (its block's size) or its end (None), as ``_walk``'s loop."""
        inp = inputs[r.conv]
        max_length = inp.n_in + r.horizon
        end = inp.n_in + inp.reply_len - 1
        while True:
            start = r.start
            for h in [h for h in r.forks if start + block_size + 1 > inp.n_in + h]:
                r.forks.remove(h)
                work.append(fork(r, h))
            if not (start + 1 < max_length and start < end):
                for h in r.forks:  # the loop ended before their turn
                    work.append(fork(r, h))
                r.forks = []
                complete = start + 1 >= max_length or (start == end and inp.stopped)
                results[r.conv][r.horizon] = (r.lengths, min(start + 1, max_length) - inp.n_in, complete)
                calls[r.conv] += r.calls
                return None
            verify = min(block_size, max_length - start)
            if verify > 1:
                return verify
            advance(r, 0)

    def advance(r: _WalkRow, accepted: int) -> None:
        inp = inputs[r.conv]
        start = r.start
        produced = min(accepted + 1, inp.n_in + r.horizon - start - 1, inp.n_in + inp.reply_len - 1 - start)
        r.pending = inp.feats[:, start : start + produced]
        r.start = start + produced
        r.lengths.append(produced)

    live = list(rows)
    while live:
        waiting: dict[int, list[_WalkRow]] = {}
        work = list(live)
        while work:
            r = work.pop(0)
            verify = settle(r, work)
            if verify is not None:
                waiting.setdefault(verify, []).append(r)
        live = [r for group in waiting.values() for r in group]
        for verify, group in waiting.items():
            blocks = torch.full((len(group), verify), mask, dtype=torch.long)
            for g, r in enumerate(group):
                blocks[g, 0] = inputs[r.conv].seq[r.start]
            proposed = drafts.greedy_drafts([r.draft_row for r in group], blocks,
                                            [r.pending for r in group], [r.start for r in group])
            for g, r in enumerate(group):
                inp = inputs[r.conv]
                seq = inp.seq
                end = inp.n_in + inp.reply_len - 1
                ref = seq[r.start + 1 : min(r.start + verify, end + 1)]
                d = proposed[g].to(seq.device)
                r.calls += 1
                advance(r, int((d[: ref.numel()] == ref).int().cumprod(0).sum()))
    return [(results[c], calls[c]) for c in range(len(inputs))]
