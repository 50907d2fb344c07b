"""The target's frozen token embedding and LM head, shared with the drafter (:class:`SharedHead`): taken
from a loaded model, read from a safetensors checkpoint without the rest of the weights, or rebuilt from a
preset's seed; once per (target, device, dtype)."""

from __future__ import annotations

import json
import os
import threading
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from dflash_flow.model.device import as_device
from dflash_flow.model.target import is_preset, load_target, preset_init_device


class SharedHead(nn.Module):
    """The target's frozen token embedding and LM head, as used by the drafter. ``embed(ids)`` is the raw
    lookup (the drafter applies its own ``input_embedding_scale``, as z-lab does); with tied embeddings both
    modules hold the very same tensor."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor,
                 lm_head_bias: torch.Tensor | None = None) -> None:
        super().__init__()
        vocab, hidden = embed_weight.shape
        if lm_head_weight.shape[1] != hidden:
            raise ValueError(f"lm_head {tuple(lm_head_weight.shape)} does not match embedding {tuple(embed_weight.shape)}")
        self.embed_tokens = nn.Embedding(vocab, hidden, device="meta")
        self.embed_tokens.weight = nn.Parameter(embed_weight, requires_grad=False)
        self.lm_head = nn.Linear(hidden, lm_head_weight.shape[0], bias=lm_head_bias is not None, device="meta")
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

    # The two accessors of a HF causal LM that decoding asks its target for: a drafter can be driven with the
    # head alone (the held-out probe during training).
    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def train(self, mode: bool = True) -> SharedHead:
        # Frozen by construction: there is no training mode to switch into.
        return super().train(False)


_HEAD_LOCK = threading.Lock()
# Keyed weakly by the model object itself (a freed target frees its heads), then by (device, dtype).
_MODEL_HEADS: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, torch.dtype], SharedHead]] = weakref.WeakKeyDictionary()
# Checkpoint directories (absolute) and presets (a name or JSON) by (source, device, dtype).
_HEADS: dict[tuple[str, str, torch.dtype | None], SharedHead] = {}


def clear_shared_head_cache() -> None:
    with _HEAD_LOCK:
        _MODEL_HEADS.clear()
        _HEADS.clear()


def _copy_head(embed: nn.Module, head: nn.Module, place: Any) -> SharedHead:
    """A SharedHead of ``place(t)`` of the embedding and head tensors; tied (HF shares the Parameter: storage
    compared), one tensor for both."""
    embed_w = place(embed.weight)
    head_w = embed_w if head.weight.data_ptr() == embed.weight.data_ptr() else place(head.weight)
    bias = getattr(head, "bias", None)
    return SharedHead(embed_w, head_w, None if bias is None else place(bias))


def shared_head_from_model(model: nn.Module, device: str | torch.device = "cpu",
                           dtype: torch.dtype | None = None) -> SharedHead:
    """The frozen embedding and LM head of a loaded target, on ``device`` (cached per model, device, dtype)."""
    dev = as_device(device)
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
        # `.to` returns the same storage when nothing changes: on the target's own device the head costs nothing.
        built = per_model[key] = _copy_head(embed, head, lambda t: t.detach().to(device=dev, dtype=dtype))
        return built


_EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight",
               "language_model.model.embed_tokens.weight", "transformer.wte.weight")
_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight")


def _weight_map(directory: Path) -> dict[str, Path]:
    """tensor name -> safetensors file, from the index when sharded, else by reading file headers."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return {k: directory / v for k, v in json.loads(index.read_text())["weight_map"].items()}
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


def shared_head_from_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu",
                                dtype: torch.dtype | None = None) -> SharedHead:
    """Read only the embedding and LM head tensors of a safetensors checkpoint directory (sharded or not);
    ``tie_word_embeddings`` (or a missing ``lm_head.weight``) reuses the embedding. Cached."""
    from safetensors import safe_open

    directory = Path(path).expanduser().resolve()
    dev = as_device(device)
    key = (str(directory), str(dev), dtype)
    with _HEAD_LOCK:
        cached = _HEADS.get(key)
        if cached is not None:
            return cached
        config_file = directory / "config.json"
        config: dict[str, Any] = json.loads(config_file.read_text()) if config_file.exists() else {}
        text_config = config.get("text_config") or {}
        tied = config.get("tie_word_embeddings", text_config.get("tie_word_embeddings"))
        mapping = _weight_map(directory)
        embed_key = _find_key(mapping, _EMBED_KEYS, "embed_tokens.weight")
        if embed_key is None:
            raise KeyError(f"no embedding tensor (…embed_tokens.weight) in {directory}")
        head_key = _find_key(mapping, _HEAD_KEYS, "lm_head.weight")
        if head_key is None and tied is False:
            raise KeyError(f"{directory}: tie_word_embeddings is false but there is no lm_head.weight")

        def read(k: str) -> torch.Tensor:
            # safetensors reads just this tensor (memory-mapped), straight onto the device.
            with safe_open(str(mapping[k]), framework="pt", device=str(dev)) as f:
                t = f.get_tensor(k)
            return t if dtype is None else t.to(dtype)

        embed_w = read(embed_key)
        head_w = embed_w if tied or head_key is None else read(head_key)
        bias_key = head_key[: -len("weight")] + "bias" if head_key else None
        bias = read(bias_key) if bias_key and bias_key in mapping and not tied else None
        built = SharedHead(embed_w, head_w, bias)
        _HEADS[key] = built
        return built


def shared_head_from_preset(spec: str | Mapping[str, Any], device: str | torch.device = "cpu",
                            dtype: torch.dtype | None = None) -> SharedHead:
    """The head of a config-preset target (name or dict), cached by its parameters and seed (its weights
    depend only on them); the temporary full model is dropped after its two tensors are copied out."""
    dev = as_device(device)
    name = spec if isinstance(spec, str) else json.dumps(dict(spec), sort_keys=True, default=str)
    key = (name, str(dev), dtype)
    with _HEAD_LOCK:
        cached = _HEADS.get(key)
    if cached is not None:
        return cached
    model = load_target(spec, device=preset_init_device(spec), dtype=dtype)
    # Copies (clone) so that the head does not keep the whole temporary model's storage alive.
    built = _copy_head(model.get_input_embeddings(), model.get_output_embeddings(),
                       lambda t: t.detach().to(dev).clone())
    with _HEAD_LOCK:
        # Two threads may have built it concurrently; keep the first so every caller shares one.
        return _HEADS.setdefault(key, built)


def load_shared_head(spec: str | os.PathLike | Mapping[str, Any], device: str | torch.device = "cpu",
                     dtype: torch.dtype | None = None, *, trust_remote_code: bool = False) -> SharedHead:
    """The frozen embedding and LM head of the target named by ``spec`` on ``device``: a preset rebuilt from its
    seed, a directory read for just those two tensors, a hub id loaded once on the CPU."""
    if is_preset(spec) or Path(os.fspath(spec)).expanduser().is_dir():
        return shared_head(spec, device, dtype)
    model = load_target(spec, device="cpu", dtype=dtype, trust_remote_code=trust_remote_code)
    return shared_head(model, device, dtype)


def shared_head(source: nn.Module | str | os.PathLike | Mapping[str, Any], device: str | torch.device = "cpu",
                dtype: torch.dtype | None = None) -> SharedHead:
    """The shared head of ``source``: a loaded model, a preset name or dict, or a safetensors checkpoint
    directory; each built once per (source, device, dtype)."""
    if isinstance(source, nn.Module):
        return shared_head_from_model(source, device, dtype)
    if is_preset(source):
        return shared_head_from_preset(source, device, dtype)
    return shared_head_from_checkpoint(source, device, dtype)
