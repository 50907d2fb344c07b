"""The frozen target model: loading it, reading its hidden states, sharing its embedding and LM head.

Three jobs, all pure (no pipeline runtime):

* :func:`load_target` turns a *spec* (local directory, hub id, or a tiny config preset) into a frozen,
  eval-mode causal LM on a device, or split layer-wise over several devices (a target larger than one
  GPU), optionally loaded only as deep as the deepest layer it will run.
* :class:`TargetFeatureExtractor` runs the target only as deep as the deepest requested layer and returns
  the DFlash context features ``concat(hidden_states[id + 1] for id in target_layer_ids)``, aligned 1:1
  with ``input_ids`` (no shift).
* :class:`SharedHead` / :func:`shared_head` give the drafter the target's frozen ``embed_tokens`` and
  ``lm_head`` on any device, once per (target, device, dtype), either taken from a loaded model or read
  from a safetensors checkpoint without loading the rest of the weights.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
import socket
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
from torch import nn
from torch.nn import functional as F

__all__ = [
    "TARGET_PRESETS",
    "TargetOfflineError",
    "TargetFeatureExtractor",
    "SharedHead",
    "load_target",
    "load_target_config",
    "layer_devices",
    "num_hidden_layers",
    "peek_target_depth",
    "place_on_devices",
    "split_device_map",
    "target_depth",
    "load_shared_head",
    "resolve_dtype",
    "is_preset",
    "default_dtype",
    "default_attn_implementation",
    "decoder_layers",
    "shared_head",
    "shared_head_from_model",
    "shared_head_from_checkpoint",
    "shared_head_from_preset",
    "clear_shared_head_cache",
]


# ---------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------

# Tiny random-weight targets for CPU runs and tests. Eight or more layers, because the DFlash layer-id
# rule (spread over [1, L-3]) repeats ids on shallower targets. `seed` fixes the random weights, so the
# same preset always yields the same model. Any key may be overridden by passing a dict spec
# {"preset": name, **overrides}.
_TINY_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "seed": 0,
}

TARGET_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-qwen3-8l": {"model_type": "qwen3", **_TINY_COMMON},
    "tiny-qwen3-8l-tied": {"model_type": "qwen3", **_TINY_COMMON, "tie_word_embeddings": True},
    "tiny-qwen3-12l": {
        "model_type": "qwen3",
        **_TINY_COMMON,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 12,
        "head_dim": 32,
    },
    "tiny-llama-8l": {"model_type": "llama", **_TINY_COMMON},
}


class TargetOfflineError(RuntimeError):
    """A hub id was requested but the hub cannot be reached (offline) and the model is not cached."""


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def _as_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    # "cuda" and "cuda:0" must be the same cache key and the same placement.
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on accelerators (the dtype the released drafters were trained against), fp32 on CPU
    (CPU bf16 matmuls are slow and lossy, and tests compare at 1e-5)."""
    return torch.float32 if _as_device(device).type == "cpu" else torch.bfloat16


def default_attn_implementation(device: str | torch.device) -> str:
    """flash_attention_2 only where it can actually run (CUDA and the package imports); sdpa otherwise.
    flash-attn is an optional extra and cannot even be built on CPU-only machines."""
    if _as_device(device).type == "cuda":
        try:
            import flash_attn  # noqa: F401
        except Exception:  # ImportError, or a broken CUDA build raising at import
            return "sdpa"
        return "flash_attention_2"
    return "sdpa"


def _preset_init_device(spec: Mapping[str, Any] | str) -> str:
    """Where a preset's random weights are drawn: ``cpu`` (default: the weights depend only on the seed)
    or an accelerator (``init_device: cuda``: a large random target, e.g. for ``bench/gpu.py``, is built in
    seconds where it runs instead of minutes on the host; its weights then depend on the seed and the
    device type)."""
    return str(spec.get("init_device", "cpu")) if isinstance(spec, Mapping) else "cpu"


def _preset_config(spec: Mapping[str, Any] | str) -> tuple[Any, int]:
    """Resolve a preset name or dict into (transformers config, seed)."""
    from transformers import AutoConfig

    if isinstance(spec, str):
        params = dict(TARGET_PRESETS[spec])
    else:
        params = dict(spec)
        base = params.pop("preset", None)
        if base is not None:
            if base not in TARGET_PRESETS:
                raise ValueError(f"unknown target preset {base!r}; known: {sorted(TARGET_PRESETS)}")
            params = {**TARGET_PRESETS[base], **params}
    seed = int(params.pop("seed", 0))
    params.pop("init_device", None)
    model_type = params.pop("model_type", "qwen3")
    return AutoConfig.for_model(model_type, **params), seed


def resolve_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """A dtype from its config name; ``auto`` (or None) is :func:`default_dtype` for the device."""
    if name in (None, "auto"):
        return default_dtype(device)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16") from None


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
    spec_str = _hub_id(spec)

    def read(local: bool):
        return AutoConfig.from_pretrained(
            spec_str, local_files_only=local, trust_remote_code=trust_remote_code
        )

    if local_only:
        return read(True)
    return _cache_then_hub(read, spec_str)


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


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """A cheap TCP probe of the hub endpoint; only ever called for a spec that is a hub id."""
    if _env_flag("HF_HUB_OFFLINE") or _env_flag("TRANSFORMERS_OFFLINE"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = url.hostname or "huggingface.co"
    port = url.port or (443 if url.scheme != "http" else 80)
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


def _hub_id(spec: str | os.PathLike) -> str:
    spec_str = os.fspath(spec)
    if not _HUB_ID.match(spec_str):
        raise ValueError(
            f"target spec {spec_str!r} is not a preset ({sorted(TARGET_PRESETS)}), not an existing "
            "directory and not a hub id"
        )
    return spec_str


def _cache_then_hub(read, spec_str: str):
    """``read(local_files_only)``: the local cache first (no network, works offline), the hub only when
    it can be reached."""
    try:
        return read(True)
    except OSError:
        if not _hub_reachable():
            raise TargetOfflineError(
                f"target {spec_str!r} is not a local directory, not a preset and not in the local "
                "Hugging Face cache, and the hub is unreachable (offline: HF_HUB_OFFLINE/"
                "TRANSFORMERS_OFFLINE set or no network). Pass a local path or a preset such as "
                f"{next(iter(TARGET_PRESETS))!r}."
            ) from None
        return read(False)


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
    from transformers import AutoModelForCausalLM

    if device is not None and devices:
        raise ValueError("pass either device or devices, not both")
    placement = [_as_device(d) for d in (devices or [device or "cpu"])]
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    dtype = dtype or default_dtype(placement[0])
    attn = attn_implementation or default_attn_implementation(placement[0])
    common = {"dtype": dtype, "attn_implementation": attn, "trust_remote_code": trust_remote_code}

    if is_preset(spec):
        config, seed = _preset_config(spec)  # type: ignore[arg-type]
        # Build on CPU under a private RNG: the weights then depend only on the seed, not on the device
        # or on whatever the caller did with the global RNG before.
        init = torch.device(_preset_init_device(spec))
        rng_devices = [init.index or 0] if init.type == "cuda" else []
        with torch.random.fork_rng(devices=rng_devices), init:
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, **common)
        _drop_layers_above(model, num_layers)
        return _placed(model, placement)

    path = Path(os.fspath(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"target spec {str(spec)!r} is a file; expected a model directory")
        config = load_target_config(path, trust_remote_code=trust_remote_code) if num_layers else None
        return _placed(_from_pretrained(path, config, num_layers, local_files_only=True, **common), placement)
    spec_str = _hub_id(spec)
    config = load_target_config(spec_str, trust_remote_code=trust_remote_code) if num_layers else None

    def read_hub(local: bool):
        return _from_pretrained(spec_str, config, num_layers, local_files_only=local, **common)

    return _placed(_cache_then_hub(read_hub, spec_str), placement)


def _placed(model: nn.Module, placement: list[torch.device]) -> nn.Module:
    if len(placement) == 1:
        return _freeze(model.to(placement[0]))
    return _freeze(place_on_devices(model, placement))


# -- loading only as deep as needed ----------------------------------------------------------------

_DEPTH_ATTR = "dflash_target_depth"  # the full depth of a target loaded only partway


def target_depth(model: nn.Module) -> int:
    """Decoder layers of the full target, also when only the first few were loaded (``num_layers``)."""
    return int(getattr(model, _DEPTH_ATTR, None) or len(decoder_layers(model)))


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
    backbone = _backbone(model)
    backbone.layers = nn.ModuleList(list(backbone.layers)[:num_layers])
    _truncate_config(model.config, num_layers)
    setattr(model, _DEPTH_ATTR, depth)


# Layer keys of a checkpoint: `...layers.<i>.` (the text stack of every supported family).
_LAYER_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PARTIAL_LOAD: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "dflash_flow_partial_load", default=False
)
_log = logging.getLogger(__name__)


class _PartialLoadReport(logging.Filter):
    """Drops transformers' load report during a partial load when it lists only UNEXPECTED keys: the
    layers above ``num_layers`` are in the checkpoint on purpose. We check those keys ourselves
    (``_check_skipped``), so a truly unexpected key is still reported."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not _PARTIAL_LOAD.get():
            return True
        text = record.getMessage()
        return "LOAD REPORT" not in text or any(w in text for w in ("MISSING", "MISMATCH", "CONVERSION"))


_REPORT_FILTER = _PartialLoadReport()


def _from_pretrained(source: str | Path, config: Any, num_layers: int | None, **kwargs: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    if num_layers is None:
        return AutoModelForCausalLM.from_pretrained(source, **kwargs)
    depth = num_hidden_layers(config)
    _check_depth(num_layers, depth)
    _truncate_config(config, num_layers)
    hf_logger = logging.getLogger("transformers.modeling_utils")
    if _REPORT_FILTER not in hf_logger.filters:
        hf_logger.addFilter(_REPORT_FILTER)
    token = _PARTIAL_LOAD.set(True)
    try:
        model, info = AutoModelForCausalLM.from_pretrained(
            source, config=config, output_loading_info=True, **kwargs
        )
    finally:
        _PARTIAL_LOAD.reset(token)
    _check_skipped(info.get("unexpected_keys", ()), num_layers, source)
    setattr(model, _DEPTH_ATTR, depth)
    return model


def _check_skipped(unexpected: Any, num_layers: int, source: str | Path) -> None:
    """Warn about checkpoint keys that are unexpected for another reason than being above ``num_layers``."""
    odd = sorted(k for k in unexpected if not ((m := _LAYER_KEY.search(k)) and int(m.group(1)) >= num_layers))
    if odd:
        _log.warning("target %s: checkpoint tensors not used by the model: %s", source, ", ".join(odd[:10]))


# -- splitting over several devices ----------------------------------------------------------------


def layer_devices(num_layers: int, num_devices: int) -> list[int]:
    """The device index of each decoder layer: contiguous runs, balanced by layer count. When the layers
    do not divide evenly the later devices take one more, since the first also holds the embedding."""
    if num_devices < 1:
        raise ValueError("at least one device is needed")
    if num_devices > num_layers:
        raise ValueError(
            f"{num_devices} devices for {num_layers} decoder layers: every device needs at least one layer "
            f"(use at most {num_layers} devices)"
        )
    base, extra = divmod(num_layers, num_devices)
    counts = [base + (1 if d >= num_devices - extra else 0) for d in range(num_devices)]
    return [d for d, n in enumerate(counts) for _ in range(n)]


def _tied(model: nn.Module) -> bool:
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    return head is not None and embed is not None and head.weight is embed.weight


def split_device_map(model: nn.Module, devices: Sequence[str | torch.device]) -> dict[str, str]:
    """Module name -> device, in transformers' ``device_map`` form: decoder layers by
    :func:`layer_devices`; the final norm and an untied LM head on the last device; everything else (the
    embedding, rotary embedding, a tied LM head, other towers) on the first. Keys are the largest
    subtrees on one device."""
    devs = [str(_as_device(d)) for d in devices]
    backbone = _backbone(model)
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(backbone.layers)
    plan = layer_devices(len(layers), len(devs))
    placed = {names[id(layer)]: devs[plan[i]] for i, layer in enumerate(layers)}
    norm = getattr(backbone, "norm", None)
    if isinstance(norm, nn.Module):
        placed[names[id(norm)]] = devs[-1]
    head = model.get_output_embeddings()
    if head is not None and not _tied(model):
        placed[names[id(head)]] = devs[-1]
    rest: dict[str, str] = {}
    _fill_rest(model, "", placed, devs[0], rest)
    return {**rest, **placed}


def _fill_rest(
    module: nn.Module, prefix: str, placed: Mapping[str, str], device: str, out: dict[str, str]
) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        if path in placed:
            continue
        if any(p.startswith(path + ".") for p in placed):
            _fill_rest(child, path + ".", placed, device, out)
        else:
            out[path] = device


class _ToDevice:
    """Forward pre-hook of every module of one run of modules on a device: moves the tensors among its
    inputs there. The inputs every layer shares (mask, rotary cos/sin, position ids) are moved once per
    run and reused by the run's other layers; the cache is per thread (concurrent callers), reset by the
    run's first module and cleared after its last."""

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
    """Split ``model`` over ``devices`` by :func:`split_device_map` (each module moved straight to its
    own device, so the whole model never sits on one) and hook every module after the first device's
    run so that its inputs follow it (what accelerate's ``dispatch_model`` does; accelerate is not a
    dependency). The map is kept as ``model.dflash_device_map``.

    The hooks are installed by position in the map, not by whether two devices differ: a split over
    ``cpu`` entries (the tests' CPU "devices") runs exactly this path, its moves being no-ops."""
    devs = [_as_device(d) for d in devices]
    device_map = split_device_map(model, devs)
    for name, dev in device_map.items():
        model.get_submodule(name).to(dev)
    backbone = _backbone(model)
    layers = list(backbone.layers)
    plan = layer_devices(len(layers), len(devs))
    runs: list[list[nn.Module]] = []
    for i, layer in enumerate(layers):
        if i and plan[i] == plan[i - 1]:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    tails = [
        m
        for m in (getattr(backbone, "norm", None), model.get_output_embeddings())
        if isinstance(m, nn.Module)
    ]
    for run in runs[1:] + [[m] for m in tails]:
        hook = _ToDevice(_module_device(run[0]), run[0], run[-1])
        for module in run:
            module.register_forward_pre_hook(hook.pre, with_kwargs=True)
        run[-1].register_forward_hook(hook.post)
    model.dflash_device_map = device_map
    return model


def _module_device(module: nn.Module) -> torch.device:
    for p in module.parameters():
        return p.device
    for b in module.buffers():
        return b.device
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------
# Feature extraction
# ---------------------------------------------------------------------------------------------------


def _backbone(model: nn.Module) -> nn.Module:
    """The decoder stack module that owns ``layers`` (``model.model`` for Qwen3/Llama ForCausalLM)."""
    for candidate in (model, getattr(model, "model", None)):
        if candidate is None:
            continue
        if isinstance(getattr(candidate, "layers", None), nn.ModuleList):
            return candidate
        # Multimodal wrappers (Qwen3.5-style) keep the text stack one level further down.
        lm = getattr(candidate, "language_model", None)
        if lm is not None and isinstance(getattr(lm, "layers", None), nn.ModuleList):
            return lm
    raise TypeError(f"cannot find the decoder layers of {type(model).__name__} (expected model.model.layers)")


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The target's decoder layers (``model.model.layers`` for Qwen3/Llama)."""
    return _backbone(model).layers


class _ReachedDeepestLayer(Exception):
    """Raised by the hook on the deepest requested layer to end the target forward early."""


class TargetFeatureExtractor:
    """DFlash context features of a frozen target, computed no deeper than needed.

    ``extractor(input_ids, attention_mask)`` returns ``[b, S, n * H]``: the concatenation, in
    ``target_layer_ids`` order, of the residual stream after each decoder layer ``id`` (HF
    ``output_hidden_states[id + 1]``), aligned 1:1 with ``input_ids``. Positions where ``attention_mask`` is 0
    (right padding) are zeroed, the same value collation gives padded features.

    How it stops early: the model's own backbone forward runs (so embedding scaling, rotary embedding
    and the per-layer-type masks are exactly the model's), and forward hooks on the requested layers
    record their outputs; the hook on the deepest one raises, which ends the forward there. Layers above
    it, the final norm and the LM head never run. The hooks exist only during a call and act only in the
    calling context (a ContextVar), so concurrent callers on the same model do not see each other.

    On a model split over several devices (:func:`place_on_devices`) the inputs go to the embedding's
    device and each chosen layer's output is gathered onto ``output_device`` (default: the embedding's
    device), e.g. the drafter's GPU, before concatenation. A model loaded only partway (``num_layers``)
    works as long as it reaches the deepest requested layer.
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        zero_padding: bool = True,
        output_device: str | torch.device | None = None,
    ) -> None:
        self.model = model
        self.backbone = _backbone(model)
        self.layers = self.backbone.layers
        num_layers = target_depth(model)
        ids = [int(i) for i in target_layer_ids]
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"target layer ids {bad} are outside [0, {num_layers - 1}] for this target")
        unloaded = [i for i in ids if i >= len(self.layers)]
        if unloaded:
            raise ValueError(
                f"target layer ids {unloaded} were not loaded: this target was loaded only {len(self.layers)} "
                f"of its {num_layers} layers deep"
            )
        self.output_device = None if output_device is None else _as_device(output_device)
        self.target_layer_ids = ids
        self.num_target_layers = num_layers
        self.deepest = max(ids)
        self.dtype = dtype
        self.zero_padding = zero_padding
        # The text stack's own config: multimodal wrappers keep hidden_size there, not at the top.
        stack_config = getattr(self.backbone, "config", None) or getattr(model, "config", None)
        self.hidden_size = int(getattr(stack_config, "hidden_size", 0) or 0) or None
        # HF replaces the last entry of `hidden_states` by the final-normed `last_hidden_state`
        # (`tie_last_hidden_states`, default on for LMs). Requesting the last layer therefore means the
        # post-norm state; we then run the whole backbone instead of stopping, to match HF exactly.
        config = getattr(self.backbone, "config", None)
        self._last_is_normed = getattr(config, "tie_last_hidden_states", None) is not False
        self._collect: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
            f"dflash_flow_target_features_{id(self)}", default=None
        )

    @property
    def feature_dim(self) -> int | None:
        """n * H, the width of the returned features (None if the config has no hidden_size)."""
        return None if self.hidden_size is None else self.hidden_size * len(self.target_layer_ids)

    @property
    def layers_run(self) -> int:
        """How many decoder layers one call executes."""
        return self.deepest + 1

    def _hook(self, index: int):
        def hook(_module, _args, output):
            collected = self._collect.get()
            if collected is None:  # another caller's forward on the same model: not ours
                return None
            collected[index] = output[0] if isinstance(output, tuple) else output
            if index == self.deepest and not self._stops_at_end:
                raise _ReachedDeepestLayer
            return None

        return hook

    @property
    def _stops_at_end(self) -> bool:
        return self.deepest == self.num_target_layers - 1 and self._last_is_normed

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Features ``[b, S, n * H]`` for right-padded ``input_ids [b, S]`` (or ``[S]``).

        ``position_ids`` defaults to ``0..S-1`` per row, which is right for right padding; pass them
        only for layouts where that is not true.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        embed = self.model.get_input_embeddings()
        device = embed.weight.device if embed is not None else next(self.backbone.parameters()).device
        input_ids = input_ids.to(device)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device)
        extra = {} if position_ids is None else {"position_ids": position_ids.to(device)}

        collected: dict[int, torch.Tensor] = {}
        wanted = sorted(set(self.target_layer_ids))
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in wanted]
        token = self._collect.set(collected)
        last_hidden = None
        try:
            with torch.inference_mode():
                try:
                    out = self.backbone(
                        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **extra
                    )
                    last_hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
                except _ReachedDeepestLayer:
                    pass
        finally:
            self._collect.reset(token)
            for h in handles:
                h.remove()

        if self._stops_at_end:
            collected[self.deepest] = last_hidden
        missing = [i for i in wanted if i not in collected]
        if missing:
            raise RuntimeError(
                f"target layers {missing} did not run; is {type(self.backbone).__name__} a "
                "decoder that calls its layers in order?"
            )
        # Concatenate outside inference mode: the result is then an ordinary tensor that a trainer may
        # feed into autograd (inference tensors cannot be saved for backward).
        # Each layer's output is gathered onto the output device first (on a split model they lie on
        # several devices).
        out = self.output_device or device
        feats = torch.cat([collected[i].to(out) for i in self.target_layer_ids], dim=-1)
        if self.dtype is not None:
            feats = feats.to(self.dtype)
        if self.zero_padding and attention_mask is not None:
            feats = feats * attention_mask.to(out).unsqueeze(-1).to(feats.dtype)
        return feats


# ---------------------------------------------------------------------------------------------------
# Shared embedding and LM head
# ---------------------------------------------------------------------------------------------------


class SharedHead(nn.Module):
    """The target's frozen token embedding and LM head, as used by the drafter.

    ``embed(ids)`` is the raw embedding lookup (``F.embedding`` on the weight, no model-specific scaling:
    the drafter applies its own ``input_embedding_scale``, as z-lab's inference does). ``logits(h)`` is
    ``lm_head(h)``. With tied embeddings both modules hold the very same tensor.
    """

    def __init__(
        self,
        embed_weight: torch.Tensor,
        lm_head_weight: torch.Tensor,
        lm_head_bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        vocab, hidden = embed_weight.shape
        if lm_head_weight.shape[1] != hidden:
            raise ValueError(
                f"lm_head {tuple(lm_head_weight.shape)} does not match embedding {tuple(embed_weight.shape)}"
            )
        self.embed_tokens = nn.Embedding(vocab, hidden, device="meta")
        self.embed_tokens.weight = nn.Parameter(embed_weight, requires_grad=False)
        self.lm_head = nn.Linear(
            hidden, lm_head_weight.shape[0], bias=lm_head_bias is not None, device="meta"
        )
        self.lm_head.weight = nn.Parameter(lm_head_weight, requires_grad=False)
        if lm_head_bias is not None:
            self.lm_head.bias = nn.Parameter(lm_head_bias, requires_grad=False)
        self.eval()

    @property
    def tied(self) -> bool:
        return self.embed_tokens.weight.data_ptr() == self.lm_head.weight.data_ptr()

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed_tokens.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_tokens.weight)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def train(self, mode: bool = True) -> SharedHead:
        # Frozen by construction: there is no training mode to switch into.
        return super().train(False)


_HEAD_LOCK = threading.Lock()
# Keyed by the model object itself (weakly: a freed target frees its heads, and a recycled id() can
# never return a stale head), then by (device, dtype).
_MODEL_HEADS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, torch.dtype], SharedHead]] = (
    weakref.WeakKeyDictionary()
)
_CHECKPOINT_HEADS: dict[tuple[str, str, torch.dtype | None], SharedHead] = {}
_PRESET_HEADS: dict[tuple[str, str, torch.dtype | None], SharedHead] = {}


def clear_shared_head_cache() -> None:
    with _HEAD_LOCK:
        _MODEL_HEADS.clear()
        _CHECKPOINT_HEADS.clear()
        _PRESET_HEADS.clear()


def _place(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    # `.to` returns the same storage when nothing changes: on the target's own device the head then
    # costs no memory at all.
    return t.detach().to(device=device, dtype=dtype)


def shared_head_from_model(
    model: nn.Module, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> SharedHead:
    """The frozen embedding and LM head of a loaded target, on ``device``; built once per
    (model, device, dtype) and then returned from the cache."""
    dev = _as_device(device)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if head is None:  # some wrappers expose only `lm_head`
        head = getattr(model, "lm_head", None)
    if embed is None or head is None:
        raise TypeError(f"{type(model).__name__} has no input embedding / LM head")
    dtype = dtype or embed.weight.dtype
    key = (str(dev), dtype)
    with _HEAD_LOCK:
        per_model = _MODEL_HEADS.setdefault(model, {})
        cached = per_model.get(key)
        if cached is not None:
            return cached
        embed_w = _place(embed.weight, dev, dtype)
        # Tied: one tensor for both (HF ties by sharing the Parameter, so compare storage).
        if head.weight.data_ptr() == embed.weight.data_ptr():
            head_w = embed_w
        else:
            head_w = _place(head.weight, dev, dtype)
        bias = getattr(head, "bias", None)
        built = SharedHead(embed_w, head_w, None if bias is None else _place(bias, dev, dtype))
        per_model[key] = built
        return built


_EMBED_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "transformer.wte.weight",
)
_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def _weight_map(directory: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when sharded, else by reading file headers."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            return {k: directory / v for k, v in json.load(f)["weight_map"].items()}
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {directory}")
    mapping: dict[str, Path] = {}
    for file in files:  # only headers are read here
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                mapping[k] = file
    return mapping


def _find_key(mapping: Mapping[str, Path], preferred: Sequence[str], suffix: str) -> str | None:
    for k in preferred:
        if k in mapping:
            return k
    matches = sorted(k for k in mapping if k.endswith(suffix))
    return matches[0] if matches else None


def _read_tensor(file: Path, key: str, device: torch.device) -> torch.Tensor:
    from safetensors import safe_open

    # safetensors reads just this tensor (memory-mapped), straight onto the device.
    with safe_open(str(file), framework="pt", device=str(device)) as f:
        return f.get_tensor(key)


def shared_head_from_checkpoint(
    path: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> SharedHead:
    """Read only the embedding and LM head tensors of a safetensors checkpoint directory (sharded or
    not); ``tie_word_embeddings`` in config.json (or a missing ``lm_head.weight``) reuses the embedding.
    Cached per (directory, device, dtype)."""
    directory = Path(path).expanduser().resolve()
    dev = _as_device(device)
    key = (str(directory), str(dev), dtype)
    with _HEAD_LOCK:
        cached = _CHECKPOINT_HEADS.get(key)
        if cached is not None:
            return cached
        config: dict[str, Any] = {}
        if (directory / "config.json").exists():
            with open(directory / "config.json") as f:
                config = json.load(f)
        text_config = config.get("text_config") or {}
        tied = config.get("tie_word_embeddings", text_config.get("tie_word_embeddings"))
        mapping = _weight_map(directory)
        embed_key = _find_key(mapping, _EMBED_KEYS, "embed_tokens.weight")
        if embed_key is None:
            raise KeyError(f"no embedding tensor (…embed_tokens.weight) in {directory}")
        head_key = _find_key(mapping, _HEAD_KEYS, "lm_head.weight")
        if head_key is None and tied is False:
            raise KeyError(f"{directory}: tie_word_embeddings is false but there is no lm_head.weight")
        embed_w = _read_tensor(mapping[embed_key], embed_key, dev)
        if dtype is not None:
            embed_w = embed_w.to(dtype)
        if tied or head_key is None:
            head_w = embed_w
        else:
            head_w = _read_tensor(mapping[head_key], head_key, dev)
            if dtype is not None:
                head_w = head_w.to(dtype)
        bias_key = head_key[: -len("weight")] + "bias" if head_key else None
        bias = None
        if bias_key and bias_key in mapping and not tied:
            bias = _read_tensor(mapping[bias_key], bias_key, dev)
            if dtype is not None:
                bias = bias.to(dtype)
        built = SharedHead(embed_w, head_w, bias)
        _CHECKPOINT_HEADS[key] = built
        return built


def shared_head_from_preset(
    spec: str | Mapping[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> SharedHead:
    """The head of a config-preset target (name or dict). The preset's weights depend only on its
    parameters and seed, so the head is cached by them: built once per (preset, device, dtype), and the
    temporary full model is dropped after its two tensors are copied out."""
    dev = _as_device(device)
    name = spec if isinstance(spec, str) else json.dumps(dict(spec), sort_keys=True, default=str)
    key = (name, str(dev), dtype)
    with _HEAD_LOCK:
        cached = _PRESET_HEADS.get(key)
    if cached is not None:
        return cached
    model = load_target(spec, device=_preset_init_device(spec), dtype=dtype)
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    # Copies (clone) so that the head does not keep the whole temporary model's storage alive.
    embed_w = embed.detach().to(dev).clone()
    head_w = embed_w if head.weight.data_ptr() == embed.data_ptr() else head.weight.detach().to(dev).clone()
    bias = getattr(head, "bias", None)
    built = SharedHead(embed_w, head_w, None if bias is None else bias.detach().to(dev).clone())
    with _HEAD_LOCK:
        # Two threads may have built it concurrently; keep the first so every caller shares one.
        return _PRESET_HEADS.setdefault(key, built)


def load_shared_head(
    spec: str | os.PathLike | Mapping[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    *,
    trust_remote_code: bool = False,
) -> SharedHead:
    """The frozen embedding and LM head of the target named by ``spec`` on ``device``: a preset is rebuilt
    from its seed (the TargetForward's exact weights), a directory is read for just those two tensors, a
    hub id is loaded once on the CPU."""
    if is_preset(spec) or Path(os.fspath(spec)).expanduser().is_dir():
        return shared_head(spec, device, dtype)
    model = load_target(spec, device="cpu", dtype=dtype, trust_remote_code=trust_remote_code)
    return shared_head(model, device, dtype)


def shared_head(
    source: nn.Module | str | os.PathLike | Mapping[str, Any],
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> SharedHead:
    """The shared head of ``source``: a loaded model (:func:`shared_head_from_model`), a preset name or
    dict (:func:`shared_head_from_preset`), or a safetensors checkpoint directory
    (:func:`shared_head_from_checkpoint`). Each is built once per (source, device, dtype)."""
    if isinstance(source, nn.Module):
        return shared_head_from_model(source, device, dtype)
    if is_preset(source):
        return shared_head_from_preset(source, device, dtype)
    return shared_head_from_checkpoint(source, device, dtype)
