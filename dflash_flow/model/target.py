"""The frozen target model: :func:`load_target` turns a *spec* (local directory, hub id, or a tiny config
preset) into a frozen causal LM on a device, or split layer-wise over several (``place_on_devices``),
optionally loaded only as deep as the deepest layer it will run. Re-exports the names callers use with a target.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
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

__all__ = [
    "TARGET_PRESETS", "TargetOfflineError", "TargetFeatureExtractor", "load_target", "load_target_config",
    "layer_devices", "num_hidden_layers", "peek_target_depth", "place_on_devices", "split_device_map",
    "target_depth", "resolve_dtype", "is_preset", "default_dtype", "default_attn_implementation", "decoder_layers",
]


# -- hub ids
class TargetOfflineError(RuntimeError):
    """A hub id was requested but the hub cannot be reached (offline) and the model is not cached."""


def is_offline() -> bool:
    """huggingface_hub's offline mode (``HF_HUB_OFFLINE``, read when huggingface_hub was imported) or the
    same variables set since (``HF_HUB_OFFLINE`` / ``TRANSFORMERS_OFFLINE``)."""
    import huggingface_hub

    flags = (os.environ.get(n, "").strip().lower() for n in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))
    return bool(huggingface_hub.is_offline_mode()) or any(f in {"1", "true", "yes", "on"} for f in flags)


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def hub_id(spec: str | os.PathLike, presets: Iterable[str]) -> str:
    """``spec`` as a hub id (``org/name``), or ValueError naming what else it could have been."""
    spec_str = os.fspath(spec)
    if not _HUB_ID.match(spec_str):
        raise ValueError(
            f"target spec {spec_str!r} is not a preset ({sorted(presets)}), not an existing "
            "directory and not a hub id"
        )
    return spec_str


def cache_then_hub(read: Callable[[bool], Any], spec_str: str, example_preset: str) -> Any:
    """``read(local_files_only)``: the local cache first (no network, works offline), then the hub unless
    huggingface_hub is in offline mode; either way a model that cannot be had is :class:`TargetOfflineError`."""
    try:
        return read(True)
    except OSError:
        why = "offline mode is on (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE)" if is_offline() else None
        if why is None:
            try:
                return read(False)
            except OSError as exc:
                why = f"the hub did not provide it ({str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__})"
        raise TargetOfflineError(
            f"target {spec_str!r} is not a local directory, not a preset and not in the local Hugging Face "
            f"cache, and {why} (offline, or no network). Pass a local path or a preset such as {example_preset!r}."
        ) from None


# -- presets
def preset_init_device(spec: Mapping[str, Any] | str) -> str:
    """Where a preset's random weights are drawn: ``cpu`` (default: they depend only on the seed) or an
    accelerator (``init_device: cuda``: a large random target is built in seconds where it runs)."""
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
    """The target's config without its weights (a preset's, or ``config.json`` of a directory/hub id). A hub
    id is read from the local HF cache first, then from the hub unless ``local_only`` (validation: never the
    network; ``OSError`` when not cached) or offline (:class:`TargetOfflineError`)."""
    if is_preset(spec):
        config, _ = _preset_config(spec)  # type: ignore[arg-type]
        return config
    from transformers import AutoConfig

    path = Path(os.fspath(spec)).expanduser()
    if path.exists():
        return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=trust_remote_code)
    spec_str = hub_id(spec, TARGET_PRESETS)

    def read(local: bool):
        return AutoConfig.from_pretrained(spec_str, local_files_only=local, trust_remote_code=trust_remote_code)

    if local_only:
        return read(True)
    return cache_then_hub(read, spec_str, next(iter(TARGET_PRESETS)))


def num_hidden_layers(config: Any) -> int:
    """Decoder layers of a target config (the text stack's, for multimodal wrappers)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


def peek_target_depth(spec: str | os.PathLike | Mapping[str, Any], *, trust_remote_code: bool = False) -> int | None:
    """The target's decoder depth when its config can be read here without weights and without the network;
    None otherwise (the stage's setup then reports what is wrong)."""
    try:
        return num_hidden_layers(load_target_config(spec, trust_remote_code=trust_remote_code, local_only=True))
    except Exception:  # unreadable here (not cached, remote code refused, malformed): not validation's call
        return None


def load_target(spec: str | os.PathLike | Mapping[str, Any], *, device: str | torch.device | None = None,
                devices: Sequence[str | torch.device] | None = None, num_layers: int | None = None,
                dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                attn_implementation: str | None = None) -> nn.Module:
    """Load the frozen target causal LM. ``spec``, in order: a dict (a preset with overrides, or a config with
    a ``seed`` for its random weights); a name in :data:`TARGET_PRESETS`; a local directory; a hub id (the local
    HF cache, else the hub unless offline: :class:`TargetOfflineError`). ``devices`` splits it layer-wise;
    ``num_layers`` loads only the first decoder layers. ``dtype`` and ``attn_implementation`` default by device."""
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
        # Read straight onto the GPU (a device_map needs accelerate), not through host memory and a copy.
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
    # Under a private RNG: the weights depend only on the seed, not on the caller's global RNG.
    init = torch.device(preset_init_device(spec))
    rng_devices = [init.index or 0] if init.type == "cuda" else []
    with torch.random.fork_rng(devices=rng_devices), init:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, **common)
    _drop_layers_above(model, num_layers)
    return model


def _placed(model: nn.Module, placement: list[torch.device]) -> nn.Module:
    """``model`` on its device(s), frozen (eval mode, no gradients)."""
    model = model.to(placement[0]) if len(placement) == 1 else place_on_devices(model, placement)
    model.eval()
    return model.requires_grad_(False)


# -- loading only as deep as needed ----------------------------------------------------------------

def _truncate_config(config: Any, num_layers: int, depth: int) -> None:
    if num_layers > depth:
        raise ValueError(f"num_layers={num_layers} but the target has only {depth} decoder layers")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_hidden_layers = num_layers
    layer_types = getattr(text, "layer_types", None)
    if isinstance(layer_types, list) and len(layer_types) > num_layers:
        text.layer_types = layer_types[:num_layers]


def _drop_layers_above(model: nn.Module, num_layers: int | None) -> None:
    """Keep the first ``num_layers`` decoder layers of a built model (a preset: tiny and built whole)."""
    if num_layers is None:
        return
    depth = len(decoder_layers(model))
    _truncate_config(model.config, num_layers, depth)
    stack = backbone(model)
    stack.layers = nn.ModuleList(list(stack.layers)[:num_layers])
    _drop_output_head(model, num_layers, depth)


def _drop_output_head(model: nn.Module, num_layers: int, depth: int) -> None:
    """A target loaded only partway (its full ``depth`` kept in ``DEPTH_ATTR``) serves features: its final norm
    becomes an identity (the backbone still runs to its end) and its LM head (the largest tensor) None, so a call
    for logits fails at once."""
    setattr(model, DEPTH_ATTR, depth)
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
    _truncate_config(config, num_layers, depth)
    model = _skipping_layers_above(config, num_layers, depth).from_pretrained(source, config=config, **kwargs)
    _drop_output_head(model, num_layers, depth)
    return model


def _skipping_layers_above(config: Any, num_layers: int, depth: int) -> Any:
    """The model class of ``config`` with the checkpoint's layers ``num_layers..depth-1`` declared as
    ``_keys_to_ignore_on_load_unexpected``: neither loaded nor reported, any other unexpected key still is.
    A class transformers does not map (remote code) loads as usual."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return AutoModelForCausalLM
    pattern = rf"(^|\.)layers\.({'|'.join(str(i) for i in range(num_layers, depth))})\."
    ignore = [*(cls._keys_to_ignore_on_load_unexpected or ()), pattern]
    return type(cls.__name__, (cls,), {"_keys_to_ignore_on_load_unexpected": ignore, "__module__": cls.__module__})


# -- a target split layer-wise over several devices (a model larger than one GPU)
def layer_devices(num_layers: int, num_devices: int) -> list[int]:
    """The device index of each decoder layer: contiguous runs, balanced by layer count (the later devices
    take one more: the first also holds the embedding)."""
    if num_devices < 1:
        raise ValueError("at least one device is needed")
    if num_devices > num_layers:
        raise ValueError(f"{num_devices} devices for {num_layers} decoder layers: every device needs at least one layer "
                         f"(use at most {num_layers} devices)")
    base, extra = divmod(num_layers, num_devices)
    counts = [base + (1 if d >= num_devices - extra else 0) for d in range(num_devices)]
    return [d for d, n in enumerate(counts) for _ in range(n)]


def _tied(model: nn.Module) -> bool:
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def split_device_map(model: nn.Module, devices: Sequence[str | torch.device]) -> dict[str, str]:
    """Module name -> device (transformers' ``device_map`` form, the largest subtrees on one device): decoder
    layers by :func:`layer_devices`, the final norm and an untied LM head on the last, everything else first."""
    devs = [str(as_device(d)) for d in devices]
    stack = backbone(model)
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(stack.layers)
    plan = layer_devices(len(layers), len(devs))
    placed = {names[id(layer)]: devs[plan[i]] for i, layer in enumerate(layers)}
    norm = getattr(stack, "norm", None)
    if isinstance(norm, nn.Module):
        placed[names[id(norm)]] = devs[-1]
    head = model.get_output_embeddings()
    if head is not None and not _tied(model):
        placed[names[id(head)]] = devs[-1]
    rest: dict[str, str] = {}
    _fill_rest(model, "", placed, devs[0], rest)
    return {**rest, **placed}


def _fill_rest(module: nn.Module, prefix: str, placed: Mapping[str, str], device: str, out: dict[str, str]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path in placed:
            continue
        if any(p.startswith(path + ".") for p in placed):
            _fill_rest(child, path + ".", placed, device, out)
        else:
            out[path] = device


class _ToDevice:
    """Forward pre-hook of every module of one run of modules on a device: moves the tensors among its inputs
    there; the inputs every layer shares are moved once per run (a per-thread cache)."""

    def __init__(self, device: torch.device, first: nn.Module, last: nn.Module) -> None:
        self.device = device
        self.first = first
        self.last = last
        self._local = threading.local()

    def _move(self, x: Any, moved: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device == self.device:
                return x
            hit = moved.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
            y = x.to(self.device)
            moved[id(x)] = (x, y)
            return y
        if isinstance(x, tuple):
            return tuple(self._move(v, moved) for v in x)
        if isinstance(x, list):
            return [self._move(v, moved) for v in x]
        if isinstance(x, dict):
            return {k: self._move(v, moved) for k, v in x.items()}
        return x

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if module is self.first or getattr(self._local, "moved", None) is None:
            self._local.moved = {}
        moved = self._local.moved
        # The residual stream (first argument) comes from the module before: moved, never cached.
        head = tuple(a.to(self.device) if isinstance(a, torch.Tensor) else a for a in args[:1])
        return head + self._move(args[1:], moved), self._move(kwargs, moved)

    def post(self, module: nn.Module, _args: Any, _output: Any) -> None:
        if module is self.last:
            self._local.moved = None


def place_on_devices(model: nn.Module, devices: Sequence[str | torch.device]) -> nn.Module:
    """Split ``model`` over ``devices`` by :func:`split_device_map` (each module moved straight to its own
    device) and hook every module after the first device's run so that its inputs follow it; the map is kept
    as ``model.dflash_device_map``. Unlike accelerate's ``dispatch_model``, the inputs every layer shares cross
    to a device once per run of layers. Hooks go by position in the map (a split over ``cpu`` runs this path)."""
    devs = [as_device(d) for d in devices]
    device_map = split_device_map(model, devs)
    for name, dev in device_map.items():
        model.get_submodule(name).to(dev)
    stack = backbone(model)
    layers = list(stack.layers)
    plan = layer_devices(len(layers), len(devs))
    by_device = itertools.groupby(zip(plan, layers, strict=True), key=lambda t: t[0])
    runs = [[layer for _, layer in run] for _, run in by_device]
    tails = [m for m in (getattr(stack, "norm", None), model.get_output_embeddings()) if isinstance(m, nn.Module)]
    for run in runs[1:] + [[m] for m in tails]:
        hook = _ToDevice(_module_device(run[0]), run[0], run[-1])
        for module in run:
            module.register_forward_pre_hook(hook.pre, with_kwargs=True)
        run[-1].register_forward_hook(hook.post)
    model.dflash_device_map = device_map
    return model


def _module_device(module: nn.Module) -> torch.device:
    t = next(itertools.chain(module.parameters(), module.buffers()), None)
    return t.device if t is not None else torch.device("cpu")
