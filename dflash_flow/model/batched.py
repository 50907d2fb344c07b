"""Batched decoding for evaluation: many prompts at once, each row computing bit for bit what it computes
alone.

Evaluation decodes a few dozen short prompts with a small model; one at a time, every step pays the
framework's per-forward cost for a handful of tokens. Here the active rows of a step go through the target
(and the drafter) in one forward, while each row's acceptance stays its own: a row commits what
``generation.spec_generate`` would commit for that prompt alone, its drafter and target KV caches hold
exactly its own tokens, and it stops on its own stop token or length.

Same numbers, not just close ones: a batched float computation may round differently from the one-row
computation, and a greedy argmax near a tie then flips. The forwards run row-exact (``ragged``: a ragged KV
cache, attention row by row, linear layers by row count; ``batch_drafter``: the drafter's side); here each
prompt prefills alone, samples from its own generator in the one-row order, and rows near their end (a
shorter block) form batches of their own. The teacher-forced walk, batched, is ``batched_walk``.

The target must be a decoder whose attention layers are all full causal attention, and the drafter one of
ours whose layers attend without a mask (DFlash's default); :func:`batchable` says so, else the callers
decode one prompt at a time.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from torch import nn

from .batch_drafter import BatchDrafter
from .block_drafter import DraftSettings, draft_settings, features
from .decoding import target_device
from .generation import SpecResult
from .ragged import RaggedCache, prefill, target_forward
from .sampling import Sampling, sample_from, sampling_probs, verify_sampled

__all__ = ["batchable", "greedy_generate_batch", "spec_generate_batch"]


# ---------------------------------------------------------------------------------------------------
# Which models batch
# ---------------------------------------------------------------------------------------------------


def batchable(target: nn.Module, drafter: nn.Module | None = None) -> bool:
    """Whether :func:`spec_generate_batch` (``drafter`` given) or :func:`greedy_generate_batch` reproduces
    the one-prompt loops for these models: a target whose layers are all full causal attention through SDPA
    (fp32), and one of our drafters whose layers attend without a mask."""
    config = getattr(target, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(t != "full_attention" for t in getattr(text, "layer_types", None) or ["full_attention"]):
        return False
    if next(target.parameters()).dtype != torch.float32:
        return False
    if drafter is None:
        return True
    from .drafter import DFlashDrafter

    if not isinstance(drafter, DFlashDrafter) or next(drafter.parameters()).dtype != torch.float32:
        return False
    return all(not layer.self_attn.is_causal and layer.self_attn.sliding_window is None for layer in drafter.layers)



# ---------------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------------


@attrs.define
class _Row:
    seq: torch.Tensor
    n_in: int
    max_length: int
    start: int
    pending: torch.Tensor | None
    cache_row: int
    draft_row: int
    generator: torch.Generator | None
    accept_lengths: list[int] = attrs.field(factory=list)
    forwards: int = 1
    calls: int = 0
    stopped: bool = False


def spec_generate_batch(
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
    generators: Sequence[torch.Generator | None] | None = None,
    traces: Sequence[list] | None = None,
    accepted_drafts: Sequence[list] | None = None,
    batch_size: int = 64,
) -> list[SpecResult]:
    """``generation.spec_generate`` of every prompt, ``batch_size`` prompts decoding together: per prompt
    the same output, acceptance lengths, forward counts, trace and accepted drafts (``traces[i]`` /
    ``accepted_drafts[i]`` as ``trace`` / ``accepted_drafts`` there), given each prompt's own generator
    (``generators[i]``; None: a fresh one seeded 0, as there). Needs :func:`batchable` models."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    out: list[SpecResult] = []
    for lo in range(0, len(prompts), max(1, int(batch_size))):
        hi = min(len(prompts), lo + max(1, int(batch_size)))
        out.extend(_spec_chunk(
            target, drafter, prompts[lo:hi], max_new_tokens=max_new_tokens,
            settings=draft_settings(drafter, block_size=block_size, mask_token_id=mask_token_id,
                                    target_layer_ids=target_layer_ids),
            stop_token_ids=stop_token_ids, sampling=sampling if sampling is not None else Sampling(),
            generators=None if generators is None else generators[lo:hi],
            traces=None if traces is None else traces[lo:hi],
            accepted_drafts=None if accepted_drafts is None else accepted_drafts[lo:hi],
        ))
    return out


@torch.inference_mode()
def _spec_chunk(target, drafter, prompts, *, max_new_tokens, settings, stop_token_ids, sampling, generators,
                traces, accepted_drafts) -> list[SpecResult]:
    block_size = settings.block_size
    if block_size < 2:
        raise ValueError("batched speculative decoding needs block_size >= 2 (a drafter that proposes)")
    device = target_device(target)
    greedy = sampling.greedy
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)
    fill = settings.mask_token_id if settings.mask_token_id is not None else 0
    cache = RaggedCache()
    drafts = BatchDrafter(target, drafter, settings)
    rows: list[_Row] = []
    for i, prompt in enumerate(prompts):
        ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        n_in = ids.shape[1]
        max_length = n_in + max_new_tokens
        gen = generators[i] if generators is not None else None
        if not greedy and gen is None:
            gen = torch.Generator(device=device).manual_seed(0)
        seq = torch.full((max_length + 1,), fill, dtype=torch.long, device=device)
        seq[:n_in] = ids[0]
        pre, dyn = prefill(target, ids, hidden_states=True)
        last = pre.logits[0, -1:]
        seq[n_in] = last.argmax(dim=-1)[0] if greedy else sample_from(sampling_probs(last, sampling), gen)[0]
        row = _Row(seq, n_in, max_length, n_in, features(pre.hidden_states, settings.layer_ids), cache.add_row(),
                   drafts.new_row(), gen)
        cache.load_row(row.cache_row, dyn)
        row.stopped = bool(stops.numel()) and bool(torch.isin(seq[n_in], stops))
        rows.append(row)

    def active(r: _Row) -> bool:
        return r.start + 1 < r.max_length and not r.stopped

    while any(active(r) for r in rows):
        by_verify: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if active(r):
                by_verify.setdefault(min(block_size, r.max_length - r.start), []).append(i)
        for verify, members in by_verify.items():
            _spec_step(target, drafts, cache, [rows[i] for i in members], verify, sampling, settings, stops,
                       [traces[i] for i in members] if traces is not None else None,
                       [accepted_drafts[i] for i in members] if accepted_drafts is not None else None)

    results = []
    for r in rows:
        output = r.seq[: min(r.start + 1, r.max_length)].clone()[None]
        results.append(SpecResult(output, r.accept_lengths, r.forwards, r.calls, r.n_in))
    return results


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
    greedy = sampling.greedy
    starts = [r.start for r in rows]
    blocks = torch.stack([r.seq[r.start : r.start + verify] for r in rows]).clone()
    draft_probs: list[torch.Tensor | None] = [None] * len(rows)
    contexts = [r.pending for r in rows]
    draft_rows = [r.draft_row for r in rows]
    if greedy:
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
    for r in rows:
        r.calls += 1
    if traces is not None:
        for g, trace in enumerate(traces):
            trace.append((starts[g], blocks[g, 1:].tolist()))
    out = target_forward(target, cache, [r.cache_row for r in rows], blocks, starts, hidden_states=True)
    feats = features(out.hidden_states, settings.layer_ids)
    for g, r in enumerate(rows):
        r.forwards += 1
        start = r.start
        if greedy:
            posterior = out.logits[g].argmax(dim=-1)
            matches = (blocks[g, 1:] == posterior[:-1]).int()
            accepted = int(matches.cumprod(0).sum())
            nxt = posterior[accepted]
        else:
            target_probs = sampling_probs(out.logits[g], sampling)
            q = draft_probs[g] if draft_probs[g] is not None else target_probs[:0]
            accepted, nxt = verify_sampled(blocks[g, 1:], q, target_probs, r.generator)
        if accepted_drafts is not None:
            accepted_drafts[g].append(int(accepted))
        r.seq[start + 1 : start + 1 + accepted] = blocks[g, 1 : 1 + accepted]
        r.seq[start + 1 + accepted] = nxt
        produced = min(accepted + 1, r.max_length - start - 1)
        if stops.numel():
            hit = torch.isin(r.seq[start + 1 : start + 1 + produced], stops).nonzero()
            if hit.numel():
                produced = int(hit[0, 0]) + 1
                r.stopped = True
        cache.lengths[r.cache_row] = start + produced
        r.pending = feats[g : g + 1, :produced]
        r.start = start + produced
        r.accept_lengths.append(produced)


# ---------------------------------------------------------------------------------------------------
# Plain greedy decoding (the lossless reference)
# ---------------------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_generate_batch(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    *,
    batch_size: int = 64,
) -> list[SpecResult]:
    """``generation.greedy_generate`` of every prompt, ``batch_size`` at a time: the same tokens, each
    row's numbers its own (one token per row and step through the row-exact forward)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target_device(target)
    stops = {int(t) for t in stop_token_ids or ()}
    results: list[SpecResult] = []
    step = max(1, int(batch_size))
    for lo in range(0, len(prompts), step):
        chunk = prompts[lo : lo + step]
        cache = RaggedCache()
        ids_list, new, done = [], [], []
        for prompt in chunk:
            ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
            if ids.shape[1] == 0:
                raise ValueError("empty prompt")
            pre, dyn = prefill(target, ids, hidden_states=False)
            row = cache.add_row()
            cache.load_row(row, dyn)
            tok = int(pre.logits[0, -1].float().argmax())
            ids_list.append(ids)
            new.append([tok])
            done.append(tok in stops or max_new_tokens == 1)
        while not all(done):
            live = [i for i, d in enumerate(done) if not d]
            toks = torch.tensor([[new[i][-1]] for i in live], dtype=torch.long, device=device)
            starts = [cache.lengths[i] for i in live]
            out = target_forward(target, cache, live, toks, starts, hidden_states=False)
            for g, i in enumerate(live):
                cache.lengths[i] += 1
                tok = int(out.logits[g, -1].float().argmax())
                new[i].append(tok)
                done[i] = tok in stops or len(new[i]) >= max_new_tokens
        for ids, tokens in zip(ids_list, new, strict=True):
            output = torch.cat([ids, torch.tensor([tokens], device=device)], dim=1)
            results.append(SpecResult(output, [1] * (len(tokens) - 1), len(tokens), 0, ids.shape[1]))
    return results
