"""Building the drafter to train: a fresh one of a ``DrafterShape`` for a target's config (weights drawn from
a seed under a private RNG), or one loaded from an exported directory; its parameter count on the meta
device; the recipe's defaults that depend on the shape (the loss decay ``gamma``, the mask token)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_flow.model.dflash2 import drafter_from_config, drafter_variant, variant_config
from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.recipe import DrafterShape

__all__ = ["build_drafter", "default_gamma", "drafter_config", "parameter_count", "parameter_count_for",
           "resolve_mask_token_id"]

# Loss decay by block size from the DFlash recipes (gamma 7 for B=16, 5 for B=10, 4 for B=8).
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size in _GAMMA_BY_BLOCK:
        return _GAMMA_BY_BLOCK[block_size]
    # Between the published points, keep gamma proportional to the block size (7/16 per slot).
    return max(1.0, round(block_size * 7.0 / 16.0, 2))


def resolve_mask_token_id(explicit: int | None, tokenizer_path: str | None, vocab_size: int) -> int:
    """Explicit id, else the tokenizer's mask token, else the first embedding row past the tokenizer,
    else its pad token (SpecForge's order; the id is written into the exported config)."""
    if explicit is not None:
        return explicit
    if tokenizer_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        if len(tok) < vocab_size:
            return len(tok)
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
    raise ValueError(
        "cannot choose a mask token: set mask_token_id (the target's embedding has no free row past the "
        "tokenizer and the tokenizer has no mask or pad token)"
    )


def drafter_config(target_config: Any, shape: DrafterShape, *, mask_token_id: int) -> Any:
    """The config of a fresh drafter of ``shape`` for ``target_config``."""
    return variant_config(
        target_config, shape.variant, num_layers=shape.num_layers, block_size=shape.block_size,
        mask_token_id=mask_token_id, target_layer_ids=shape.target_layer_ids, layer_types=shape.layer_types,
        sliding_window=shape.sliding_window,
    )


def parameter_count(target_config: Any, shape: DrafterShape, *, init_from: str | Path | None = None) -> int:
    """Trainable parameters of the drafter ``build_drafter`` would make, counted on the meta device (no
    memory, no weights)."""
    from dflash_flow.model.export import load_drafter_config

    config = load_drafter_config(init_from) if init_from else drafter_config(target_config, shape, mask_token_id=0)
    with torch.device("meta"):
        model = drafter_from_config(config)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def parameter_count_for(target: Any, shape: DrafterShape, *, trust_remote_code: bool = False,
                        init_from: str | Path | None = None) -> int:
    """``parameter_count`` of the drafter for ``target`` (its config read; not needed with ``init_from``)."""
    from dflash_flow.model.target import load_target_config

    target_config = None if init_from else load_target_config(target, trust_remote_code=trust_remote_code)
    return parameter_count(target_config, shape, init_from=init_from)


def build_drafter(
    target_config: Any,
    shape: DrafterShape,
    *,
    seed: int,
    device: str | torch.device,
    dtype: torch.dtype,
    tokenizer_path: str | None = None,
    init_from: str | Path | None = None,
) -> DFlashDrafter:
    """A drafter for ``target_config``: loaded from an exported directory (``init_from``), or fresh with
    weights drawn from ``seed`` under a private RNG (so nothing else in the process changes them)."""
    from dflash_flow.model.export import load_drafter

    if init_from:
        drafter = load_drafter(init_from, device=device, dtype=dtype, target_config=target_config)
        found = drafter_variant(drafter.config)
        if found != shape.variant.name:
            raise ValueError(f"init_from {init_from} holds a {found} drafter, but variant is {shape.variant.name}")
    else:
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        mask_id = resolve_mask_token_id(shape.mask_token_id, tokenizer_path, int(tc.vocab_size))
        config = drafter_config(target_config, shape, mask_token_id=mask_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = drafter_from_config(config)
        drafter.to(device=torch.device(device), dtype=dtype)
    drafter.train()
    return drafter

