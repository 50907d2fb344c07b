"""The frozen target model: loading it, reading its hidden states, sharing its embedding and LM head.

Three jobs, all pure (no pipeline runtime):

* :func:`load_target` turns a *spec* (local directory, hub id, or a tiny config preset) into a frozen,
  eval-mode causal LM on a device, or split layer-wise over several devices (a target larger than one
  GPU), optionally loaded only as deep as the deepest layer it will run.
* :class:`TargetFeatureExtractor` runs the target only as deep as the deepest requested layer and returns
  the DFlash context features ``concat(hidden_states[id + 1] for id in target_layer_ids)``, aligned 1:1
  with ``input_ids`` (no shift).
* :class:`~dflash_flow.model.head.SharedHead` (``model.head``) gives the drafter the target's frozen
  ``embed_tokens`` and ``lm_head``.

The pieces live in rooms of their own: ``model.device`` (dtypes, attention kernel), ``model.hub`` (hub
ids, offline mode), ``model.features`` (the extractor), ``model.split`` (several devices), ``model.head``.
This module loads; it re-exports the names callers use with a target.
"""


from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_flow.model.device import as_device, default_attn_implementation, default_dtype, resolve_dtype
from dflash_flow.model.facts import TARGET_PRESETS, preset_params
from dflash_flow.model.features import (
    DEPTH_ATTR,
    TargetFeatureExtractor,
    backbone,
    decoder_layers,
    target_depth,
)
from dflash_flow.model.hub import TargetOfflineError, cache_then_hub, hub_id
from dflash_flow.model.split import layer_devices, place_on_devices, split_device_map

__all__ = [
    "TARGET_PRESETS",
    "TargetOfflineError",
    "TargetFeatureExtractor",
    "load_target",
    "load_target_config",
    "layer_devices",
    "num_hidden_layers",
    "peek_target_depth",
    "place_on_devices",
    "split_device_map",
    "target_depth",
    "resolve_dtype",
    "is_preset",
    "default_dtype",
    "default_attn_implementation",
    "decoder_layers",
]


# ---------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------




def preset_init_device(spec: Mapping[str, Any] | str) -> str:
    """Where a preset's random weights are drawn: ``cpu`` (default: the weights depend only on the seed)
    or an accelerator (``init_device: cuda``: a large random target, e.g. for ``bench/gpu.py``, is built in
    seconds where it runs instead of minutes on the host; its weights then depend on the seed and the
    device type)."""
    return str(spec.get("init_device", "cpu")) if isinstance(spec, Mapping) else "cpu"


def _preset_config(spec: Mapping[str, Any] | str) -> tuple[Any, int]:
    """Resolve a preset name or dict into (transformers config, seed)."""
    from transformers import AutoConfig

    params = preset_params(spec)
    if params is None:
        raise ValueError(f"unknown target preset {spec!r}; known: {sorted(TARGET_PRESETS)}")
    seed = int(params.pop("seed", 0))
    params.pop("init_device", None)
    model_type = params.pop("model_type", "qwen3")
    return AutoConfig.for_model(model_type, **params), seed



def is_preset(spec: Any) -> bool:
    return isinstance(spec, Mapping) or (isinstance(spec, str) and spec in TARGET_PRESETS)


def load_target_config(
    spec: str | os.PathLike | Mapping[str, Any], *, trust_remote_code: bool = False, local_only: bool = False
):
    """The target's config without its weights (a preset's, or ``config.json`` of a directory/hub id).

    A hub id is read from the local HF cache first; the hub is asked only when it is reachable and
    ``local_only`` is false (validation passes ``local_only=True``: it never touches the network), else
    :class:`TargetOfflineError` (``OSError`` with ``local_only`` when the id is not cached).
    """
    if is_preset(spec):
        config, _ = _preset_config(spec)  # type: ignore[arg-type]
        return config
    from transformers import AutoConfig

    path = Path(os.fspath(spec)).expanduser()
    if path.exists():
        return AutoConfig.from_pretrained(
            str(path), local_files_only=True, trust_remote_code=trust_remote_code
        )
    spec_str = hub_id(spec, TARGET_PRESETS)

    def read(local: bool):
        return AutoConfig.from_pretrained(
            spec_str, local_files_only=local, trust_remote_code=trust_remote_code
        )

    if local_only:
        return read(True)
    return cache_then_hub(read, spec_str, next(iter(TARGET_PRESETS)))


def num_hidden_layers(config: Any) -> int:
    """Decoder layers of a target config (the text stack's, for multimodal wrappers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def peek_target_depth(
    spec: str | os.PathLike | Mapping[str, Any], *, trust_remote_code: bool = False
) -> int | None:
    """The target's decoder depth when its config can be read here without weights and without the
    network (a preset, a local directory, a cached hub id); None otherwise (the stage's setup then
    reports what is wrong)."""
    try:
        return num_hidden_layers(
            load_target_config(spec, trust_remote_code=trust_remote_code, local_only=True)
        )
    except Exception:  # unreadable here (not cached, remote code refused, malformed): not validation's call
        return None



def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_target(
    spec: str | os.PathLike | Mapping[str, Any],
    *,
    device: str | torch.device | None = None,
    devices: Sequence[str | torch.device] | None = None,
    num_layers: int | None = None,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
) -> nn.Module:
    """Load the frozen target causal LM.

    ``spec`` is, in order of precedence:

    * a dict: a config preset, ``{"preset": "tiny-qwen3-8l", **overrides}`` or a full
      ``{"model_type": "qwen3", ...config kwargs, "seed": 0}``; random weights seeded by ``seed``;
    * a name in :data:`TARGET_PRESETS`;
    * an existing local directory (loaded with ``local_files_only=True``: no network);
    * a hub id (``org/name``): taken from the local HF cache if present, downloaded only when the hub is
      reachable; otherwise :class:`TargetOfflineError`.

    Placement: ``device`` (default cpu) puts the whole model on one device; ``devices=[d0, d1, ...]``
    splits it layer-wise (:func:`place_on_devices`: embedding and the first layers on ``d0``, later layers
    on the next devices, balanced by layer count, activations moved by hooks). ``num_layers`` loads only
    the first ``num_layers`` decoder layers: the config is truncated before the model is built, so the
    checkpoint tensors of the layers above are never read (a preset is built whole from its seed, so
    that its weights equal the unsplit preset's, and the layers above are dropped before placement).
    :func:`target_depth` still gives the full depth. ``dtype`` and ``attn_implementation`` default by the
    (first) device.

    Memory of a split (bf16): a Qwen3-8B-shaped target (36 layers, hidden 4096, MLP 12288, GQA 32/8 heads
    of 128, vocab 151936, untied) holds 0.39 GB per decoder layer and 1.24 GB each for the embedding and
    the LM head. Over 2 GPUs with the deepest layer 33 (the default 5-layer DFlash ids 1..33): 34 layers
    load, 17 per device; the first device holds the embedding + 17 layers (about 7.8 GB), the second 17
    layers + final norm + LM head (about 7.8 GB); layers 34-35 (0.8 GB) are never loaded. Activations
    come on top: per 12288-token batch each residual state is 100 MB, the MLP transient about 0.9 GB per
    device, the gathered features (5 layers) 0.5 GB on the output device.

    The result is in eval mode with ``requires_grad=False`` everywhere. Remote code runs only when
    ``trust_remote_code=True``.
    """

    if device is not None and devices:
        raise ValueError("pass either device or devices, not both")
    placement = [as_device(d) for d in (devices or [device or "cpu"])]
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    dtype = dtype or default_dtype(placement[0])
    attn = attn_implementation or default_attn_implementation(placement[0], dtype)
    common = {"dtype": dtype, "attn_implementation": attn, "trust_remote_code": trust_remote_code}

    if is_preset(spec):
        return _placed(_build_preset(spec, num_layers, common), placement)

    if len(placement) == 1 and placement[0].type == "cuda" and importlib.util.find_spec("accelerate") is not None:
        # Read straight onto the GPU (transformers needs accelerate for a device_map): not through host memory
        # and a copy, which took minutes for six 16 GB replicas in turn under MODEL_LOAD_LOCK.
        common["device_map"] = {"": str(placement[0])}
    path = Path(os.fspath(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"target spec {str(spec)!r} is a file; expected a model directory")
        config = load_target_config(path, trust_remote_code=trust_remote_code) if num_layers else None
        return _placed(_from_pretrained(path, config, num_layers, local_files_only=True, **common), placement)
    spec_str = hub_id(spec, TARGET_PRESETS)
    config = load_target_config(spec_str, trust_remote_code=trust_remote_code) if num_layers else None

    def read_hub(local: bool):
        return _from_pretrained(spec_str, config, num_layers, local_files_only=local, **common)

    return _placed(cache_then_hub(read_hub, spec_str, next(iter(TARGET_PRESETS))), placement)


def _build_preset(spec: Any, num_layers: int | None, common: dict[str, Any]) -> nn.Module:
    """A preset's model with its seeded random weights, the layers above ``num_layers`` dropped."""
    from transformers import AutoModelForCausalLM

    config, seed = _preset_config(spec)
    # Build on CPU under a private RNG: the weights then depend only on the seed, not on the device
    # or on whatever the caller did with the global RNG before.
    init = torch.device(preset_init_device(spec))
    rng_devices = [init.index or 0] if init.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), init:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **common)
    _drop_layers_above(model, num_layers)
    return model


def _placed(model: nn.Module, placement: list[torch.device]) -> nn.Module:
    if len(placement) == 1:
        return _freeze(model.to(placement[0]))
    return _freeze(place_on_devices(model, placement))


# -- loading only as deep as needed ----------------------------------------------------------------

def _truncate_config(config: Any, num_layers: int) -> None:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = num_layers
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > num_layers:
        text.layer_types = layer_types[:num_layers]


def _check_depth(num_layers: int, depth: int) -> None:
    if num_layers > depth:
        raise ValueError(f"num_layers={num_layers} but the target has only {depth} decoder layers")


def _drop_layers_above(model: nn.Module, num_layers: int | None) -> None:
    """Keep the first ``num_layers`` decoder layers of a built model (a preset: tiny and built whole)."""
    if num_layers is None:
        return
    depth = len(decoder_layers(model))
    _check_depth(num_layers, depth)
    stack = backbone(model)
    stack.layers = nn.ModuleList(list(stack.layers)[:num_layers])
    _truncate_config(model.config, num_layers)
    setattr(model, DEPTH_ATTR, depth)
    _drop_output_head(model, num_layers, depth)


def _drop_output_head(model: nn.Module, num_layers: int, depth: int) -> None:
    """A target loaded only partway serves features: its final norm and LM head would act on a middle layer's
    output (logits that mean nothing), and the LM head is the largest single tensor (1.24 GB at Qwen3-8B, vocab
    151,936): both go (the norm becomes an identity, so the backbone's forward still runs to its end; the LM
    head is None, so a call of the model for logits fails at once instead of giving wrong ones)."""
    if num_layers >= depth:
        return
    stack = backbone(model)
    if isinstance(getattr(stack, "norm", None), nn.Module):
        stack.norm = nn.Identity()
    if model.get_output_embeddings() is not None and hasattr(model, "lm_head"):
        model.lm_head = None


def _from_pretrained(source: str | Path, config: Any, num_layers: int | None, **kwargs: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if num_layers is None:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    depth = num_hidden_layers(config)
    _check_depth(num_layers, depth)
    _truncate_config(config, num_layers)
    model = _skipping_layers_above(config, num_layers, depth).from_pretrained(source, config=config, **kwargs)
    setattr(model, DEPTH_ATTR, depth)
    _drop_output_head(model, num_layers, depth)
    return model


def _skipping_layers_above(config: Any, num_layers: int, depth: int) -> Any:
    """The model class of ``config`` with the checkpoint's layers ``num_layers..depth-1`` declared as
    expected-unexpected keys (transformers' own ``_keys_to_ignore_on_load_unexpected``): they are in the
    checkpoint on purpose, so transformers neither loads nor reports them, and still reports any other
    unexpected key. A class transformers does not map (remote code) loads as usual (the layers above are
    then listed in transformers' load report)."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return AutoModelForCausalLM
    pattern = rf"(^|\.)layers\.({'|'.join(str(i) for i in range(num_layers, depth))})\."
    ignore = [*(cls._keys_to_ignore_on_load_unexpected or ()), pattern]
    return type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignore, "__module__": cls.__module__})
