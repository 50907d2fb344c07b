"""The drafter's layers: RoPE, RMSNorm, masks, the training block layout and its attention, DrafterLayer."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

from dflash_flow.model import fused
from dflash_flow.model.block_attention import block_attention, split_block_attention
from dflash_flow.model.drafter_config import FULL_ATTENTION, SLIDING_ATTENTION


class RotaryEmbedding(Qwen3RotaryEmbedding):
    """transformers' Qwen3 RoPE (every static RoPE type it knows), with fp32 tables under ``.to(bf16)``."""

    def __init__(self, config: Qwen3Config) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("rope_type", "default") == "dynamic":
            # Dynamic NTK rescales with the longest position: training and inference would differ.
            raise ValueError("dynamic RoPE rescales with sequence length and is not supported by the drafter")
        super().__init__(config)
        self._tables: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[L, d]`` (``L >= length``) at positions 0..L-1, in ``like``'s dtype and device, grown
        by doubling; lookups equal ``forward`` bit for bit."""
        key = (like.device, like.dtype)
        cached = self._tables.get(key)
        if cached is None or cached[0].shape[0] < length:
            size = max(int(length), 2 * cached[0].shape[0] if cached is not None else 1024)
            cos, sin = self.forward(like, torch.arange(size, device=like.device)[None])
            cached = self._tables[key] = (cos[0], sin[0])
        return cached

    def at(self, positions: torch.Tensor, like: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward(like, positions)`` from the table, for positions known to be below ``limit``."""
        cos, sin = self.table(limit, like)
        flat = positions.reshape(-1)
        shape = (*positions.shape, cos.shape[-1])
        return cos.index_select(0, flat).view(shape), sin.index_select(0, flat).view(shape)

    def _apply(self, fn, recurse=True):
        # model.to(bfloat16) must not round the frequencies (positions in the thousands would drift).
        before = dict(self._buffers)
        self._tables = {}  # remade on the new device / from the new frequencies when next needed
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and not old.is_meta and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device, torch.float32)
        return self


class RMSNorm(Qwen3RMSNorm):
    """transformers' Qwen3RMSNorm; fp32 goes through ``fused.rms_norm`` (the same values, one op forward, a
    hand-written backward). Other dtypes keep transformers' arithmetic, as z-lab does."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return fused.rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # For keys alone (apply_rotary_pos_emb rotates a (q, k) pair). x: [b, heads, T, d]; cos: [b, T, d]
    return fused.rope(x, cos[:, None], sin[:, None])


def index_mask(q_len: int, kv_len: int, *, causal: bool, window: int | None, device: torch.device) -> torch.Tensor:
    """Mask used when no mask is passed: queries are the last ``q_len`` keys, positions are key indices
    (at inference the cache holds exactly the committed context)."""
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


class BlockLayout(NamedTuple):
    """How the block queries of the training layout attend (one per layer). A block needs the context before
    its anchor and its own block, nothing else. Group ``(q0, q1, lo, hi)``: queries ``[q0, q1)`` (whole blocks)
    seeing context keys ``[lo, hi)`` and their own blocks' keys. Key layout: ``scratch`` slots, then the S
    context positions; a group's own keys go just before its context slice (one contiguous key range).
    ``mask``: additive ``[b, 1, Q, scratch + S]`` in that layout; ``group_masks``: the groups' views of it.
    ``queries_per_block``: B, or B - 1 when the layer's slot-0 queries are dropped.
    """

    block_size: int
    queries_per_block: int
    groups: list[tuple[int, int, int, int]]
    scratch: int
    mask: torch.Tensor | None
    group_masks: list[torch.Tensor] | None
    # For the split attention: ``visible`` (bool ``[b, N, 1 or queries_per_block, S]``) when the layout has no
    # ``mask``; the own-block pattern ``[1, 1, queries_per_block, B]`` (additive; None: every slot sees its whole
    # block); which queries see any context (bool ``[b, 1, Q]``).
    visible: torch.Tensor | None = None
    own_mask: torch.Tensor | None = None
    has_context: torch.Tensor | None = None

    def context_mask(self, g: int) -> torch.Tensor:
        """Group ``g``'s additive mask over its context slice alone, ``[b, 1, q1 - q0, hi - lo]``: made from
        ``visible`` once per layout and kept in ``masks`` (every layer sharing the layout reads the same one)."""
        q0, q1, lo, hi = self.groups[g]
        if self.visible is None:
            return self.mask.narrow(2, q0, q1 - q0).narrow(3, self.scratch + lo, hi - lo)
        masks = self.masks if self.masks is not None else {}  # None: nothing kept between calls
        if g not in masks:
            if "additive" not in masks:
                zero = torch.zeros((), dtype=self.dtype, device=self.visible.device)
                masks["additive"] = torch.where(self.visible, zero, float("-inf"))
            b, per = self.visible.shape[0], self.queries_per_block
            part = masks["additive"][:, q0 // per : q1 // per, :, lo:hi].expand(b, (q1 - q0) // per, per, hi - lo)
            masks[g] = part.reshape(b, 1, q1 - q0, hi - lo)
        return masks[g]

    dtype: torch.dtype = torch.float32  # of the masks
    split: bool = False  # the CPU training path takes the split attention (block_layouts' choice)
    # The context masks made so far, by group, and the additive visibility; None: made anew at every call.
    masks: dict | None = None

    @property
    def drops_first_slot(self) -> bool:
        return self.queries_per_block < self.block_size

    def own_keys(self, q0: int, q1: int) -> tuple[int, int]:
        """The own-block key range (in block-key slots) of queries ``[q0, q1)``."""
        return q0 // self.queries_per_block * self.block_size, q1 // self.queries_per_block * self.block_size


def drop_first_slot(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[b, N*B, ...]`` -> ``[b, N*(B-1), ...]``: slots 1..B-1 of every block."""
    b, t = x.shape[:2]
    n = t // block_size
    return x.view(b, n, block_size, *x.shape[2:])[:, :, 1:].reshape(b, n * (block_size - 1), *x.shape[2:])


class SlotRows(NamedTuple):
    """Block-token rows in factored form: ``first`` ``[b, N, H]`` for slot 0 of every block and one row ``rest``
    ``[H]`` shared by slots 1..B-1 (they all hold the mask token in the first layer's input). ``first`` may be
    ``[b, N, f, H]``, slots 0..f-1 (DFlash 2's first layer), then ``rest`` is shared by slots f..B-1."""

    first: torch.Tensor
    rest: torch.Tensor


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

    def _heads(self, x: torch.Tensor, proj: nn.Linear, heads: int, norm: nn.Module | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        y = proj(x).view(b, t, heads, self.head_dim)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        # SDPA shares the KV heads (enable_gqa): the CPU kernel and, on CUDA, the memory-efficient and cuDNN
        # kernels (masks allowed) take them as they are; only the math fallback repeats them.
        gqa = self.num_heads > self.num_kv_heads
        dropout = self.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=self.scaling, enable_gqa=gqa)

    def context_kv(self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE at the context positions) and values of the fused context, ``[b, kv, T, d]``,
        through the same ``k_proj``/``v_proj`` as the block tokens."""
        k = self._heads(context, self.k_proj, self.num_kv_heads, self.k_norm)
        v = self._heads(context, self.v_proj, self.num_kv_heads)
        return _rope(k, cos, sin), v

    def _block_qkv(self, x, cos, sin):
        q = self._heads(x, self.q_proj, self.num_heads, self.q_norm)
        k = self._heads(x, self.k_proj, self.num_kv_heads, self.k_norm)
        v = self._heads(x, self.v_proj, self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def forward(self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                attention_mask: torch.Tensor | None, past_key_values: Any = None) -> torch.Tensor:
        """Inference layout: keys/values are [context; block], cos/sin cover context then block."""
        b, q_len, _ = x.shape
        ctx_len = context.shape[1]
        q, k, v = self._block_qkv(x, cos[:, ctx_len:], sin[:, ctx_len:])
        k_ctx, v_ctx = self.context_kv(context, cos[:, :ctx_len], sin[:, :ctx_len])
        k = torch.cat([k_ctx, k], dim=2)
        v = torch.cat([v_ctx, v], dim=2)
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = index_mask(q_len, k.shape[-2], causal=self.is_causal, window=self.sliding_window,
                                        device=q.device)
        return self.project_out(self._attend(q, k, v, attention_mask))

    def _slot_heads(self, h, proj: nn.Linear, heads: int, norm: nn.Module | None, bsz: int, drop: bool):
        """``_heads`` of block rows ``h`` (``[b, N*B, H]`` or ``SlotRows``), without slot 0 if ``drop``."""
        d = self.head_dim
        if not isinstance(h, SlotRows):
            return self._heads(drop_first_slot(h, bsz) if drop else h, proj, heads, norm)
        b, n = h.first.shape[:2]
        f = h.first.shape[2] if h.first.dim() == 4 else 1  # DFlash 2's first layer: f distinct slots
        rest = proj(h.rest).view(1, 1, 1, heads, d)
        rest = (norm(rest) if norm is not None else rest).expand(b, n, bsz - f, heads, d)
        if drop and f == 1:
            y = rest
        else:
            first = proj(h.first).view(b, n, f, heads, d)
            first = norm(first) if norm is not None else first
            y = torch.cat([first[:, :, 1:] if drop else first, rest], dim=2)
        return y.reshape(b, -1, heads, d).transpose(1, 2)

    def block_qkv(self, h: torch.Tensor | SlotRows, cos: torch.Tensor, sin: torch.Tensor, bsz: int, drop: bool):
        """Queries (without slot 0 if ``drop``), keys and values of normed block rows ``h`` (``[b, N*B, H]``
        or ``SlotRows``), q_norm / k_norm and RoPE at the block positions applied."""
        q = self._slot_heads(h, self.q_proj, self.num_heads, self.q_norm, bsz, drop)
        k = self._slot_heads(h, self.k_proj, self.num_kv_heads, self.k_norm, bsz, False)
        v = self._slot_heads(h, self.v_proj, self.num_kv_heads, None, bsz, False)
        q_cos, q_sin = (drop_first_slot(cos, bsz), drop_first_slot(sin, bsz)) if drop else (cos, sin)
        return _rope(q, q_cos, q_sin), _rope(k, cos, sin), v

    def attend_blocks(self, q, ctx_k, ctx_v, k, v, layout: BlockLayout) -> torch.Tensor:
        """``[b, heads, Q, d]``: block queries over their group's own blocks and context slice."""
        if self.splits_on(q.device):
            if layout.split:
                return split_block_attention(q, ctx_k, ctx_v, k, v, layout, self.scaling)
            return block_attention(q, ctx_k, ctx_v, k, v, layout, self.scaling)
        if layout.group_masks is None:
            raise ValueError("this layout was made for the split attention (block_layouts(split=True)), which runs on CPU without attention dropout")
        return self.grouped_attention(q, ctx_k, ctx_v, k, v, layout)

    def splits_on(self, device: torch.device) -> bool:
        """Whether ``attend_blocks`` takes the CPU kernels on ``device`` (no attention dropout in training),
        which need no ``[scratch | context]`` mask (``block_layouts(split=True)``)."""
        return device.type == "cpu" and not (self.training and self.attention_dropout > 0)

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        b, _h, q_len, _d = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))

    def forward_blocks(self, h: torch.Tensor | SlotRows, ctx_k: torch.Tensor, ctx_v: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, layout: BlockLayout) -> torch.Tensor:
        """Training layout: normed block tokens ``h`` attend to the precomputed context keys and their own block
        as ``layout`` says; one output per query (``[b, N*queries_per_block, H]``)."""
        q, k, v = self.block_qkv(h, cos, sin, layout.block_size, layout.drops_first_slot)
        return self.project_out(self.attend_blocks(q, ctx_k, ctx_v, k, v, layout))

    def grouped_attention(self, q, ctx_k, ctx_v, own_k, own_v, layout: BlockLayout) -> torch.Tensor:
        """The same attention as ``_BlockAttention`` through ``scaled_dot_product_attention``: one call
        per group over [its own blocks; its context slice] (copies those keys; any device, dropout)."""
        parts = []
        for g, (q0, q1, lo, hi) in enumerate(layout.groups):
            k0, k1 = layout.own_keys(q0, q1)
            kg = torch.cat([own_k[:, :, k0:k1], ctx_k[:, :, lo:hi]], dim=2)
            vg = torch.cat([own_v[:, :, k0:k1], ctx_v[:, :, lo:hi]], dim=2)
            parts.append(self._attend(q[:, :, q0:q1], kg, vg, layout.group_masks[g]))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


class DrafterLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    compiled: bool = False

    @property
    def layer_type(self) -> str:
        return self.self_attn.layer_type

    def forward(self, x, context, cos, sin, attention_mask, past_key_values=None):
        # The fused context is *not* normalised here: it only enters as keys/values (k_norm handles it).
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_blocks(self, x, ctx_k, ctx_v, cos, sin, layout, rows: SlotRows | None = None):
        """``rows``: ``x`` in factored form (the first layer), so the norm and projections run per row."""
        bsz, drop = layout.block_size, layout.drops_first_slot
        q, k, v = maybe_compiled(_layer_in, self.compiled)(self, x, rows, cos, sin, bsz, drop)
        out = self.self_attn.attend_blocks(q, ctx_k, ctx_v, k, v, layout)
        return maybe_compiled(_layer_out, self.compiled)(self, x, out, bsz, drop)


def _layer_in(layer: DrafterLayer, x, rows: SlotRows | None, cos, sin, bsz: int, drop: bool):
    """A layer's work before the attention: input norm, q / k / v, their norms and RoPE."""
    if rows is None:
        h = layer.input_layernorm(x)
    else:
        h = SlotRows(layer.input_layernorm(rows.first), layer.input_layernorm(rows.rest))
    return layer.self_attn.block_qkv(h, cos, sin, bsz, drop)


def _layer_out(layer: DrafterLayer, x, out, bsz: int, drop: bool):
    """A layer's work after the attention: o_proj, the residual (slots 1..B-1 if ``drop``), the MLP."""
    attn = layer.self_attn.project_out(out)
    if drop:
        x = drop_first_slot(x, bsz)
    x = x + attn
    return x + gated_mlp(layer.mlp, layer.post_attention_layernorm(x))


def gated_mlp(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """Qwen3's MLP, its SiLU gate through ``fused.silu_mul`` (the same values, a smaller backward)."""
    if getattr(getattr(mlp, "config", None), "hidden_act", None) in ("silu", "swish"):
        return mlp.down_proj(fused.silu_mul(mlp.gate_proj(h), mlp.up_proj(h)))
    return mlp(h)


_COMPILED: dict[Any, Any] = {}


def maybe_compiled(fn, compiled: bool):
    """``fn``, or its ``torch.compile`` (made once per function, shared by every module) when ``compiled``."""
    if not compiled:
        return fn
    if fn not in _COMPILED:
        _COMPILED[fn] = torch.compile(fn, dynamic=None)
    return _COMPILED[fn]
