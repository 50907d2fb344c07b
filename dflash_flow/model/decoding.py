"""What the decoding loops share: transformers' KV cache (argument name, a croppable cache) and devices."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

__all__ = ["cache_kwarg", "crop_cache", "new_cache", "target_device"]


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
    # Sliding-window / linear-attention layers can only be cropped back if they keep their past;
    # plain full-attention layers ignore this.
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
