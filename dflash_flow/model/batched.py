"""Batched decoding for evaluation: many prompts at once, each row committing bit for bit what
``generation.spec_generate`` commits for that prompt alone: the forwards run row-exact (``ragged``), each
prompt prefills alone and samples from its own generator in the one-row order, and rows near their end (a
shorter block) form batches of their own. :class:`BatchDrafter` is the drafter's side; :func:`walk_batch`
the teacher-forced walk, batched. :func:`batchable` says whether the models allow it (a full causal
attention target, a drafter attending without a mask); else callers decode one prompt at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from .block_drafter import BlockDrafter, DraftSettings, draft_settings, features
from .decoding import full_attention, prefill, target_device, text_config
from .generation import Decoding, SpecResult, accept, as_batch_of_one, start_decoding
from .ragged import RaggedCache, RowExact, RowPlan, plan_writes, target_forward
from .sampling import Sampling, sample_from, sampling_probs

__all__ = ["BatchDrafter", "batchable", "greedy_generate_batch", "spec_generate_batch", "walk_batch"]


def batchable(target: nn.Module, drafter: nn.Module | None = None) -> bool:
    """Whether the batched loops reproduce the one-prompt ones for these models: an fp32 SDPA target of full
    causal attention layers and (when given) one of our fp32 drafters attending without a mask."""
    config = getattr(target, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not full_attention(text_config(target)) or next(target.parameters()).dtype != torch.float32:
        return False
    if drafter is None:
        return True
    from .drafter import DFlashDrafter

    if not isinstance(drafter, DFlashDrafter) or next(drafter.parameters()).dtype != torch.float32:
        return False
    return all(not layer.self_attn.is_causal and layer.self_attn.sliding_window is None for layer in drafter.layers)


class BatchDrafter:
    """``block_drafter.BlockDrafter`` for many rows: each row a draft KV cache of its own (a row of one
    ``ragged.RaggedCache``), one row-exact drafter forward for the rows of a step."""

    def __init__(self, target: nn.Module, drafter: nn.Module, settings: DraftSettings) -> None:
        self.one = BlockDrafter(target, drafter, settings)
        self.drafter = drafter
        self.settings = settings
        self.cache = RaggedCache()
        self.selects = self.one.selects

    def forward(self, rows: Sequence[int], blocks: torch.Tensor, contexts: Sequence[torch.Tensor],
                starts: Sequence[int],
                then: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> Any:
        """The drafter on ``blocks`` ``[G, v]`` (row ``g`` starting at ``starts[g]``, context ``contexts[g]``
        ``[1, c, F]``): ``then(hidden, logits)`` of slots 1.. inside the row-exact mode (default: the pair).
        Each row's cache is cropped back to its block's start, as ``BlockDrafter.hidden`` does."""
        one, device = self.one, self.one.device
        g_rows, v = blocks.shape
        cs = [int(c.shape[1]) for c in contexts]
        c_pad = max(cs)
        while c_pad in (v, v - 1):  # the context's padded length names it for the linear rule
            c_pad += 1
        ctx = contexts[0].new_zeros(g_rows, c_pad, contexts[0].shape[-1], device=device)
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


@attrs.define(eq=False)
class _Row(Decoding):
    cache_row: int = 0
    draft_row: int = 0
    calls: int = 0


def spec_generate_batch(target: nn.Module, drafter: nn.Module, prompts: Sequence[Sequence[int]], *,
                        max_new_tokens: int, block_size: int | None = None, mask_token_id: int | None = None,
                        target_layer_ids: Sequence[int] | None = None,
                        stop_token_ids: Sequence[int] | None = None, sampling: Sampling | None = None,
                        generators: Sequence[torch.Generator | None] | None = None,
                        traces: Sequence[list] | None = None, accepted_drafts: Sequence[list] | None = None,
                        batch_size: int = 64) -> list[SpecResult]:
    """``generation.spec_generate`` of every prompt (``traces[i]``, ``accepted_drafts[i]``, ``generators[i]`` as
    there), ``batch_size`` prompts together, each with the same results. Needs :func:`batchable` models."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    settings = draft_settings(drafter, block_size=block_size, mask_token_id=mask_token_id,
                              target_layer_ids=target_layer_ids)
    sampling = sampling if sampling is not None else Sampling()
    step = max(1, int(batch_size))
    out: list[SpecResult] = []
    for lo in range(0, len(prompts), step):
        part = slice(lo, lo + step)
        out.extend(_spec_chunk(
            target, drafter, prompts[part], max_new_tokens=max_new_tokens, settings=settings,
            stop_token_ids=stop_token_ids, sampling=sampling,
            generators=None if generators is None else generators[part],
            traces=None if traces is None else traces[part],
            accepted_drafts=None if accepted_drafts is None else accepted_drafts[part],
        ))
    return out


@torch.inference_mode()
def _spec_chunk(target, drafter, prompts, *, max_new_tokens, settings, stop_token_ids, sampling, generators,
                traces, accepted_drafts) -> list[SpecResult]:
    if settings.block_size < 2:
        raise ValueError("batched speculative decoding needs block_size >= 2 (a drafter that proposes)")
    device = target_device(target)
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)
    cache = RaggedCache()
    drafts = BatchDrafter(target, drafter, settings)
    rows: list[_Row] = []
    for i, prompt in enumerate(prompts):
        gen = generators[i] if generators is not None else None
        d, dyn = start_decoding(target, as_batch_of_one(list(prompt), device), max_new_tokens, settings, sampling,
                                gen, stops)
        rows.append(_Row(**attrs.asdict(d, recurse=False), cache_row=cache.add_row(), draft_row=drafts.cache.add_row()))
        cache.load_row(rows[-1].cache_row, dyn)
    while any(r.active for r in rows):
        by_verify: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if r.active:
                by_verify.setdefault(min(settings.block_size, r.max_length - r.start), []).append(i)
        for verify, members in by_verify.items():
            _spec_step(target, drafts, cache, [rows[i] for i in members], verify, sampling, settings, stops,
                       [traces[i] for i in members] if traces is not None else None,
                       [accepted_drafts[i] for i in members] if accepted_drafts is not None else None)
    return [r.result(r.calls) for r in rows]


def _propose_row(drafter, hidden, logits, block, temperature, generator):
    """``BlockDrafter.propose`` after its forward: a DFlash 2 selector's sampled walk of one row."""
    from .dflash2 import select_path

    path, candidates, probs = select_path(drafter.candidate_selector, hidden, logits, block[:, 0].to(hidden.device),
                                          temperature=temperature, generator=generator)
    if probs is None:
        return path, None
    full = torch.zeros(probs.shape[1], logits.shape[-1], dtype=torch.float32, device=probs.device)
    return path, full.scatter_(-1, candidates[0], probs[0].float())


def _spec_step(target, drafts: BatchDrafter, cache: RaggedCache, rows: list[_Row], verify: int,
               sampling: Sampling, settings: DraftSettings, stops: torch.Tensor, traces, accepted_drafts) -> None:
    """One verify step of ``rows`` (all with blocks of ``verify`` slots), as ``spec_generate``'s loop body."""
    starts = [r.start for r in rows]
    blocks = torch.stack([r.seq[r.start : r.start + verify] for r in rows]).clone()
    draft_probs: list[torch.Tensor | None] = [None] * len(rows)
    contexts = [r.pending for r in rows]
    draft_rows = [r.draft_row for r in rows]
    if sampling.greedy:
        blocks[:, 1:] = drafts.greedy_drafts(draft_rows, blocks, contexts, starts).to(blocks.device)
    else:
        hidden, logits = drafts.forward(draft_rows, blocks, contexts, starts)
        for g, r in enumerate(rows):  # each row draws from its own generator, in the one-row order
            if drafts.selects:
                proposed, probs = _propose_row(drafts.drafter, hidden[g : g + 1], logits[g : g + 1], blocks[g : g + 1],
                                               sampling.temperature, r.generator)
                blocks[g, 1:] = proposed[0].to(blocks.device)
                draft_probs[g] = probs.to(blocks.device) if probs is not None else None
            else:
                draft_probs[g] = sampling_probs(logits[g], sampling)
                blocks[g, 1:] = sample_from(draft_probs[g], r.generator)
    if traces is not None:
        for g, trace in enumerate(traces):
            trace.append((starts[g], blocks[g, 1:].tolist()))
    out = target_forward(target, cache, [r.cache_row for r in rows], blocks, starts, hidden_states=True)
    feats = features(out.hidden_states, settings.layer_ids)
    for g, r in enumerate(rows):
        r.calls += 1
        r.target_forwards += 1
        accepted, nxt = accept(out.logits[g], blocks[g, 1:], draft_probs[g], sampling, r.generator)
        if accepted_drafts is not None:
            accepted_drafts[g].append(int(accepted))
        r.commit(blocks[g, 1:], accepted, nxt, stops, feats[g : g + 1])
        cache.lengths[r.cache_row] = r.start


@torch.inference_mode()
def greedy_generate_batch(target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop_token_ids: Sequence[int] | None = None, *,
                          batch_size: int = 64) -> list[SpecResult]:
    """``generation.greedy_generate`` of every prompt, ``batch_size`` at a time: the same tokens, each
    row's numbers its own (one token per row and step through the row-exact forward)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target_device(target)
    stops = {int(t) for t in stop_token_ids or ()}
    results: list[SpecResult] = []
    step = max(1, int(batch_size))
    for lo in range(0, len(prompts), step):
        cache = RaggedCache()
        ids_list, new, done = [], [], []
        for prompt in prompts[lo : lo + step]:
            ids = as_batch_of_one(list(prompt), device)
            pre, dyn = prefill(target, ids, hidden_states=False)
            cache.load_row(cache.add_row(), dyn)
            tok = int(pre.logits[0, -1].float().argmax())
            ids_list.append(ids)
            new.append([tok])
            done.append(tok in stops or max_new_tokens == 1)
        while not all(done):
            live = [i for i, d in enumerate(done) if not d]
            toks = torch.tensor([[new[i][-1]] for i in live], dtype=torch.long, device=device)
            out = target_forward(target, cache, live, toks, [cache.lengths[i] for i in live], hidden_states=False)
            for g, i in enumerate(live):
                cache.lengths[i] += 1
                tok = int(out.logits[g, -1].float().argmax())
                new[i].append(tok)
                done[i] = tok in stops or len(new[i]) >= max_new_tokens
        results.extend(SpecResult.greedy(ids, tokens) for ids, tokens in zip(ids_list, new, strict=True))
    return results


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
    """``walk._walk_horizons`` of every prepared conversation, all drafting together: per conversation its
    ``walk.WalkResult`` fields per horizon and its drafter calls, each the one-conversation result (shorter
    horizons fork rows from the longest's at the same step)."""
    longest, *shorter = sorted({int(h) for h in horizons}, reverse=True)
    block_size = settings.block_size
    mask = settings.mask_token_id if settings.mask_token_id is not None else 0
    drafts = BatchDrafter(target, drafter, settings)
    results: list[dict[int, Any]] = [{} for _ in inputs]
    calls = [0] * len(inputs)
    rows: list[_WalkRow] = []
    for c, inp in enumerate(inputs):
        rows.append(_WalkRow(c, longest, inp.n_in, inp.feats[:, : inp.n_in], [], list(shorter), drafts.cache.add_row()))

    def fork(r: _WalkRow, h: int) -> _WalkRow:
        return _WalkRow(r.conv, h, r.start, r.pending, list(r.lengths), [], drafts.cache.fork_row(r.draft_row))

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
