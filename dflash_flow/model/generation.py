"""The generation loops, z-lab ``dflash_generate``'s inference contract (batch size 1): speculative decoding
with a DFlash drafter (greedy and sampled) and plain greedy decoding. Per step the block ``[last token, MASK x
(B-1)]`` is drafted, the target verifies it in one forward and commits a prefix of the drafts plus its bonus
token. Greedy equals plain greedy decoding; sampled follows the speculative-sampling rule (:class:`Sampling`,
:func:`verify_sampled`), every draw from one seeded generator in z-lab's order (prefill sample; per step the
drafts, the acceptance uniforms, the bonus).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .block_drafter import BlockDrafter, DraftSettings, draft_settings, features
from .decoding import cache_kwarg, crop_cache, prefill, reply_until_stop, target_device
from .dflash2 import select_proposal

__all__ = ["Sampling", "SpecResult", "greedy_continuations", "greedy_generate", "propose", "sample_from",
           "sampling_probs", "spec_generate", "verify_sampled"]


@attrs.define(eq=False)
class SpecResult:
    """Result of one generation (speculative or greedy). ``output_ids`` is ``[1, prompt + new]`` (as z-lab's
    ``dflash_generate``); ``accept_lengths[i]`` the tokens verify step i committed, bonus included (1..B; the
    first new token comes from the prefill, in no step); ``target_forwards`` counts the prefill too."""

    output_ids: Any
    accept_lengths: list[int]
    target_forwards: int
    drafter_forwards: int
    num_input_tokens: int = 0

    @classmethod
    def greedy(cls, ids: torch.Tensor, tokens: list[int]) -> SpecResult:
        """Plain greedy decoding's result: one target forward per new token, the prefill's the first."""
        output = torch.cat([ids, torch.tensor([tokens], device=ids.device)], dim=1)
        return cls(output, [1] * (len(tokens) - 1), len(tokens), 0, ids.shape[1])

    @property
    def new_ids(self) -> list[int]:
        return self.output_ids[0, self.num_input_tokens :].tolist()

    @property
    def num_new_tokens(self) -> int:
        return int(self.output_ids.shape[1]) - self.num_input_tokens

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def as_batch_of_one(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"batch size 1 only (the DFlash inference contract); got input_ids of shape {tuple(ids.shape)}")
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    return ids.to(device)


def greedy_continuations(model: nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                         stop_ids: Sequence[int] | None = None,
                         pad_id: int = 0) -> list[tuple[list[int], str]]:
    """Greedy continuations of token-id prompts, left-padded through transformers ``generate``: per prompt the
    new ids (up to a stop token, kept) and ``"stop"`` or ``"length"``. With no ``stop_ids`` an out-of-vocabulary
    id stands in (``generate`` would otherwise stop at the model's own eos)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not prompts:
        return []
    stops = sorted({int(t) for t in stop_ids or ()})
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        if not len(p):
            raise ValueError("empty prompt")
        ids[r, width - len(p) :] = torch.as_tensor(list(p), dtype=torch.long)
        attn[r, width - len(p) :] = 1
    device = target_device(model)
    vocab = int(model.get_input_embeddings().num_embeddings)
    with torch.inference_mode():
        out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=stops or [vocab], pad_token_id=pad_id)
    return [(reply, "stop" if stopped else "length")
            for reply, stopped in (reply_until_stop(row, stops) for row in out[:, width:].tolist())]


def greedy_generate(target: nn.Module, input_ids: Any, max_new_tokens: int,
                    stop_token_ids: Sequence[int] | None = None) -> SpecResult:
    """Plain greedy decoding of one prompt: the reference speculative decoding must reproduce exactly, and
    the forward count the speedup is measured against. Stops after ``max_new_tokens`` or a stop token (kept)."""
    ids = as_batch_of_one(input_ids, target_device(target))
    (tokens, _), = greedy_continuations(target, [ids[0].tolist()], max_new_tokens=max_new_tokens, stop_ids=stop_token_ids)
    return SpecResult.greedy(ids, tokens)


@torch.inference_mode()
def spec_generate(target: nn.Module, drafter: nn.Module, input_ids: Any, *, max_new_tokens: int,
                  block_size: int | None = None, mask_token_id: int | None = None,
                  target_layer_ids: Sequence[int] | None = None, stop_token_ids: Sequence[int] | None = None,
                  sampling: Sampling | None = None, generator: torch.Generator | None = None,
                  trace: list[tuple[int, list[int]]] | None = None,
                  accepted_drafts: list[int] | None = None) -> SpecResult:
    """Speculative decoding of one prompt (see the module docstring); settings default to the drafter's own.
    Greedy (the default) equals :func:`greedy_generate`; sampled draws from ``generator`` (None: seeded 0).
    ``trace`` gets ``(start, drafts)`` per verify step; ``accepted_drafts`` each step's accepted drafts as a
    serving engine counts them (not cut at ``max_new_tokens`` or a stop token).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    sampling = sampling if sampling is not None else Sampling()
    settings = draft_settings(drafter, block_size=block_size, mask_token_id=mask_token_id,
                              target_layer_ids=target_layer_ids)
    device = target_device(target)
    ids = as_batch_of_one(input_ids, device)
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)
    drafts = BlockDrafter(target, drafter, settings) if settings.block_size > 1 else None
    state, cache = start_decoding(target, ids, max_new_tokens, settings, sampling, generator, stops)
    ck = cache_kwarg(target)
    while state.active:
        start = state.start
        # Near the end the block shrinks to what is left (as z-lab's): the drafter sees the reference's block.
        verify = min(settings.block_size, state.max_length - start)
        block = state.seq[None, start : start + verify].clone()  # [last token, MASK, ...]
        draft_probs = None
        if verify > 1:  # the drafts into the block's slots 1.., and their proposal distribution when sampled
            hidden = drafts.hidden(block, state.pending, start)
            logits = drafts._logits(hidden)
            block[:, 1:], draft_probs = propose(drafts.drafter, drafts.selects, hidden, logits, block, sampling,
                                                state.generator)
        if trace is not None:
            trace.append((start, block[0, 1:].tolist()))
        out = target(input_ids=block, position_ids=torch.arange(start, start + verify, device=device)[None],
                     use_cache=True, output_hidden_states=verify > 1, **{ck: cache})
        state.target_forwards += 1
        accepted, nxt = accept(out.logits[0], block[0, 1:], draft_probs, sampling, state.generator)
        if accepted_drafts is not None:
            accepted_drafts.append(int(accepted))
        state.commit(block[0, 1:], accepted, nxt, stops,
                     features(out.hidden_states, settings.layer_ids) if verify > 1 else None)
        crop_cache(cache, state.start)  # the new last token has no verified K/V yet: it opens the next block
    return state.result(drafts.calls if drafts else 0)


@attrs.define(eq=False)
class Decoding:
    """One prompt's speculative decoding in progress. ``seq`` holds prompt + everything generated (unfilled
    slots hold the mask token, what a block needs past its first slot); ``start`` is the position of the last
    committed token, which opens the next block; ``pending`` the draft context not yet in the drafter's cache."""

    seq: torch.Tensor
    n_in: int
    max_length: int  # the final output is at most this long
    start: int
    pending: torch.Tensor | None
    stopped: bool
    generator: torch.Generator | None
    target_forwards: int = 1
    accept_lengths: list[int] = attrs.field(factory=list)

    @property
    def active(self) -> bool:
        return self.start + 1 < self.max_length and not self.stopped

    def commit(self, drafts: torch.Tensor, accepted: int, nxt: Any, stops: torch.Tensor,
               feats: torch.Tensor | None) -> None:
        """Commit the accepted drafts and the bonus, cut at the length and after a stop token (kept);
        ``feats``, the verify forward's block features, give the next draft context."""
        start, seq = self.start, self.seq
        seq[start + 1 : start + 1 + accepted] = drafts[:accepted]
        seq[start + 1 + accepted] = nxt
        produced = min(accepted + 1, self.max_length - start - 1)
        if stops.numel():
            hit = torch.isin(seq[start + 1 : start + 1 + produced], stops).nonzero()
            if hit.numel():
                produced = int(hit[0, 0]) + 1
                self.stopped = True
        if feats is not None:
            self.pending = feats[:, :produced]
        self.start += produced
        self.accept_lengths.append(produced)

    def result(self, drafter_forwards: int) -> SpecResult:
        output = self.seq[None, : min(self.start + 1, self.max_length)].clone()
        return SpecResult(output, self.accept_lengths, self.target_forwards, drafter_forwards, self.n_in)


def start_decoding(target: nn.Module, ids: torch.Tensor, max_new_tokens: int, settings: DraftSettings,
                   sampling: Sampling, generator: torch.Generator | None,
                   stops: torch.Tensor) -> tuple[Decoding, Any]:
    """The target's prefill of ``ids`` ``[1, n]``: the decoding with its first new token (argmax, or sampled from
    ``generator``; None: seeded 0) and draft context, and the prefill's KV cache."""
    n_in = ids.shape[1]
    max_length = n_in + max_new_tokens
    if not sampling.greedy and generator is None:
        generator = torch.Generator(device=ids.device).manual_seed(0)
    fill = settings.mask_token_id if settings.mask_token_id is not None else 0
    seq = torch.full((max_length + 1,), fill, dtype=torch.long, device=ids.device)
    seq[:n_in] = ids[0]
    out, cache = prefill(target, ids, hidden_states=settings.block_size > 1)
    last = out.logits[0, -1:]
    seq[n_in] = last.argmax(dim=-1)[0] if sampling.greedy else sample_from(sampling_probs(last, sampling), generator)[0]
    pending = features(out.hidden_states, settings.layer_ids) if settings.block_size > 1 else None
    stopped = bool(stops.numel()) and bool(torch.isin(seq[n_in], stops))
    return Decoding(seq, n_in, max_length, n_in, pending, stopped, generator), cache


def propose(drafter: nn.Module, selects: bool, hidden: torch.Tensor, logits: torch.Tensor, block: torch.Tensor,
            sampling: Sampling, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The drafts ``[1, v - 1]`` of one ``block`` (on its device) from the drafter's ``hidden`` and ``logits`` of
    its slots 1.., and their proposal distribution when sampled: the argmax, a draw from ``sampling_probs``, or a
    DFlash 2 drafter's selector walk (as ``BlockDrafter.propose``; zero outside the candidates)."""
    device = block.device
    if not selects:
        if sampling.greedy:
            return logits.argmax(dim=-1).to(device), None
        probs = sampling_probs(logits.to(device)[0], sampling)
        return sample_from(probs, generator)[None], probs
    path, probs = select_proposal(drafter.candidate_selector, hidden, logits, block[:, 0].to(hidden.device),
                                  temperature=0.0 if sampling.greedy else sampling.temperature, generator=generator)
    return path.to(device), None if probs is None else probs.to(device)


def accept(logits: torch.Tensor, drafts: torch.Tensor, draft_probs: torch.Tensor | None, sampling: Sampling,
           generator: torch.Generator | None) -> tuple[int, Any]:
    """How many of ``drafts`` the target accepts, given its ``logits`` after each block slot, and its own next
    token after them (the bonus)."""
    if sampling.greedy:
        posterior = logits.argmax(dim=-1)
        accepted = int((drafts == posterior[:-1]).int().cumprod(0).sum())  # the longest matching prefix
        return accepted, posterior[accepted]
    target_probs = sampling_probs(logits, sampling)
    q = draft_probs if draft_probs is not None else target_probs[:0]
    return verify_sampled(drafts, q, target_probs, generator)


def _check_sampling(inst: Sampling, _attr: Any, _value: Any) -> None:
    if not (math.isfinite(inst.temperature) and inst.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {inst.temperature}")
    if not 0 < inst.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {inst.top_p}")
    if isinstance(inst.top_k, bool) or not isinstance(inst.top_k, int) or inst.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {inst.top_k!r}")


@attrs.frozen
class Sampling:
    """How the target (and the drafter's proposals) choose tokens: ``temperature == 0`` is greedy; otherwise
    logits / ``temperature``, the ``top_k`` largest (0 = all), then the smallest set whose mass reaches
    ``top_p``, renormalised (transformers', vLLM's and z-lab's order)."""

    temperature: float = attrs.field(default=0.0, converter=float)
    top_p: float = attrs.field(default=1.0, converter=float)
    top_k: int = attrs.field(default=0, validator=_check_sampling)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution (float32, last dim the vocabulary) of ``logits`` under ``sampling``
    (temperature > 0). Ties at the k-th largest logit are all kept, as transformers' top-k does."""
    if sampling.greedy:
        raise ValueError("sampling_probs needs temperature > 0 (temperature 0 is argmax)")
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if sampling.top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        above = ranked.cumsum(dim=-1) - ranked  # mass of the tokens ranked above each one
        ranked = ranked.masked_fill(above >= sampling.top_p, 0.0)  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` (``[..., V]`` -> ``[...]``): a single ``multinomial`` call over all
    rows, so a block's drafts take the same draws from the generator as z-lab's loop."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def verify_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling's acceptance of one block: ``drafts`` ``[g]`` sampled from ``draft_probs`` ``[g, V]``;
    ``target_probs`` ``[g + 1, V]`` the target's distribution after each slot. Returns ``(accepted drafts, next
    token)``, the next drawn from ``norm(max(0, p - q))`` at the first rejected slot, else from ``p`` after the
    last draft. Draws: ``g`` uniforms (none when ``g == 0``), then one multinomial."""
    g = int(drafts.numel())
    accepted = 0
    if g:
        index = drafts.reshape(g, 1)
        p = target_probs[:g].gather(-1, index)[:, 0]
        q = draft_probs.gather(-1, index)[:, 0]
        u = torch.rand(q.shape, generator=generator, dtype=q.dtype, device=q.device)
        # u < p/q without dividing: a draft the target gives at least q's mass is always accepted.
        accepted = int((u * q < p).to(torch.int32).cumprod(0).sum())
    if accepted == g:
        nxt = sample_from(target_probs[g : g + 1], generator)
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0.0)
        # Exactly p == q leaves no residual mass; the rejection then had probability 0 (rounding): use p.
        dist = residual if bool(residual.sum() > 0) else target_probs[accepted]
        nxt = sample_from(dist[None], generator)
    return accepted, int(nxt[0])
