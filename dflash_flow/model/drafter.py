"""The DFlash draft model, DFlashDrafter: Qwen3-style layers (drafter_layers) fed with fused target features.

Contract (must stay equal to z-lab ``dflash.model.DFlashDraftModel``, which inference engines load):

* parameter names ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``,
  ``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``fc``,
  ``hidden_norm``; no embedding and no LM head (the target's are shared);
* ``forward(position_ids, attention_mask=None, noise_embedding=None, target_hidden=None, past_key_values=None,
  use_cache=False)`` returns the normed hidden states of the block tokens (``position_ids``: the context, then
  the block; ``target_hidden``: the raw concatenation of target features ``[b, ctx, n*H]``);
* the fused context ``hidden_norm(fc(target_hidden))`` is projected by the *same* ``k_proj``/``v_proj`` as the
  block tokens and prepended to the block's keys and values in every layer (k_norm and RoPE on both);
* with no mask, full-attention layers see every key and sliding layers are causal and windowed by key index.

Two entry points share the weights: ``forward`` / ``decode`` (the inference layout, or a dense bool mask), and
``context_kv`` + ``decode_blocks`` (training: context keys/values once per layer, blocks grouped by anchor).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from dflash_flow.model.drafter_config import draft_value
from dflash_flow.model.drafter_layers import (
    BlockLayout,
    DrafterLayer,
    RMSNorm,
    RotaryEmbedding,
    SlotRows,
    maybe_compiled,
)
from dflash_flow.model.facts import build_target_layer_ids


class DFlashDrafter(nn.Module):
    """DFlash drafter; weights interchangeable with z-lab ``DFlashDraftModel`` via ``load_state_dict``."""

    layer_class: type[DrafterLayer] = DrafterLayer
    # Block slots interact only through attention: the training layout may factor the first layer's
    # mask-token rows (``SlotRows``) and drop the last layer's slot-0 queries (not DFlash 2's).
    independent_slots: bool = True

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        if not hasattr(config, "num_target_layers") and draft_value(config, "target_layer_ids") is None:
            raise ValueError("drafter config needs num_target_layers or dflash_config.target_layer_ids")
        self.config = config
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        ids = draft_value(config, "target_layer_ids")
        if ids is None:
            ids = build_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
        self.target_layer_ids: list[int] = [int(i) for i in ids]
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = int(draft_value(config, "block_size", 16))
        self.mask_token_id = draft_value(config, "mask_token_id")
        self.gradient_checkpointing = False
        self._compiled = False
        self.compile_plan = None  # ``compile: auto``'s decision (model.compile_plan), else None
        self.reset_parameters()

    @property
    def layer_types(self) -> list[str]:
        return [layer.layer_type for layer in self.layers]

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def input_embedding_scale(self) -> float:
        return float(draft_value(self.config, "input_embedding_scale", 1.0))

    def reset_parameters(self) -> None:
        std = float(getattr(self.config, "initializer_range", 0.02))
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, Qwen3RMSNorm):
                nn.init.ones_(module.weight)

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat of target features))``: computed once, shared by every layer."""
        return self.hidden_norm(self.fc(target_hidden))

    def decode(self, noise_embedding: torch.Tensor, context: torch.Tensor, position_ids: torch.Tensor,
               attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
               past_key_values: Any = None) -> torch.Tensor:
        """Run the layers on block embeddings with an already fused ``context`` ``[b, ctx, H]``. ``position_ids``
        ``[b, ctx + q]`` (or ``[ctx + q]``); ``attention_mask``: a bool mask broadcastable to ``[b, 1, q, kv]``
        (True = visible), a dict ``{layer_type: mask}``, or None for the inference default."""
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.shape[0] != noise_embedding.shape[0]:
            position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        expected = context.shape[1] + noise_embedding.shape[1]
        if position_ids.shape[-1] != expected:
            raise ValueError(f"position_ids cover {position_ids.shape[-1]} positions; expected context + block = {expected}")
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            mask = attention_mask[layer.layer_type] if isinstance(attention_mask, dict) else attention_mask
            x = self._call(layer, x, context, cos, sin, mask, past_key_values)
        return self.norm(x)

    def _call(self, fn, *args):
        """``fn(*args)``, activation-checkpointed under ``gradient_checkpointing`` in training."""
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args)

    def context_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values ``[b, kv_heads, ctx, d]`` of a fused ``context`` at positions 0..ctx-1."""
        cos, sin = self.rotary_emb.table(context.shape[1], context)
        return self._context_kv(context, cos, sin)

    def _context_kv(self, context, cos, sin):
        s = context.shape[1]
        cos, sin = cos[None, :s], sin[None, :s]
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def training_context(self, target_hidden: torch.Tensor) -> list[torch.Tensor]:
        """``context_kv(fuse_context(target_hidden))`` flattened ``[k0, v0, k1, v1, ...]`` (compiled with
        ``compiled``)."""
        if self.compile_plan is not None and self.training and torch.is_grad_enabled():
            self.compile_plan.tick(tuple(target_hidden.shape[:2]))  # a training step starts (compile: auto)
        cos, sin = self.rotary_emb.table(target_hidden.shape[1], self.fc.weight)
        return maybe_compiled(_training_context, self.compiled)(self, target_hidden, cos, sin)

    @property
    def compiled(self) -> bool:
        """Whether the training step's work outside the attention kernels runs through ``torch.compile`` (same
        values to float rounding). Set to True / False, or ``"auto"``: eager until ``CompilePlan`` finds that the
        run's planned steps repay the compiling."""
        return self._compiled

    @compiled.setter
    def compiled(self, value: bool | str) -> None:
        from dflash_flow.model.compile_plan import AUTO, CompilePlan

        if isinstance(value, str):
            if value != AUTO:
                raise ValueError(f"compile must be true, false or {AUTO!r}, not {value!r}")
            self.compile_plan = CompilePlan(self)
            value = False
        else:
            self.compile_plan = None
        self._set_compiled(bool(value))

    def _set_compiled(self, value: bool) -> None:
        self._compiled = value
        for layer in self.layers:
            layer.compiled = value

    def decode_blocks(self, noise_embedding: torch.Tensor,
                      context_kv: list[tuple[torch.Tensor, torch.Tensor]], block_positions: torch.Tensor,
                      layouts: list[BlockLayout], rows: SlotRows | None = None) -> torch.Tensor:
        """Normed hidden states of block tokens in the training layout: ``[b, N*B, H]`` (``[b, N*(B-1), H]`` when
        the last layout drops slot 0). ``block_positions`` ``[b, N*B]``: absolute positions; ``layouts``: one per
        layer; ``rows``: ``noise_embedding`` in factored form (``SlotRows``)."""
        # Block positions are anchor + k < context length + B: looked up in the RoPE table.
        limit = context_kv[0][0].shape[-2] + self.block_size if context_kv else 0
        cos, sin = self.rotary_emb.at(block_positions, noise_embedding, limit)
        x = noise_embedding
        for i, (layer, (k, v), layout) in enumerate(zip(self.layers, context_kv, layouts, strict=True)):
            x = self._call(layer.forward_blocks, x, k, v, cos, sin, layout, rows if i == 0 else None)
        return self.norm(x)

    def forward(self, position_ids: torch.LongTensor,
                attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
                noise_embedding: torch.Tensor | None = None, target_hidden: torch.Tensor | None = None,
                past_key_values: Any = None, use_cache: bool = False, **kwargs: Any) -> torch.Tensor:
        """Inference-compatible entry point (z-lab ``DFlashDraftModel.forward``'s keywords). ``past_key_values``
        is updated whenever given (the caller crops it after each step); ``use_cache`` is accepted only."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("noise_embedding and target_hidden are required")
        context = self.fuse_context(target_hidden)
        return self.decode(noise_embedding, context, position_ids, attention_mask, past_key_values)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """Logits through the target's LM head, with the optional Gemma-style multiplier and soft-cap."""
        logits = output_head(hidden)
        multiplier = float(draft_value(self.config, "output_multiplier", 1.0))
        if multiplier != 1.0:
            logits = logits * multiplier
        softcap = draft_value(self.config, "final_logit_softcapping")
        if softcap is not None and float(softcap) > 0:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits


def _training_context(drafter: DFlashDrafter, target_hidden, cos, sin) -> list[torch.Tensor]:
    context = drafter.fuse_context(target_hidden.to(drafter.fc.weight.dtype))
    return [t for kv in drafter._context_kv(context, cos, sin) for t in kv]
