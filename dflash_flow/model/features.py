"""The target's DFlash context features, computed no deeper than needed (:class:`TargetFeatureExtractor`),
and where a causal LM keeps its decoder layers."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence

import torch
from torch import nn

from dflash_flow.model.device import as_device, side_streams

#: Set on a target loaded only partway (``load_target(num_layers=...)``): the full target's depth.
DEPTH_ATTR = "dflash_target_depth"


def backbone(model: nn.Module) -> nn.Module:
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
    return backbone(model).layers


def target_depth(model: nn.Module) -> int:
    """Decoder layers of the full target, also when only the first few were loaded (``num_layers``)."""
    return int(getattr(model, DEPTH_ATTR, None) or len(decoder_layers(model)))


class _ReachedDeepestLayer(Exception):
    """Raised by the hook on the deepest requested layer to end the target forward early."""


class TargetFeatureExtractor:
    """``extractor(input_ids, attention_mask)``: ``[b, S, n * H]``, the residual stream after each layer of
    ``target_layer_ids`` (HF ``output_hidden_states[id + 1]``) concatenated, right padding zeroed. Hooks on the
    requested layers record their outputs (in the calling context only, a ContextVar); the deepest one's raises,
    ending the backbone's forward. On CUDA a call runs on the calling thread's own streams (``device.take``)."""

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int], *, dtype: torch.dtype | None = None,
                 zero_padding: bool = True, output_device: str | torch.device | None = None) -> None:
        self.model = model
        self.backbone = backbone(model)
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
        self.output_device = None if output_device is None else as_device(output_device)
        self.target_layer_ids = ids
        self.num_target_layers = num_layers
        self.deepest = max(ids)
        self.dtype = dtype
        self.zero_padding = zero_padding
        # HF's last `hidden_states` entry is the final-normed state (`tie_last_hidden_states`): for the last
        # layer the whole backbone runs, to match HF exactly.
        config = getattr(self.backbone, "config", None)
        self._last_is_normed = getattr(config, "tie_last_hidden_states", None) is not False
        self._devices: set[torch.device] | None = None  # where the model's layers are (the first call looks)
        self._collect: contextvars.ContextVar[dict[int, torch.Tensor] | None] = contextvars.ContextVar(
            f"dflash_flow_target_features_{id(self)}", default=None
        )

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

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Features ``[b, S, n * H]`` for right-padded ``input_ids [b, S]`` (or ``[S]``); ``position_ids``
        default to ``0..S-1`` per row."""
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)
        embed = self.model.get_input_embeddings()
        device = embed.weight.device if embed is not None else next(self.backbone.parameters()).device
        if self._devices is None:
            self._devices = {device, *(p.device for p in self.layers.parameters())}
        with side_streams(self._devices):
            return self._features(input_ids, attention_mask, position_ids, device)

    def _features(self, input_ids, attention_mask, position_ids, device) -> torch.Tensor:
        nb = device.type == "cuda"  # pinned host rows are copied without blocking (on this thread's stream)
        input_ids = input_ids.to(device, non_blocking=nb)
        if attention_mask is not None:
            attention_mask = attention_mask.to(device, non_blocking=nb)
        extra = {} if position_ids is None else {"position_ids": position_ids.to(device, non_blocking=nb)}

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
        # Concatenated outside inference mode: an ordinary tensor a trainer may feed into autograd.
        out = self.output_device or device
        if out.type == "cuda" and device.type == "cuda" and out != device:
            out = device  # the consumer takes them from the producing GPU (class docstring)
        feats = torch.cat([collected[i].to(out) for i in self.target_layer_ids], dim=-1)
        if self.dtype is not None:
            feats = feats.to(self.dtype)
        if self.zero_padding and attention_mask is not None:
            feats = feats * attention_mask.to(out).unsqueeze(-1).to(feats.dtype)
        return feats
