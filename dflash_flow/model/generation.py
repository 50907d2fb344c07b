"""The generation loops, z-lab ``dflash_generate``'s inference contract (batch size 1): speculative decoding
with a DFlash drafter (greedy and sampled) and plain greedy decoding.

Prefill the target: its choice is the first new token, the prompt's features the draft context. Then loop:
the block ``[last token, MASK x (B-1)]`` at ``start .. start+B-1`` is drafted (slot k predicts ``start + k``)
on the drafter's cached context plus the last step's features; the target verifies it in one forward and
commits a prefix of the drafts plus its own bonus token; both KV caches are cropped to the committed length.

Greedy: the longest prefix equal to the target's argmax is accepted, so the output is plain greedy decoding's.
Sampled: the speculative-sampling rule (``sampling.verify_sampled``), every draw from one seeded generator in
z-lab's order (prefill sample; per step the drafts, the acceptance uniforms, the bonus): the same seed gives
z-lab's output. A DFlash 2 drafter proposes its selector's walk (``BlockDrafter.propose``); sampled, its
per-slot distribution (temperature only) is the rule's ``q``, while the target's ``p`` keeps top-p / top-k.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .block_drafter import BlockDrafter, DraftSettings, draft_settings, features
from .decoding import cache_kwarg, crop_cache, prefill, reply_until_stop, target_device
from .sampling import Sampling, sample_from, sampling_probs, verify_sampled

__all__ = ["SpecResult", "greedy_continuations", "greedy_generate", "spec_generate"]


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
        draft_probs = _draft(drafts, block, state.pending, start, sampling, state.generator) if verify > 1 else None
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


def _draft(drafts: BlockDrafter, block: torch.Tensor, pending: torch.Tensor | None, start: int,
           sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor | None:
    """The drafts into ``block``'s slots 1.. (in place); the drafter's proposal distribution when sampled
    (greedy, or a DFlash 2 selector's walk: ``BlockDrafter.propose``)."""
    device = block.device
    if drafts.selects or sampling.greedy:
        proposed, draft_probs = drafts.propose(
            block, pending, start, 0.0 if sampling.greedy else sampling.temperature, generator
        )
        block[:, 1:] = proposed.to(device)
        return draft_probs.to(device) if draft_probs is not None else None
    draft_probs = sampling_probs(drafts.logits(block, pending, start).to(device)[0], sampling)
    block[0, 1:] = sample_from(draft_probs, generator)
    return draft_probs


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
