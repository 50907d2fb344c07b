"""Speculative decoding with a DFlash drafter (greedy and sampled), the plain baselines, and evaluation.

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

import inspect
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from dflash_flow.core.seeding import derive_seed

__all__ = [
    "BlockDrafter",
    "DraftSettings",
    "Sampling",
    "SpecResult",
    "draft_settings",
    "features",
    "evaluate_drafter",
    "greedy_continuations",
    "greedy_generate",
    "sample_from",
    "sampling_probs",
    "spec_generate",
    "verify_sampled",
]


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


# ---------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------


def _check_sampling(inst: Sampling, _attr: Any, _value: Any) -> None:
    if not (math.isfinite(inst.temperature) and inst.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {inst.temperature}")
    if not 0 < inst.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {inst.top_p}")
    if isinstance(inst.top_k, bool) or not isinstance(inst.top_k, int) or inst.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {inst.top_k!r}")


@attrs.frozen
class Sampling:
    """How the target (and, for its proposals, the drafter) chooses tokens.

    ``temperature == 0`` is greedy (argmax; ``top_p`` and ``top_k`` are then unused). Otherwise logits
    are divided by ``temperature``, only the ``top_k`` largest are kept (0 = all), then only the
    smallest set of most likely tokens whose mass reaches ``top_p``, renormalised: the order of
    transformers' and vLLM's samplers and of z-lab's ``dflash_generate``.
    """

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


def verify_sampled(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """The speculative-sampling acceptance rule for one block (see the module docstring).

    ``drafts`` ``[g]`` were sampled from ``draft_probs`` ``[g, V]``; ``target_probs`` ``[g + 1, V]`` is the
    target's distribution after each block slot. Returns ``(accepted drafts, next token)``: the next
    token is sampled from ``norm(max(0, p - q))`` at the first rejected slot, or from ``p`` after the
    last draft when all were accepted. Draws: ``g`` uniforms (none when ``g == 0``), then one multinomial.
    """
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


# ---------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------


def _cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x calls the KV cache argument `cache`; older 5.x `past_key_values` (deprecated,
    with a warning, in the newer ones). Ask the signature instead of pinning a version."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def _new_cache(config: Any):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    # Sliding-window / linear-attention layers can only be cropped back if they keep their past;
    # plain full-attention layers ignore this.
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def _crop(cache: Any, length: int) -> None:
    """Drop everything past `length` tokens. A negative argument ("remove this many") is the form both
    older and newer transformers accept."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def _draft_setting(drafter: nn.Module, name: str, default: Any = None) -> Any:
    """A DFlash setting from the drafter: attribute, then config.dflash_config, then config."""
    value = getattr(drafter, name, None)
    if value is not None:
        return value
    config = getattr(drafter, "config", None)
    dflash_config = getattr(config, "dflash_config", None) or {}
    if name in dflash_config:
        return dflash_config[name]
    return getattr(config, name, default) if config is not None else default


def features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The drafter's context features from HF ``hidden_states``: the feature of target layer ``id`` is
    ``hidden_states[id + 1]`` (entry 0 is the embeddings), concatenated along the hidden dimension."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


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


def _model_device(model: nn.Module, fallback: torch.device) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else fallback


def _target_device(target: nn.Module) -> torch.device:
    return next(target.parameters()).device


@attrs.frozen
class DraftSettings:
    """The DFlash settings a decoding loop needs (see :func:`draft_settings`)."""

    block_size: int
    mask_token_id: int | None
    layer_ids: list[int]
    embed_scale: float = 1.0


def draft_settings(
    drafter: nn.Module,
    *,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
) -> DraftSettings:
    """Block size, mask token and target layers: the arguments where given, else the drafter's own
    (``drafter.block_size`` / ``config.dflash_config``). Raises ValueError when something is missing."""
    size = int(block_size if block_size is not None else _draft_setting(drafter, "block_size", 16))
    if size < 1:
        raise ValueError("block_size must be >= 1")
    mask = mask_token_id if mask_token_id is not None else _draft_setting(drafter, "mask_token_id")
    ids = target_layer_ids if target_layer_ids is not None else _draft_setting(drafter, "target_layer_ids")
    layer_ids = [int(i) for i in (ids or ())]
    if size > 1 and (mask is None or not layer_ids):
        raise ValueError(
            "mask_token_id and target_layer_ids are needed (pass them or set them in the drafter config)"
        )
    scale = float(_draft_setting(drafter, "input_embedding_scale", 1.0) or 1.0)
    return DraftSettings(size, None if mask is None else int(mask), layer_ids, scale)


class BlockDrafter:
    """The drafter's side of one decoding: its KV cache of context features, the embedding of each
    block, and the logits of the block's draft slots.

    Real decoding (:func:`spec_generate`) and the teacher-forced walk (``model.walk``) both drive the
    drafter through this, so they feed it identically: context features enter the cache once, the
    cache is cropped back to the block's start after every call.
    """

    def __init__(self, target: nn.Module, drafter: nn.Module, settings: DraftSettings) -> None:
        self.drafter = drafter
        self.settings = settings
        self.device = _model_device(drafter, _target_device(target))
        self.embed_weight = target.get_input_embeddings().weight.to(self.device)
        head = target.get_output_embeddings()
        self.lm_head = head if head is not None else target.lm_head
        self.cache = _new_cache(drafter.config) if hasattr(drafter, "config") else None
        self.calls = 0

    @property
    def selects(self) -> bool:
        """A DFlash 2 drafter (ours or z-lab's): its drafts are its candidate selector's walk, not the
        argmax of its logits."""
        return getattr(self.drafter, "candidate_selector", None) is not None

    def logits(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        """Draft logits ``[1, v - 1, V]`` for the slots 1.. of ``block`` ``[1, v]`` (its first token at
        position ``start``); ``context`` ``[1, c, F]`` holds the features of positions ``start - c ..
        start - 1`` not yet in the cache."""
        return self._logits(self.hidden(block, context, start))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self.drafter, "compute_logits"):
            return self.drafter.compute_logits(hidden, self.lm_head)
        return self.lm_head(hidden)

    def propose(
        self,
        block: torch.Tensor,
        context: torch.Tensor,
        start: int,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts ``[1, v - 1]`` for the slots 1.. of ``block``, and at ``temperature > 0`` their
        proposal distribution ``[v - 1, V]`` (float32; what speculative sampling checks against).

        A plain drafter proposes its argmax (greedy; sampling its logits is :func:`spec_generate`'s
        business, with top-p / top-k). A DFlash 2 drafter proposes its selector's walk from the block's
        first token (``dflash2.select_path``, z-lab's ``propose``): greedy, or sampled from the softmax
        of the candidate scores at ``temperature`` (no top-p / top-k: z-lab's rule), one draw per slot,
        in order; the distribution is then zero outside each slot's candidates."""
        hidden = self.hidden(block, context, start)
        logits = self._logits(hidden)
        if not self.selects:
            return logits.argmax(dim=-1), None
        from .dflash2 import select_path

        path, candidates, probs = select_path(
            self.drafter.candidate_selector,
            hidden,
            logits,
            block[:, 0].to(hidden.device),
            temperature=temperature,
            generator=generator,
        )
        if probs is None:
            return path, None
        full = torch.zeros(probs.shape[1], logits.shape[-1], dtype=torch.float32, device=probs.device)
        return path, full.scatter_(-1, candidates[0], probs[0].float())

    def greedy_drafts(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        """The greedy drafts ``[v - 1]`` of ``block`` (argmax, or a DFlash 2 drafter's selector walk)."""
        return self.propose(block, context, start)[0][0]

    def hidden(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        """The drafter's normed hidden states ``[1, v - 1, H]`` of the slots 1.. of ``block`` (see
        :meth:`logits`)."""
        verify = block.shape[1]
        noise = F.embedding(block.to(self.device), self.embed_weight)
        if self.settings.embed_scale != 1.0:
            noise = noise * self.settings.embed_scale
        ctx_len = context.shape[1]
        positions = torch.arange(start - ctx_len, start + verify, device=self.device)[None]
        hidden = self.drafter(
            position_ids=positions,
            noise_embedding=noise,
            target_hidden=context.to(self.device),
            attention_mask=None,
            past_key_values=self.cache,
            use_cache=True,
        )
        if not isinstance(hidden, torch.Tensor):  # a ModelOutput-returning drafter
            hidden = hidden[0]
        self.calls += 1
        # The cache now holds context + block; the block part is stale once the target decides.
        if self.cache is not None:
            _crop(self.cache, start)
        return hidden[:, 1:verify, :]


# ---------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------


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
    device = _target_device(model)
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
    device = _target_device(target)
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
) -> SpecResult:
    """Speculative decoding of one prompt with a DFlash drafter (see the module docstring).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` default to the drafter's own
    (``drafter.block_size`` / ``config.dflash_config``); pass them to override. Greedy by default: the
    output is then identical to :func:`greedy_generate` (lossless) whatever the drafter proposes. With
    ``sampling`` at a temperature > 0 every random draw comes from ``generator`` (a generator on the
    target's device; None: a fresh one seeded 0, so a call is reproducible by default). ``trace``, when
    given, gets one ``(start, drafts)`` per verify step: the position of the block's first token and the
    drafts the target verified (what an engine's drafts are compared against, step by step).
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    sampling = sampling if sampling is not None else Sampling()
    settings = draft_settings(
        drafter, block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids
    )
    block_size = settings.block_size
    device = _target_device(target)
    greedy = sampling.greedy
    if not greedy and generator is None:
        generator = torch.Generator(device=device).manual_seed(0)

    ids = _as_batch_of_one(input_ids, device)
    n_in = ids.shape[1]
    max_length = n_in + max_new_tokens  # final output is at most this long
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)

    # One row holding prompt + everything generated; unfilled slots hold the mask token, which is
    # exactly what the block needs past its first slot.
    fill = settings.mask_token_id if settings.mask_token_id is not None else 0
    seq = torch.full((1, max_length + 1), fill, dtype=torch.long, device=device)
    seq[:, :n_in] = ids
    positions = torch.arange(max_length + 1, device=device)[None]

    tgt_cache = _new_cache(target.config)
    ck = _cache_kwarg(target)
    drafts = BlockDrafter(target, drafter, settings) if block_size > 1 else None

    out = target(
        input_ids=ids,
        position_ids=positions[:, :n_in],
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=block_size > 1,
        **{ck: tgt_cache},
    )
    target_forwards = 1
    last = out.logits[0, -1:]
    seq[0, n_in] = (
        last.argmax(dim=-1)[0] if greedy else sample_from(sampling_probs(last, sampling), generator)[0]
    )
    # Draft context waiting to enter the drafter's cache: features of tokens < start not yet cached.
    pending_ctx = features(out.hidden_states, settings.layer_ids) if block_size > 1 else None

    start = n_in  # position of the last committed token, which opens the next block
    accept_lengths: list[int] = []
    stopped = bool(stops.numel()) and bool(torch.isin(seq[0, start], stops))
    while start + 1 < max_length and not stopped:
        # Near the end the block shrinks to what is left (as z-lab does): every verified slot may still
        # become output, and the drafter sees the same block the reference would.
        verify = min(block_size, max_length - start)
        block = seq[:, start : start + verify].clone()  # [last token, MASK, ...]
        draft_probs = None
        if verify > 1 and drafts.selects:  # DFlash 2: the selector's walk (and its proposal distribution)
            proposed, draft_probs = drafts.propose(
                block, pending_ctx, start, 0.0 if greedy else sampling.temperature, generator
            )
            block[:, 1:] = proposed.to(device)
            draft_probs = draft_probs.to(device) if draft_probs is not None else None
        elif verify > 1:
            logits = drafts.logits(block, pending_ctx, start).to(device)
            # Slot 0 is the known token; slots 1.. are the proposals for positions start+1 ...
            if greedy:
                block[:, 1:] = logits.argmax(dim=-1)
            else:
                draft_probs = sampling_probs(logits[0], sampling)
                block[0, 1:] = sample_from(draft_probs, generator)

        if trace is not None:
            trace.append((start, block[0, 1:].tolist()))
        out = target(
            input_ids=block,
            position_ids=positions[:, start : start + verify],
            use_cache=True,
            output_hidden_states=verify > 1,
            **{ck: tgt_cache},
        )
        target_forwards += 1
        if greedy:
            posterior = out.logits[0].argmax(dim=-1)  # target's choice after each block slot
            matches = (block[0, 1:] == posterior[:-1]).int()
            accepted = int(matches.cumprod(0).sum())  # longest matching prefix of the drafts
            nxt = posterior[accepted]
        else:
            target_probs = sampling_probs(out.logits[0], sampling)
            q = draft_probs if draft_probs is not None else target_probs[:0]
            accepted, nxt = verify_sampled(block[0, 1:], q, target_probs, generator)
        # Commit the accepted drafts and the bonus (the target's token after them).
        seq[0, start + 1 : start + 1 + accepted] = block[0, 1 : 1 + accepted]
        seq[0, start + 1 + accepted] = nxt
        produced = min(accepted + 1, max_length - start - 1)
        if stops.numel():
            hit = torch.isin(seq[0, start + 1 : start + 1 + produced], stops).nonzero()
            if hit.numel():
                produced = int(hit[0, 0]) + 1  # keep the stop token, drop what follows
                stopped = True
        # Tokens start .. start+produced-1 now have verified K/V and features; the new last token
        # (start+produced) has neither yet: it opens the next block.
        _crop(tgt_cache, start + produced)
        if verify > 1:
            pending_ctx = features(out.hidden_states, settings.layer_ids)[:, :produced]
        start += produced
        accept_lengths.append(produced)

    output = seq[:, : min(start + 1, max_length)].clone()
    return SpecResult(output, accept_lengths, target_forwards, drafts.calls if drafts else 0, n_in)


# ---------------------------------------------------------------------------------------------------
# evaluation
# ---------------------------------------------------------------------------------------------------


def evaluate_drafter(
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
    seed: int = 0,
    on_unit: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Run speculative decoding on every prompt (greedy: beside plain greedy decoding, and compare).
    ``on_unit(tokens)`` is called after each prompt (progress; it may raise to abandon the evaluation).

    Returns (all numbers, so the dict logs as metrics):

    * ``tau``: mean tokens committed per verify step, bonus included, over all steps of all prompts
      (the DFlash "acceptance length"; 1.0 = the drafter never helps, B = every draft accepted);
    * ``speedup_forwards``: plain-decoding target forwards (one per new token, the prefill's included)
      / speculative target forwards; the upper bound on wall-clock speedup when the drafter is free;
    * ``tokens_generated``, ``num_prompts``, ``verify_steps``, ``target_forwards_spec``,
      ``drafter_forwards``, ``spec_s``;
    * greedy only: ``lossless`` (1.0 when every speculative output equals the greedy output token for
      token), ``mismatched_prompts``, ``target_forwards_greedy``, ``greedy_s``, ``speedup_wall``
      (wall-clock times are informative only on CPU);
    * sampled only: ``temperature``, ``top_p``, ``top_k``. Prompt ``i`` draws from a generator seeded
      with ``derive_seed(seed, 0, 0, "prompt", i)``: a prompt's output does not depend on the others.
    """
    if not prompts:
        raise ValueError("no prompts")
    sampling = sampling if sampling is not None else Sampling()
    device = _target_device(target)
    was_training = drafter.training
    drafter.eval()
    try:
        steps, committed, fwd_greedy, fwd_spec, fwd_draft, tokens, mismatched = 0, 0, 0, 0, 0, 0, 0
        greedy_s = spec_s = 0.0
        for i, prompt in enumerate(prompts):
            ref = None
            t0 = time.perf_counter()
            if sampling.greedy:
                ref = greedy_generate(target, prompt, max_new_tokens, stop_token_ids)
            generator = None
            if not sampling.greedy:
                generator = torch.Generator(device=device).manual_seed(derive_seed(seed, 0, 0, "prompt", i))
            t1 = time.perf_counter()
            res = spec_generate(
                target,
                drafter,
                prompt,
                max_new_tokens=max_new_tokens,
                block_size=block_size,
                mask_token_id=mask_token_id,
                target_layer_ids=target_layer_ids,
                stop_token_ids=stop_token_ids,
                sampling=sampling,
                generator=generator,
            )
            t2 = time.perf_counter()
            greedy_s += t1 - t0
            spec_s += t2 - t1
            steps += len(res.accept_lengths)
            committed += sum(res.accept_lengths)
            fwd_spec += res.target_forwards
            fwd_draft += res.drafter_forwards
            tokens += res.num_new_tokens
            if ref is not None:
                fwd_greedy += ref.target_forwards
                mismatched += int(res.output_ids.tolist() != ref.output_ids.tolist())
            if on_unit is not None:
                on_unit(res.num_new_tokens)
    finally:
        drafter.train(was_training)
    metrics = {
        "tau": committed / steps if steps else 1.0,
        # Plain decoding takes one target forward per new token (greedy_generate counts exactly that).
        "speedup_forwards": tokens / fwd_spec,
        "tokens_generated": float(tokens),
        "num_prompts": float(len(prompts)),
        "verify_steps": float(steps),
        "target_forwards_spec": float(fwd_spec),
        "drafter_forwards": float(fwd_draft),
        "spec_s": spec_s,
    }
    if sampling.greedy:
        metrics.update(
            {
                "lossless": float(mismatched == 0),
                "mismatched_prompts": float(mismatched),
                "target_forwards_greedy": float(fwd_greedy),
                "greedy_s": greedy_s,
                "speedup_wall": greedy_s / spec_s if spec_s > 0 else 0.0,
            }
        )
    else:
        metrics.update(
            {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": float(sampling.top_k)}
        )
    return metrics
