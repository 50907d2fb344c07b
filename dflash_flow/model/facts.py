"""What can be known about a target without torch or transformers, for validation: the tiny presets, the
sizes a local ``config.json`` or a preset states, and the DFlash rule of which target layers feed the drafter."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

# Tiny random-weight targets for CPU runs and tests. Eight or more layers, because the DFlash layer-id rule
# (spread over [1, L-3]) repeats ids on shallower targets; `seed` fixes the random weights. Any key may be
# overridden by a dict spec {"preset": name, **overrides}.
_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096, "tie_word_embeddings": False, "seed": 0,
}

TARGET_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen3-8l": {"model_type": "qwen3", **_TINY_COMMON},
    "tiny-qwen3-8l-tied": {"model_type": "qwen3", **_TINY_COMMON, "tie_word_embeddings": True},
    "tiny-qwen3-12l": {"model_type": "qwen3", **_TINY_COMMON, "hidden_size": 128, "intermediate_size": 256,
                       "num_hidden_layers": 12, "head_dim": 32},
    "tiny-llama-8l": {"model_type": "llama", **_TINY_COMMON},
}


@attrs.frozen
class TargetFacts:
    """A target's sizes, as its config states them."""

    depth: int  # decoder layers
    hidden_size: int
    vocab_size: int
    max_positions: int | None = None  # its context window (max_position_embeddings), when stated


def preset_params(spec: Any) -> dict[str, Any] | None:
    """The parameters of a preset name or mapping (``{"preset": name, **overrides}``); None for anything else.
    Raises ValueError for an unknown base preset."""
    if isinstance(spec, str):
        return dict(TARGET_PRESETS[spec]) if spec in TARGET_PRESETS else None
    if not isinstance(spec, Mapping):
        return None
    params = dict(spec)
    base = params.pop("preset", None)
    if base is not None:
        if base not in TARGET_PRESETS:
            raise ValueError(f"unknown target preset {base!r}; known: {sorted(TARGET_PRESETS)}")
        params = {**TARGET_PRESETS[base], **params}
    return params


def target_facts(spec: Any) -> TargetFacts | None:
    """Depth, hidden size, vocabulary and (when stated) context window of a preset or of a local model directory
    (its ``config.json``, the text stack's for multimodal wrappers); None when that cannot be read here (a hub
    id, no config.json)."""
    try:
        d = preset_params(spec)
    except ValueError:
        return None
    if d is None and isinstance(spec, str):
        path = Path(spec).expanduser() / "config.json"
        if not path.is_file():
            return None
        try:
            d = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    if isinstance(d, dict) and isinstance(d.get("text_config"), dict):
        d = {**d, **d["text_config"]}
    if not isinstance(d, dict):
        return None
    values = [d.get(k) for k in ("num_hidden_layers", "hidden_size", "vocab_size", "max_position_embeddings")]
    if not all(_positive_int(v) for v in values[:3]):
        return None
    return TargetFacts(*values[:3], max_positions=values[3] if _positive_int(values[3]) else None)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Target layers whose outputs feed the drafter: ``[L//2]`` for one, else n points over [1, L-3] (Python's
    banker's ``round`` on purpose: released checkpoints were made with it)."""
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(f"a target with {num_target_layers} layers is too shallow for {n} feature layers "
                         "(the rule spreads them over [1, L-3]); pass target_layer_ids explicitly")
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]
