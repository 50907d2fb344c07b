"""The generation loops: speculative decoding with a DFlash drafter (greedy and sampled), plain greedy.

This follows the DFlash inference contract (z-lab ``dflash_generate``), so that what we measure here is
what a served drafter will achieve:

1. Prefill the target on the prompt with hidden states; its choice (argmax, or a sample) is the first
   new token; the draft context is the features of the prompt tokens.
2. Loop: the block is ``[last token, MASK x (B-1)]`` at absolute positions ``start .. start+B-1``. The
   drafter sees its cached context K/V (positions < start) plus the features of the tokens committed
   last step, and the block; draft slot k predicts the token at position ``start + k``. The target
   verifies the block in one forward and commits a prefix of the drafts plus one token of its own (the
   bonus). The new context is the features of the committed tokens only; both KV caches are cropped
   back to the committed length.

Greedy (``temperature == 0``): the drafts are the drafter's argmax, the accepted prefix is the longest
one equal to the target's argmax, the bonus is the target's argmax after it. The output equals plain
greedy decoding token for token.

Sampled (``temperature > 0``, optional ``top_p`` / ``top_k``; :class:`Sampling`): the standard
speculative-sampling rule (Leviathan et al. 2023; Chen et al. 2023). With ``p`` the target's and ``q``
the drafter's distribution after the same temperature / top-k / top-p transform, the drafts are sampled
from ``q``; draft ``x`` is accepted with probability ``min(1, p(x) / q(x))``, in order, until the first
rejection; at a rejection the bonus is sampled from ``norm(max(0, p - q))``, after all drafts were
accepted from ``p`` at the next position. Every emitted token is then distributed exactly as a token
sampled from ``p`` by the target alone (the output is the target's own sampling distribution; the
drafter only changes how many target forwards it takes). Every random draw comes from one seeded
``torch.Generator``, in the order z-lab's ``dflash_generate`` makes them with the global generator:
prefill sample; per step the block's drafts (one multinomial over the B-1 slots), the B-1 uniforms of
the acceptance test, then one multinomial for the bonus (residual or next position). The same seed
therefore gives z-lab's output exactly (``tests/model/test_sampling.py``).

A DFlash 2 drafter (one with a ``candidate_selector``, ours or z-lab's ``DFlash2DraftModel``) proposes
its selector's walk instead (``BlockDrafter.propose``, z-lab's ``propose``): greedy, the best-scoring
path from the block's first token; sampled, one draw per slot in order from ``softmax(scores / T)``
over that slot's candidates (temperature only, no top-p / top-k, as z-lab), and that distribution
(zero outside the candidates) is the ``q`` the acceptance rule and the residual use. The target's
``p`` keeps top-p / top-k. The draws are z-lab's in number and order, so the same seed gives its output.

Batch size 1 only, as in the reference: every sequence accepts a different number of tokens per step,
so a batch would need ragged caches. Evaluation loops over prompts.

The drafter interface is z-lab's ``DFlashDraftModel`` (ours in ``drafter.py`` has the same):
``drafter(position_ids=, noise_embedding=, target_hidden=, attention_mask=None, past_key_values=,
use_cache=True)`` returns the block's final hidden states *already passed through* ``drafter.norm``;
logits are ``drafter.compute_logits(h, lm_head)`` (``lm_head(h)`` times ``output_multiplier``, with
optional soft-capping), or plain ``lm_head(h)`` for a drafter without ``compute_logits``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .block_drafter import BlockDrafter, DraftSettings, draft_settings, features
from .decoding import cache_kwarg, crop_cache, new_cache, target_device
from .sampling import Sampling, sample_from, sampling_probs, verify_sampled

__all__ = ["SpecResult", "greedy_continuations", "greedy_generate", "spec_generate"]


@attrs.define(eq=False)
class SpecResult:
    """Result of one generation (speculative or greedy).

    ``output_ids`` is ``[1, prompt + new]`` (prompt included, as in z-lab's ``dflash_generate``).
    ``accept_lengths[i]`` is how many tokens verify step i committed, bonus included (1..B); the first new
    token comes from the prefill and is in no step. ``target_forwards`` counts the prefill too.
    """

    output_ids: Any
    accept_lengths: list[int]
    target_forwards: int
    drafter_forwards: int
    num_input_tokens: int = 0

    @property
    def new_ids(self) -> list[int]:
        return self.output_ids[0, self.num_input_tokens :].tolist()

    @property
    def num_new_tokens(self) -> int:
        return int(self.output_ids.shape[1]) - self.num_input_tokens

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def _as_batch_of_one(input_ids: Any, device: torch.device) -> torch.Tensor:
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(
            f"batch size 1 only (the DFlash inference contract); got input_ids of shape {tuple(ids.shape)}"
        )
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    return ids.to(device)


def greedy_continuations(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_ids: Sequence[int] | None = None,
    pad_id: int = 0,
) -> list[tuple[list[int], str]]:
    """Greedy continuations of token-id prompts, batched with left padding (transformers ``generate``).

    Returns, per prompt, the new ids (a stop token that ended the reply included, nothing after it) and
    ``"stop"`` or ``"length"``. With no ``stop_ids`` the reply runs to ``max_new_tokens``: ``generate``
    would otherwise stop at the model's own eos, so an id outside the vocabulary (which argmax never
    returns) stands in for "no stop token".
    """
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
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=attn.to(device),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=stops or [vocab],
            pad_token_id=pad_id,
        )
    results = []
    stop_set = set(stops)
    for row in out[:, width:].tolist():
        cut = next((i for i, t in enumerate(row) if t in stop_set), None)
        results.append((row, "length") if cut is None else (row[: cut + 1], "stop"))
    return results


def greedy_generate(
    target: nn.Module,
    input_ids: Any,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
) -> SpecResult:
    """Plain greedy decoding of one prompt: one target forward per new token (the prefill gives the
    first). The reference that speculative decoding must reproduce exactly, and the forward count the
    speedup is measured against. Stops after ``max_new_tokens`` or after emitting a stop token (kept)."""
    device = target_device(target)
    ids = _as_batch_of_one(input_ids, device)
    (tokens, _), = greedy_continuations(target, [ids[0].tolist()], max_new_tokens=max_new_tokens, stop_ids=stop_token_ids)
    output = torch.cat([ids, torch.tensor([tokens], device=device)], dim=1)
    return SpecResult(output, [1] * (len(tokens) - 1), len(tokens), 0, ids.shape[1])


@torch.inference_mode()
def spec_generate(
    target: nn.Module,
    drafter: nn.Module,
    input_ids: Any,
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
    trace: list[tuple[int, list[int]]] | None = None,
    accepted_drafts: list[int] | None = None,
) -> SpecResult:
    """Speculative decoding of one prompt with a DFlash drafter (see the module docstring).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` default to the drafter's own
    (``drafter.block_size`` / ``config.dflash_config``); pass them to override. Greedy by default: the
    output is then identical to :func:`greedy_generate` (lossless) whatever the drafter proposes. With
    ``sampling`` at a temperature > 0 every random draw comes from ``generator`` (a generator on the
    target's device; None: a fresh one seeded 0, so a call is reproducible by default). ``trace``, when
    given, gets one ``(start, drafts)`` per verify step: the position of the block's first token and the
    drafts the target verified (what an engine's drafts are compared against, step by step);
    ``accepted_drafts``, when given, gets each step's accepted drafts as a serving engine counts them
    (not cut at ``max_new_tokens`` or a stop token).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    sampling = sampling if sampling is not None else Sampling()
    settings = draft_settings(
        drafter, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids
    )
    device = target_device(target)
    if not sampling.greedy and generator is None:
        generator = torch.Generator(device=device).manual_seed(0)
    ids = _as_batch_of_one(input_ids, device)
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)
    drafts = BlockDrafter(target, drafter, settings) if settings.block_size > 1 else None
    state = _prefill(target, ids, max_new_tokens, settings, sampling, generator, stops)
    while state.start + 1 < state.max_length and not state.stopped:
        _spec_step(target, drafts, state, settings, sampling, generator, stops, trace, accepted_drafts)
    output = state.seq[:, : min(state.start + 1, state.max_length)].clone()
    return SpecResult(output, state.accept_lengths, state.target_forwards, drafts.calls if drafts else 0, state.n_in)


@attrs.define(eq=False)
class _Decoding:
    """One prompt's speculative decoding in progress. ``seq`` holds prompt + everything generated (unfilled
    slots hold the mask token, exactly what a block needs past its first slot); ``start`` is the position of
    the last committed token, which opens the next block; ``pending`` the draft context waiting to enter the
    drafter's cache (features of tokens < start not yet cached)."""

    seq: torch.Tensor
    positions: torch.Tensor
    n_in: int
    max_length: int  # the final output is at most this long
    cache: Any  # the target's KV cache
    cache_arg: str
    start: int
    pending: torch.Tensor | None
    stopped: bool
    target_forwards: int = 1
    accept_lengths: list[int] = attrs.field(factory=list)


def _prefill(target: nn.Module, ids: torch.Tensor, max_new_tokens: int, settings: DraftSettings,
             sampling: Sampling, generator: torch.Generator | None, stops: torch.Tensor) -> _Decoding:
    """The target on the prompt (with hidden states when the drafter proposes): the first new token (its
    argmax, or a sample) and the draft context, the features of the prompt tokens."""
    device = ids.device
    n_in = ids.shape[1]
    max_length = n_in + max_new_tokens
    fill = settings.mask_token_id if settings.mask_token_id is not None else 0
    seq = torch.full((1, max_length + 1), fill, dtype=torch.long, device=device)
    seq[:, :n_in] = ids
    positions = torch.arange(max_length + 1, device=device)[None]
    cache, ck = new_cache(target.config), cache_kwarg(target)
    out = target(
        input_ids=ids,
        position_ids=positions[:, :n_in],
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=settings.block_size > 1,
        **{ck: cache},
    )
    last = out.logits[0, -1:]
    seq[0, n_in] = (
        last.argmax(dim=-1)[0] if sampling.greedy else sample_from(sampling_probs(last, sampling), generator)[0]
    )
    pending = features(out.hidden_states, settings.layer_ids) if settings.block_size > 1 else None
    stopped = bool(stops.numel()) and bool(torch.isin(seq[0, n_in], stops))
    return _Decoding(seq, positions, n_in, max_length, cache, ck, n_in, pending, stopped)


def _spec_step(target: nn.Module, drafts: BlockDrafter | None, state: _Decoding, settings: DraftSettings,
               sampling: Sampling, generator: torch.Generator | None, stops: torch.Tensor,
               trace: list | None, accepted_drafts: list[int] | None) -> None:
    """One verify step: draft the block, the target verifies it in one forward, commit what it accepts."""
    start = state.start
    # Near the end the block shrinks to what is left (as z-lab does): every verified slot may still
    # become output, and the drafter sees the same block the reference would.
    verify = min(settings.block_size, state.max_length - start)
    block = state.seq[:, start : start + verify].clone()  # [last token, MASK, ...]
    draft_probs = _draft(drafts, block, state.pending, start, sampling, generator) if verify > 1 else None
    if trace is not None:
        trace.append((start, block[0, 1:].tolist()))
    out = target(
        input_ids=block,
        position_ids=state.positions[:, start : start + verify],
        use_cache=True,
        output_hidden_states=verify > 1,
        **{state.cache_arg: state.cache},
    )
    state.target_forwards += 1
    accepted, nxt = _accept(out.logits[0], block, draft_probs, sampling, generator)
    if accepted_drafts is not None:
        accepted_drafts.append(int(accepted))
    produced = _commit(state, block, accepted, nxt, stops)
    # Tokens start .. start+produced-1 now have verified K/V and features; the new last token
    # (start+produced) has neither yet: it opens the next block.
    crop_cache(state.cache, start + produced)
    if verify > 1:
        state.pending = features(out.hidden_states, settings.layer_ids)[:, :produced]
    state.start += produced
    state.accept_lengths.append(produced)


def _draft(drafts: BlockDrafter, block: torch.Tensor, pending: torch.Tensor | None, start: int,
           sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor | None:
    """The drafts into ``block``'s slots 1.. (in place); the drafter's proposal distribution when sampled."""
    device = block.device
    draft_probs = None
    if drafts.selects:  # DFlash 2: the selector's walk (and its proposal distribution)
        proposed, draft_probs = drafts.propose(
            block, pending, start, 0.0 if sampling.greedy else sampling.temperature, generator
        )
        block[:, 1:] = proposed.to(device)
        return draft_probs.to(device) if draft_probs is not None else None
    logits = drafts.logits(block, pending, start).to(device)
    # Slot 0 is the known token; slots 1.. are the proposals for positions start+1 ...
    if sampling.greedy:
        block[:, 1:] = logits.argmax(dim=-1)
    else:
        draft_probs = sampling_probs(logits[0], sampling)
        block[0, 1:] = sample_from(draft_probs, generator)
    return draft_probs


def _accept(logits: torch.Tensor, block: torch.Tensor, draft_probs: torch.Tensor | None, sampling: Sampling,
            generator: torch.Generator | None) -> tuple[int, Any]:
    """How many drafts the target accepts, and its own next token after them (the bonus)."""
    if sampling.greedy:
        posterior = logits.argmax(dim=-1)  # target's choice after each block slot
        matches = (block[0, 1:] == posterior[:-1]).int()
        accepted = int(matches.cumprod(0).sum())  # longest matching prefix of the drafts
        return accepted, posterior[accepted]
    target_probs = sampling_probs(logits, sampling)
    q = draft_probs if draft_probs is not None else target_probs[:0]
    return verify_sampled(block[0, 1:], q, target_probs, generator)


def _commit(state: _Decoding, block: torch.Tensor, accepted: int, nxt: Any, stops: torch.Tensor) -> int:
    """Commit the accepted drafts and the bonus into ``state.seq``: the tokens produced (cut at the length
    and after a stop token, which is kept)."""
    start, seq = state.start, state.seq
    seq[0, start + 1 : start + 1 + accepted] = block[0, 1 : 1 + accepted]
    seq[0, start + 1 + accepted] = nxt
    produced = min(accepted + 1, state.max_length - start - 1)
    if stops.numel():
        hit = torch.isin(seq[0, start + 1 : start + 1 + produced], stops).nonzero()
        if hit.numel():
            produced = int(hit[0, 0]) + 1  # keep the stop token, drop what follows
            state.stopped = True
    return produced
