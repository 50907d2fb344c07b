"""The frozen target model: loading it, reading its hidden states, sharing its embedding and LM head.

Three jobs, all pure (no pipeline runtime):

* :func:`load_target` turns a *spec* (local directory, hub id, or a tiny config preset) into a frozen,
  eval-mode causal LM on a device.
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


def load_target_config(spec: str | os.PathLike | Mapping[str, Any], *, trust_remote_code: bool = False):
    """The target's config without its weights (a preset's, or ``config.json`` of a directory/hub id)."""
    if is_preset(spec):
        config, _ = _preset_config(spec)  # type: ignore[arg-type]
        return config
    from transformers import AutoConfig

    path = Path(os.fspath(spec)).expanduser()
    return AutoConfig.from_pretrained(
        str(path) if path.exists() else os.fspath(spec), local_files_only=path.exists(),
        trust_remote_code=trust_remote_code,
    )


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


def _freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def load_target(
    spec: str | os.PathLike | Mapping[str, Any],
    *,
    device: str | torch.device = "cpu",
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

    The result is in eval mode with ``requires_grad=False`` everywhere, in ``dtype`` (default bf16 on
    accelerators, fp32 on CPU), with ``attn_implementation`` (default flash_attention_2 when it imports on
    CUDA, sdpa otherwise). Remote code runs only when ``trust_remote_code=True``.
    """
    from transformers import AutoModelForCausalLM

    dev = _as_device(device)
    dtype = dtype or default_dtype(dev)
    attn = attn_implementation or default_attn_implementation(dev)
    common = {"dtype": dtype, "attn_implementation": attn, "trust_remote_code": trust_remote_code}

    if is_preset(spec):
        config, seed = _preset_config(spec)  # type: ignore[arg-type]
        # Build on CPU under a private RNG: the weights then depend only on the seed, not on the device
        # or on whatever the caller did with the global RNG before.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, **common)
        return _freeze(model.to(dev))

    path = Path(os.fspath(spec)).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"target spec {str(spec)!r} is a file; expected a model directory")
        model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **common)
        return _freeze(model.to(dev))

    spec_str = os.fspath(spec)
    if not _HUB_ID.match(spec_str):
        raise ValueError(
            f"target spec {spec_str!r} is not a preset ({sorted(TARGET_PRESETS)}), not an existing "
            "directory and not a hub id"
        )
    # The local cache first: it needs no network and works offline.
    try:
        model = AutoModelForCausalLM.from_pretrained(spec_str, local_files_only=True, **common)
    except OSError:
        if not _hub_reachable():
            raise TargetOfflineError(
                f"target {spec_str!r} is not a local directory, not a preset and not in the local "
                "Hugging Face cache, and the hub is unreachable (offline: HF_HUB_OFFLINE/"
                "TRANSFORMERS_OFFLINE set or no network). Pass a local path or a preset such as "
                f"{next(iter(TARGET_PRESETS))!r}."
            ) from None
        model = AutoModelForCausalLM.from_pretrained(spec_str, **common)
    return _freeze(model.to(dev))


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
    """

    def __init__(
        self,
        model: nn.Module,
        target_layer_ids: Sequence[int],
        *,
        dtype: torch.dtype | None = None,
        zero_padding: bool = True,
    ) -> None:
        self.model = model
        self.backbone = _backbone(model)
        self.layers = self.backbone.layers
        num_layers = len(self.layers)
        ids = [int(i) for i in target_layer_ids]
        if not ids:
            raise ValueError("target_layer_ids must not be empty")
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise ValueError(f"target layer ids {bad} are outside [0, {num_layers - 1}] for this target")
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
        device = next(self.backbone.parameters()).device
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
        feats = torch.cat([collected[i] for i in self.target_layer_ids], dim=-1)
        if self.dtype is not None:
            feats = feats.to(self.dtype)
        if self.zero_padding and attention_mask is not None:
            feats = feats * attention_mask.unsqueeze(-1).to(feats.dtype)
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
    model = load_target(spec, device="cpu", dtype=dtype)
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
