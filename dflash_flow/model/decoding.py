"""What the decoding loops share: transformers' KV cache (argument name, cropping, the prefill), devices,
configs, eval mode, a reply cut at its stop token."""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

__all__ = ["cache_kwarg", "crop_cache", "eval_mode", "full_attention", "new_cache", "prefill", "reply_until_stop", "target_device",
           "text_config"]


def cache_kwarg(model: nn.Module) -> str:
    """transformers >= 5.2x calls the KV cache argument `cache`; older 5.x `past_key_values` (deprecated,
    with a warning, in the newer ones). Ask the signature instead of pinning a version."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


def new_cache(config: Any):
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    # Sliding-window / linear-attention layers can be cropped back only if they keep their past.
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def crop_cache(cache: Any, length: int) -> None:
    """Drop everything past `length` tokens. A negative argument ("remove this many") is the form both
    older and newer transformers accept."""
    remove = cache.get_seq_length() - length
    if remove > 0:
        cache.crop(-remove)


def target_device(target: nn.Module) -> torch.device:
    return next(target.parameters()).device


def reply_until_stop(reply: Sequence[int], stop_token_ids: Sequence[int] | None) -> tuple[list[int], bool]:
    """The reply up to and including its first stop token, and whether it has one."""
    stops = {int(t) for t in stop_token_ids or ()}
    out = [int(t) for t in reply]
    cut = next((i for i, t in enumerate(out) if t in stops), None)
    return (out, False) if cut is None else (out[: cut + 1], True)


def text_config(model: nn.Module) -> Any:
    """The model's (text) config: a multimodal config's text part."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def full_attention(config: Any) -> bool:
    """Whether every layer of ``config`` is full causal attention (no sliding-window or linear layer types)."""
    return all(t == "full_attention" for t in getattr(config, "layer_types", None) or ["full_attention"])


def prefill(target: nn.Module, ids: torch.Tensor, *, hidden_states: bool) -> tuple[Any, Any]:
    """One prompt's prefill ``ids`` ``[1, n]``, the one-row call itself: (output, its DynamicCache)."""
    cache = new_cache(target.config)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    out = target(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                 output_hidden_states=hidden_states, **{cache_kwarg(target): cache})
    return out, cache


@contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode inside the block, its training flag restored after."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
