"""Greedy speculative decoding with a DFlash drafter, the greedy baseline, and drafter evaluation.

This follows the DFlash inference contract (z-lab ``dflash_generate``, temperature 0), so that what we
measure here is what a served drafter will achieve:

1. Prefill the target on the prompt with hidden states; its argmax is the first new token; the draft
   context is the features of the prompt tokens.
2. Loop: the block is ``[last token, MASK x (B-1)]`` at absolute positions ``start .. start+B-1``. The
   drafter sees its cached context K/V (positions < start) plus the features of the tokens committed
   last step, and the block; draft slot k predicts the token at position ``start + k``. The target
   verifies the block in one forward; the longest prefix of drafts equal to the target's argmax is
   accepted, plus the target's own next token (the bonus). The new context is the features of the
   committed tokens only; both KV caches are cropped back to the committed length.

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
import time
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SpecResult", "spec_generate", "greedy_continuations", "greedy_generate", "evaluate_drafter"]


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


def _features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    # Feature of target layer `id` = HF hidden_states[id + 1] (entry 0 is the embeddings).
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
) -> SpecResult:
    """Greedy speculative decoding of one prompt with a DFlash drafter (see the module docstring).

    ``block_size``, ``mask_token_id`` and ``target_layer_ids`` default to the drafter's own
    (``drafter.block_size`` / ``config.dflash_config``); pass them to override. The output is identical
    to :func:`greedy_generate` (lossless) whatever the drafter proposes.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    block_size = int(block_size if block_size is not None else _draft_setting(drafter, "block_size", 16))
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    mask_token_id = mask_token_id if mask_token_id is not None else _draft_setting(drafter, "mask_token_id")
    layer_ids = list(
        target_layer_ids if target_layer_ids is not None else _draft_setting(drafter, "target_layer_ids")
    )
    if block_size > 1 and (mask_token_id is None or not layer_ids):
        raise ValueError(
            "mask_token_id and target_layer_ids are needed (pass them or set them in the drafter config)"
        )
    embed_scale = float(_draft_setting(drafter, "input_embedding_scale", 1.0) or 1.0)

    device = _target_device(target)
    draft_device = _model_device(drafter, device)
    ids = _as_batch_of_one(input_ids, device)
    n_in = ids.shape[1]
    max_length = n_in + max_new_tokens  # final output is at most this long
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)

    embed_weight = target.get_input_embeddings().weight
    lm_head = target.get_output_embeddings()
    if lm_head is None:
        lm_head = target.lm_head

    def draft_logits(hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(drafter, "compute_logits"):
            return drafter.compute_logits(hidden, lm_head)
        return lm_head(hidden)

    # One row holding prompt + everything generated; unfilled slots hold the mask token, which is
    # exactly what the block needs past its first slot.
    fill = mask_token_id if mask_token_id is not None else 0
    seq = torch.full((1, max_length + 1), fill, dtype=torch.long, device=device)
    seq[:, :n_in] = ids
    positions = torch.arange(max_length + 1, device=device)[None]

    tgt_cache = _new_cache(target.config)
    ck = _cache_kwarg(target)
    draft_cache = _new_cache(drafter.config) if block_size > 1 and hasattr(drafter, "config") else None

    out = target(
        input_ids=ids,
        position_ids=positions[:, :n_in],
        use_cache=True,
        logits_to_keep=1,
        output_hidden_states=block_size > 1,
        **{ck: tgt_cache},
    )
    target_forwards, drafter_forwards = 1, 0
    seq[0, n_in] = out.logits[0, -1].argmax()
    # Draft context waiting to enter the drafter's cache: features of tokens < start not yet cached.
    pending_ctx = _features(out.hidden_states, layer_ids) if block_size > 1 else None

    start = n_in  # position of the last committed token, which opens the next block
    accept_lengths: list[int] = []
    stopped = bool(stops.numel()) and bool(torch.isin(seq[0, start], stops))
    while start + 1 < max_length and not stopped:
        # Near the end the block shrinks to what is left (as z-lab does): every verified slot may still
        # become output, and the drafter sees the same block the reference would.
        verify = min(block_size, max_length - start)
        block = seq[:, start : start + verify].clone()  # [last token, MASK, ...]
        if verify > 1:
            noise = F.embedding(block.to(draft_device), embed_weight.to(draft_device))
            if embed_scale != 1.0:
                noise = noise * embed_scale
            ctx_len = pending_ctx.shape[1]
            hidden = drafter(
                position_ids=positions[:, start - ctx_len : start + verify].to(draft_device),
                noise_embedding=noise,
                target_hidden=pending_ctx.to(draft_device),
                attention_mask=None,
                past_key_values=draft_cache,
                use_cache=True,
            )
            if not isinstance(hidden, torch.Tensor):  # a ModelOutput-returning drafter
                hidden = hidden[0]
            drafter_forwards += 1
            # The cache now holds context + block; the block part is stale once the target decides.
            if draft_cache is not None:
                _crop(draft_cache, start)
            # Slot 0 is the known token; slots 1.. are the proposals for positions start+1 ...
            block[:, 1:] = draft_logits(hidden[:, 1:verify, :]).argmax(dim=-1).to(device)

        out = target(
            input_ids=block,
            position_ids=positions[:, start : start + verify],
            use_cache=True,
            output_hidden_states=verify > 1,
            **{ck: tgt_cache},
        )
        target_forwards += 1
        posterior = out.logits[0].argmax(dim=-1)  # target's choice after each block slot
        matches = (block[0, 1:] == posterior[:-1]).int()
        accepted = int(matches.cumprod(0).sum())  # longest matching prefix of the drafts
        # Commit the accepted drafts and the bonus (the target's token after them).
        seq[0, start + 1 : start + 1 + accepted] = block[0, 1 : 1 + accepted]
        seq[0, start + 1 + accepted] = posterior[accepted]
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
            pending_ctx = _features(out.hidden_states, layer_ids)[:, :produced]
        start += produced
        accept_lengths.append(produced)

    output = seq[:, : min(start + 1, max_length)].clone()
    return SpecResult(output, accept_lengths, target_forwards, drafter_forwards, n_in)


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
) -> dict[str, float]:
    """Run greedy and speculative decoding on every prompt and compare.

    Returns (all numbers; ``lossless`` is 1.0/0.0 so the dict logs as metrics):

    * ``tau``: mean tokens committed per verify step, bonus included, over all steps of all prompts
      (the DFlash "acceptance length"; 1.0 = the drafter never helps, B = every draft accepted);
    * ``speedup_forwards``: greedy target forwards / speculative target forwards (prefills included);
      the upper bound on wall-clock speedup when the drafter is free;
    * ``lossless``: 1.0 when every speculative output equals the greedy output token for token;
    * ``tokens_generated``, ``num_prompts``, ``verify_steps``, ``target_forwards_greedy``,
      ``target_forwards_spec``, ``drafter_forwards``, ``mismatched_prompts``;
    * ``greedy_s``, ``spec_s``, ``speedup_wall``: wall-clock times (informative only on CPU).
    """
    if not prompts:
        raise ValueError("no prompts")
    was_training = drafter.training
    drafter.eval()
    try:
        steps, committed, fwd_greedy, fwd_spec, fwd_draft, tokens, mismatched = 0, 0, 0, 0, 0, 0, 0
        greedy_s = spec_s = 0.0
        for prompt in prompts:
            t0 = time.perf_counter()
            ref = greedy_generate(target, prompt, max_new_tokens, stop_token_ids)
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
            )
            t2 = time.perf_counter()
            greedy_s += t1 - t0
            spec_s += t2 - t1
            steps += len(res.accept_lengths)
            committed += sum(res.accept_lengths)
            fwd_greedy += ref.target_forwards
            fwd_spec += res.target_forwards
            fwd_draft += res.drafter_forwards
            tokens += res.num_new_tokens
            mismatched += int(res.output_ids.tolist() != ref.output_ids.tolist())
    finally:
        drafter.train(was_training)
    return {
        "tau": committed / steps if steps else 1.0,
        "speedup_forwards": fwd_greedy / fwd_spec,
        "lossless": float(mismatched == 0),
        "mismatched_prompts": float(mismatched),
        "tokens_generated": float(tokens),
        "num_prompts": float(len(prompts)),
        "verify_steps": float(steps),
        "target_forwards_greedy": float(fwd_greedy),
        "target_forwards_spec": float(fwd_spec),
        "drafter_forwards": float(fwd_draft),
        "greedy_s": greedy_s,
        "spec_s": spec_s,
        "speedup_wall": greedy_s / spec_s if spec_s > 0 else 0.0,
    }
