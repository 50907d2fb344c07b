"""The DFlash draft model: a few Qwen3-style decoder layers fed with fused target features.

Contract (must stay equal to z-lab ``dflash.model.DFlashDraftModel``, which inference engines load):

* parameter names ``layers.{i}.self_attn.{q,k,v,o}_proj``, ``layers.{i}.self_attn.{q,k}_norm``,
  ``layers.{i}.mlp.{gate,up,down}_proj``, ``layers.{i}.{input,post_attention}_layernorm``, ``norm``, ``fc``,
  ``hidden_norm``; no embedding and no LM head (the target's are shared);
* ``forward(position_ids, attention_mask=None, noise_embedding=None, target_hidden=None,
  past_key_values=None, use_cache=False)`` returns the normed hidden states of the block tokens;
  ``position_ids`` covers the context and then the block, ``target_hidden`` is the raw concatenation of
  target features ``[b, ctx, n*H]``;
* the fused context ``hidden_norm(fc(target_hidden))`` is projected by the *same* ``k_proj``/``v_proj``
  as the block tokens and prepended to the block's keys and values in every layer (k_norm and RoPE on both);
* with no mask, full-attention layers see every key (bidirectional) and sliding layers are causal and
  windowed by key index (with a KV cache, key index == absolute position).

The training path is the same ``forward`` with a dense bool mask ``[b, 1, Q, KV]`` (or a dict of masks
keyed by layer type); ``dflash_flow.model.objective`` builds those masks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


# ---------------------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------------------


def build_target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Target layers whose outputs feed the drafter: ``[L//2]`` for one, else n points over [1, L-3].

    Uses Python's ``round`` (banker's rounding) on purpose: released checkpoints were made with it.
    """
    if n < 1:
        raise ValueError(f"need at least one target layer, got n={n}")
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if n == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise ValueError(
            f"a target with {num_target_layers} layers is too shallow for {n} feature layers "
            "(the rule spreads them over [1, L-3]); pass target_layer_ids explicitly"
        )
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


def draft_value(config: Any, name: str, default: Any = None) -> Any:
    """A DFlash setting: ``dflash_config[name]`` first, then the config attribute (as z-lab reads it)."""
    dcfg = getattr(config, "dflash_config", None) or {}
    if name in dcfg:
        return dcfg[name]
    return getattr(config, name, default)


def make_drafter_config(
    target_config: Any,
    *,
    num_layers: int,
    block_size: int = 16,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    layer_types: list[str] | None = None,
    sliding_window: int | None = None,
    intermediate_size: int | None = None,
    input_embedding_scale: float | None = None,
    output_multiplier: float | None = None,
    final_logit_softcapping: float | None = None,
) -> Qwen3Config:
    """A drafter config sized to ``target_config`` (hidden size, heads, RoPE, vocabulary).

    The drafter shares the target's embedding and LM head, so hidden and vocabulary sizes are taken from
    the target; attention geometry and RoPE are copied too (what released drafters do).
    """
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2 (one anchor + at least one draft slot), got {block_size}")
    num_target_layers = int(tc.num_hidden_layers)
    if target_layer_ids is None:
        target_layer_ids = build_target_layer_ids(num_target_layers, num_layers)
    target_layer_ids = [int(i) for i in target_layer_ids]
    if not target_layer_ids:
        raise ValueError("target_layer_ids must not be empty")
    bad = [i for i in target_layer_ids if not 0 <= i < num_target_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} out of range for a target with {num_target_layers} layers")
    vocab_size = int(tc.vocab_size)
    if not 0 <= int(mask_token_id) < vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} outside the target vocabulary [0, {vocab_size})")
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
    if not uses_sliding:
        sliding_window = None

    num_heads = int(tc.num_attention_heads)
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // num_heads
    rope_parameters = getattr(tc, "rope_parameters", None)
    dflash_config: dict[str, Any] = {
        "mask_token_id": int(mask_token_id),
        "target_layer_ids": target_layer_ids,
    }
    for key, value in (
        ("input_embedding_scale", input_embedding_scale),
        ("output_multiplier", output_multiplier),
        ("final_logit_softcapping", final_logit_softcapping),
    ):
        if value is not None:
            dflash_config[key] = float(value)

    config = Qwen3Config(
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
        use_sliding_window=uses_sliding,
        sliding_window=sliding_window,
        layer_types=layer_types,
        tie_word_embeddings=False,
        architectures=["DFlashDraftModel"],
        auto_map={"AutoModel": "dflash.DFlashDraftModel"},
        block_size=int(block_size),
        num_target_layers=num_target_layers,
        dflash_config=dflash_config,
    )
    return config


# ---------------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 even for bf16 activations; the weight multiplies the down-cast value, as in Qwen3.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class SwiGLU(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, act: str = "silu") -> None:
        super().__init__()
        if act != "silu":
            raise ValueError(f"the drafter MLP is SwiGLU (silu); got hidden_act={act!r}")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions; default RoPE plus the static scaled types of transformers."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if rope_type == "default":
            theta = float(params.get("rope_theta", 10000.0))
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise ValueError("dynamic RoPE rescales with sequence length and is not supported by the drafter")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not round the frequencies: positions in the thousands would drift.
        keep = self.inv_freq
        super()._apply(fn, recurse)
        if not keep.is_meta and self.inv_freq.dtype != torch.float32:
            self.inv_freq = keep.to(self.inv_freq.device, torch.float32)
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [b, heads, T, d]; cos/sin: [b, T, d]
    return x * cos[:, None] + _rotate_half(x) * sin[:, None]


def index_mask(
    q_len: int, kv_len: int, *, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor:
    """Mask used when no mask is passed: queries are the last ``q_len`` keys, positions are key indices.

    At inference the cache holds exactly the committed context, so key index equals absolute position.
    """
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    k_pos = torch.arange(kv_len, device=device)[None, :]
    visible = torch.ones(q_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        visible &= k_pos <= q_pos
    if window is not None:
        visible &= q_pos - k_pos < window
        if not causal:
            visible &= k_pos - q_pos < window
    return visible[None, None]


class DrafterAttention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_heads} heads are not a multiple of {self.num_kv_heads} KV heads")
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
        bias = bool(getattr(config, "attention_bias", False))
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, h, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None)
        self.layer_type = layer_types[layer_idx] if layer_types else FULL_ATTENTION
        # An explicit config.is_causal overrides the per-type default, exactly as z-lab reads it.
        forced = getattr(config, "is_causal", None)
        self.is_causal = self.layer_type == SLIDING_ATTENTION if forced is None else bool(forced)
        self.sliding_window = config.sliding_window if self.layer_type == SLIDING_ATTENTION else None

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        b, q_len, _ = x.shape
        ctx_len = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        # Context and block tokens go through the same projections: one matmul over both.
        kv_in = torch.cat([context, x], dim=1)
        k = self.k_proj(kv_in).view(b, ctx_len + q_len, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, ctx_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = _rope(q, cos[:, -q_len:], sin[:, -q_len:])
        k = _rope(k, cos, sin)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = index_mask(
                q_len, k.shape[-2], causal=self.is_causal, window=self.sliding_window, device=q.device
            )
        if self.num_kv_heads != self.num_heads:
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.scaling,
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, getattr(config, "hidden_act", "silu"))
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    @property
    def layer_type(self) -> str:
        return self.self_attn.layer_type

    def forward(self, x, context, cos, sin, attention_mask, past_key_values=None):
        # The fused context is *not* normalised here: it only enters as keys/values (k_norm handles it).
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """DFlash drafter; weights interchangeable with z-lab ``DFlashDraftModel`` via ``load_state_dict``."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        if not hasattr(config, "num_target_layers") and draft_value(config, "target_layer_ids") is None:
            raise ValueError("drafter config needs num_target_layers or dflash_config.target_layer_ids")
        self.config = config
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_hidden_layers))
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
        self.reset_parameters()

    # -- properties used by decoding loops ---------------------------------------------------------
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
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    # -- forward -----------------------------------------------------------------------------------
    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``hidden_norm(fc(concat of target features))``: computed once, shared by every layer."""
        return self.hidden_norm(self.fc(target_hidden))

    def decode(
        self,
        noise_embedding: torch.Tensor,
        context: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        past_key_values: Any = None,
    ) -> torch.Tensor:
        """Run the layers on block embeddings with an already fused ``context`` ``[b, ctx, H]``.

        ``position_ids`` is ``[b, ctx + q]`` (or ``[ctx + q]``): context positions, then block positions.
        ``attention_mask`` is a bool mask broadcastable to ``[b, 1, q, kv]`` (True = visible), a dict
        ``{layer_type: mask}``, or None for the inference default.
        """
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.shape[0] != noise_embedding.shape[0]:
            position_ids = position_ids.expand(noise_embedding.shape[0], -1)
        expected = context.shape[1] + noise_embedding.shape[1]
        if position_ids.shape[-1] != expected:
            raise ValueError(
                f"position_ids cover {position_ids.shape[-1]} positions; expected context + block = {expected}"
            )
        cos, sin = self.rotary_emb(position_ids, noise_embedding.dtype)
        x = noise_embedding
        for layer in self.layers:
            mask = attention_mask[layer.layer_type] if isinstance(attention_mask, dict) else attention_mask
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(
                    layer, x, context, cos, sin, mask, past_key_values, use_reentrant=False
                )
            else:
                x = layer(x, context, cos, sin, mask, past_key_values)
        return self.norm(x)

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: Any = None,
        use_cache: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Inference-compatible entry point (same keywords as z-lab ``DFlashDraftModel.forward``).

        ``past_key_values`` (a transformers ``Cache``) is updated whenever given, as in z-lab; the caller
        crops it back to the committed length after each step. ``use_cache`` is accepted for signature
        compatibility.
        """
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
