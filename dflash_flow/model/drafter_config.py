"""The drafter's config: its layer types, ``draft_value`` and ``make_drafter_config`` (sized to the target)."""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

from dflash_flow.model.facts import build_target_layer_ids

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash setting: ``dflash_config[name]`` first, then the config attribute (as z-lab reads it)."""
    dcfg = getattr(config, "dflash_config", None) or {}
    if name in dcfg:
        return dcfg[name]
    return getattr(config, name, default)


def make_drafter_config(target_config: Any, *, num_layers: int, block_size: int = 16, mask_token_id: int,
                        target_layer_ids: list[int] | None = None, layer_types: list[str] | None = None,
                        sliding_window: int | None = None, intermediate_size: int | None = None,
                        input_embedding_scale: float | None = None, output_multiplier: float | None = None,
                        final_logit_softcapping: float | None = None) -> Qwen3Config:
    """A drafter config sized to ``target_config``: its hidden and vocabulary sizes (the drafter shares its
    embedding and LM head), attention geometry and RoPE (what released drafters do)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft slot), got {block_size}")
    num_target_layers = int(tc.num_hidden_layers)
    target_layer_ids = _checked_layer_ids(target_layer_ids, num_target_layers, num_layers)
    vocab_size = int(tc.vocab_size)
    if not 0 <= int(mask_token_id) < vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary [0, {vocab_size})")
    layer_types, sliding_window = _checked_layer_types(layer_types, sliding_window, num_layers)
    dflash_config: dict[str, Any] = {"mask_token_id": int(mask_token_id), "target_layer_ids": target_layer_ids}
    for key, value in (("input_embedding_scale", input_embedding_scale),
                       ("output_multiplier", output_multiplier),
                       ("final_logit_softcapping", final_logit_softcapping)):
        if value is not None:
            dflash_config[key] = float(value)
    num_heads = int(tc.num_attention_heads)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // num_heads
    rope_parameters = getattr(tc, "rope_parameters", None)
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=int(tc.hidden_size),
        intermediate_size=int(intermediate_size or tc.intermediate_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=int(getattr(tc, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        hidden_act=getattr(tc, "hidden_act", "silu"),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 32768)),
        initializer_range=float(getattr(tc, "initializer_range", 0.02)),
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
        rope_parameters=dict(rope_parameters) if rope_parameters else None,
        attention_bias=bool(getattr(tc, "attention_bias", False)),
        # Qwen3Config drops sliding_window unless use_sliding_window is set, also when reloading config.json.
        use_sliding_window=SLIDING_ATTENTION in layer_types,
        sliding_window=sliding_window,
        layer_types=layer_types,
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=int(block_size),
        num_target_layers=num_target_layers,
        dflash_config=dflash_config,
    )


def _checked_layer_ids(target_layer_ids: list[int] | None, num_target_layers: int, num_layers: int) -> list[int]:
    """The target layers whose features the drafter reads (None: the default rule), each in range."""
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if not target_layer_ids:
        raise ValueError("target_layer_ids must not be empty")
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a target with {num_target_layers} layers")
    return target_layer_ids


def _checked_layer_types(layer_types: list[str] | None, sliding_window: int | None,
                         num_layers: int) -> tuple[list[str], int | None]:
    """Each layer's attention type (None: all full) and the sliding window (None unless a layer slides)."""
    if layer_types is None:
        layer_types = [FULL_ATTENTION] * num_layers
    layer_types = list(layer_types)
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"unknown layer types {unknown}; expected {list(LAYER_TYPES)}")
    uses_sliding = SLIDING_ATTENTION in layer_types
    if uses_sliding and (sliding_window is None or sliding_window < 1):
        raise ValueError("sliding_attention layers need a positive sliding_window")
    return layer_types, sliding_window if uses_sliding else None
