"""The drafter's side of batched decoding: ``block_drafter.BlockDrafter`` for many rows, each row's draft
KV cache a row of one ``ragged.RaggedCache``, one row-exact drafter forward per step."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from .block_drafter import BlockDrafter, DraftSettings
from .ragged import RaggedCache, RowExact, RowPlan, plan_writes

__all__ = ["BatchDrafter"]


class BatchDrafter:
    """``block_drafter.BlockDrafter`` for many rows: each row a draft KV cache of its own (a row of one
    ``ragged.RaggedCache``), one drafter forward for the rows of a step."""

    def __init__(self, target: nn.Module, drafter: nn.Module, settings: DraftSettings) -> None:
        self.one = BlockDrafter(target, drafter, settings)
        self.drafter = drafter
        self.settings = settings
        self.cache = RaggedCache()
        self.calls = 0  # row-calls: one per row per step, as BlockDrafter counts one per call

    @property
    def selects(self) -> bool:
        return self.one.selects

    def new_row(self) -> int:
        return self.cache.add_row()

    def fork(self, row: int) -> int:
        return self.cache.fork_row(row)

    def forward(
        self,
        rows: Sequence[int],
        blocks: torch.Tensor,
        contexts: Sequence[torch.Tensor],
        starts: Sequence[int],
        then: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> Any:
        """The drafter on ``blocks`` ``[G, v]`` (row ``g``'s first token at position ``starts[g]``) with
        each row's pending context ``contexts[g]`` ``[1, c, F]``: ``then(hidden, logits)`` of the slots
        1.. (``[G, v - 1, H]`` and ``[G, v - 1, V]``), run inside the row-exact mode (a selector's walk
        batches exactly there); without ``then``, ``(hidden, logits)``. Each row's cache is cropped back to
        its block's start, as ``BlockDrafter.hidden`` does."""
        one, device = self.one, self.one.device
        g_rows, v = blocks.shape
        cs = [int(c.shape[1]) for c in contexts]
        c_pad = max(cs)
        while c_pad in (v, v - 1):  # the context's padded length names it for the linear rule
            c_pad += 1
        width = contexts[0].shape[-1]
        ctx = contexts[0].new_zeros(g_rows, c_pad, width, device=device)
        positions = torch.empty(g_rows, c_pad + v, dtype=torch.long, device=device)
        for g, (c, s) in enumerate(zip(contexts, starts, strict=True)):
            ctx[g, : cs[g]] = c[0].to(device)
            positions[g, : cs[g]] = torch.arange(s - cs[g], s, device=device)
            positions[g, cs[g] : c_pad] = s
            positions[g, c_pad:] = torch.arange(s, s + v, device=device)
        noise = F.embedding(blocks.to(device), one.embed_weight)
        if self.settings.embed_scale != 1.0:
            noise = noise * self.settings.embed_scale
        base = [self.cache.lengths[r] for r in rows]
        plan = RowPlan(
            rows=list(rows), q_lens=[v] * g_rows, kv_lens=[b + c + v for b, c in zip(base, cs, strict=True)],
            causal=False, axes={c_pad: cs, v: [v] * g_rows, v - 1: [v - 1] * g_rows}, base=base,
            segments=[[(0, c), (c_pad, c_pad + v)] for c in cs],
        )
        plan.writes = plan_writes(plan.rows, plan.base, plan.segments, device)
        with RowExact(plan, self.cache):
            hidden = self.drafter(position_ids=positions, noise_embedding=noise, target_hidden=ctx,
                                  attention_mask=None, past_key_values=self.cache, use_cache=True)
            if not isinstance(hidden, torch.Tensor):
                hidden = hidden[0]
            hidden = hidden[:, 1:v]
            logits = one._logits(hidden)
            result = then(hidden, logits) if then is not None else (hidden, logits)
        for r, s in zip(rows, starts, strict=True):
            self.cache.lengths[r] = s
        self.calls += g_rows
        return result

    def greedy_drafts(self, rows, blocks, contexts, starts) -> torch.Tensor:
        """Each row's greedy drafts ``[G, v - 1]``: the argmax, or a DFlash 2 selector's walk (batched:
        its ops are per row)."""
        if not self.selects:
            return self.forward(rows, blocks, contexts, starts, lambda h, lg: lg.argmax(dim=-1))
        from .dflash2 import select_path

        def walk(hidden, logits):
            return select_path(self.drafter.candidate_selector, hidden, logits, blocks[:, 0].to(hidden.device))[0]

        return self.forward(rows, blocks, contexts, starts, walk)
