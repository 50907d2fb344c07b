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

The layers are transformers' Qwen3 pieces (``Qwen3RMSNorm``, ``Qwen3MLP``, ``Qwen3RotaryEmbedding``,
``apply_rotary_pos_emb``), the ones z-lab's model is built from, so the arithmetic is the same.

Two entry points share the weights:

* ``forward`` / ``decode``: the inference layout above, or training with a dense bool mask
  ``[b, 1, Q, KV]`` (or a dict of masks keyed by layer type); ``objective.block_attention_mask`` builds it;
* ``context_kv`` + ``decode_blocks``: the training layout. The context's keys and values are the same
  for every block (and every chunk of blocks), so they are projected once per layer; blocks are
  processed in groups (``BlockLayout``) that attend only to the context slice their anchors can see.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
    rotate_half,
)

from dflash_flow.model.facts import build_target_layer_ids  # noqa: F401 - re-exported (the DFlash rule)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)


# ---------------------------------------------------------------------------------------------------
# Config helpers
# ---------------------------------------------------------------------------------------------------


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
# Building blocks (transformers' Qwen3 norm, MLP and RoPE, as z-lab's reference uses)
# ---------------------------------------------------------------------------------------------------


class RotaryEmbedding(Qwen3RotaryEmbedding):
    """transformers' Qwen3 RoPE (every static RoPE type it knows), with fp32 tables under ``.to(bf16)``."""

    def __init__(self, config: Qwen3Config) -> None:
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("rope_type", "default") == "dynamic":
            # Dynamic NTK rescales with the longest position in the call: training rows and inference
            # prefixes would use different frequencies.
            raise ValueError("dynamic RoPE rescales with sequence length and is not supported by the drafter")
        super().__init__(config)

    def _apply(self, fn, recurse=True):
        # Kept from our own module: model.to(bfloat16) must not round the frequencies (positions in the
        # thousands would drift); transformers relies on PreTrainedModel's fp32 rules, which we do not have.
        before = dict(self._buffers)
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers.get(name)
            if old is not None and new is not None and not old.is_meta and new.dtype != torch.float32:
                self._buffers[name] = old.to(new.device, torch.float32)
        return self


class RMSNorm(Qwen3RMSNorm):
    """transformers' Qwen3RMSNorm; fp32 goes through torch's fused ``rms_norm``.

    Our one change, for speed: the fused kernel gives the same fp32 values (bit-equal in our checks) in
    one op forward and one backward instead of six and ten (about 2x on CPU, and 12 norms run per step).
    Other dtypes keep transformers' arithmetic (normalise in fp32, round, then scale), as z-lab does.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Our own one-liner for keys alone: transformers' apply_rotary_pos_emb rotates a (q, k) pair at the
    # same positions, and the context keys have positions of their own. x: [b, heads, T, d]; cos: [b, T, d]
    return x * cos[:, None] + rotate_half(x) * sin[:, None]


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


class BlockLayout(NamedTuple):
    """How the block queries of the training layout attend (one per layer).

    A block needs the context before its anchor and its own block, nothing else; a dense mask over all
    context and all blocks spends most of its work on keys it hides. Blocks are grouped by anchor:
    group ``(q0, q1, lo, hi)`` = queries ``[q0, q1)`` (whole blocks) seeing context keys ``[lo, hi)``
    and the keys of the group's own blocks. Key layout: ``scratch`` slots, then the S context
    positions; a group's own keys are placed just before its context slice, so the group attends to
    one contiguous key range ``[scratch + lo - own, scratch + hi)``. ``mask`` is additive
    ``[b, 1, Q, scratch + S]`` in that layout (each group's rows hold its own-block pattern in its own
    columns); ``group_masks`` are the groups' views of it. ``queries_per_block`` is B, or B - 1 when
    the layer's slot-0 queries are dropped (the last layer: slot 0 is never supervised, so only its key
    and value are needed).
    """

    block_size: int
    queries_per_block: int
    groups: list[tuple[int, int, int, int]]
    scratch: int
    mask: torch.Tensor
    group_masks: list[torch.Tensor]

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
    """Block-token rows in factored form: ``first`` ``[b, N, H]`` for slot 0 of every block and one row
    ``rest`` ``[H]`` shared by slots 1..B-1. The first layer's input is this (slots 1..B-1 all hold the
    mask token), so its norm and q/k/v projections run on N + 1 rows per sequence instead of N*B."""

    first: torch.Tensor
    rest: torch.Tensor


_flash_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _Keys:
    """Keys or values in the ``BlockLayout`` key layout: [scratch | context], with one group's own
    keys written just before its context slice while that group is computed (then put back)."""

    def __init__(self, ctx: torch.Tensor, scratch: int) -> None:
        b, kv, s, d = ctx.shape
        self.ctx, self.scratch = ctx, scratch
        self.buf = ctx.new_empty(b, scratch + s, kv, d).transpose(1, 2)  # memory as the projections'
        self.buf.narrow(2, scratch, s).copy_(ctx)

    def group(self, own: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        n = own.shape[2]
        start = self.scratch + lo - n
        self.buf.narrow(2, start, n).copy_(own)
        return self.buf.narrow(2, start, n + hi - lo)

    def restore(self, own_len: int, lo: int) -> None:
        if lo > 0:  # the own keys covered context positions [lo - own_len, lo)
            first = max(0, lo - own_len)
            self.buf.narrow(2, self.scratch + first, lo - first).copy_(self.ctx.narrow(2, first, lo - first))


class _BlockAttention(torch.autograd.Function):
    """Attention of block queries over [their group's own blocks; their group's context slice], one CPU
    flash kernel call per group on a view: no key is copied per group, no hidden range is scored.

    Our own code: no library kernel attends to "a slice of one key tensor plus a block of another". The
    context keys sit once in a buffer with scratch slots before them (``_Keys``); each group writes its
    own blocks' keys next to its context slice, calls the kernel on that contiguous range, and puts the
    context back. The backward redoes the same writes around the kernel's backward.
    Shapes: q [b, h, Q, d]; ctx_k, ctx_v [b, kv, S, d]; own_k, own_v [b, kv, N*B, d].
    """

    @staticmethod
    def _groups(layout, q, ctx_k, ctx_v, own_k, own_v, kernel):
        """``kernel(group index, q, k, v)`` for each group, with its keys in place; yields its results."""
        keys, values = _Keys(ctx_k, layout.scratch), _Keys(ctx_v, layout.scratch)
        for g, (q0, q1, lo, hi) in enumerate(layout.groups):
            k0, k1 = layout.own_keys(q0, q1)
            own = k1 - k0
            result = kernel(
                g,
                q0,
                q1,
                keys.group(own_k.narrow(2, k0, own), lo, hi),
                values.group(own_v.narrow(2, k0, own), lo, hi),
            )
            keys.restore(own, lo)
            values.restore(own, lo)
            yield (own, lo, hi), result

    @staticmethod
    def forward(ctx, q, ctx_k, ctx_v, own_k, own_v, layout, scale):
        def kernel(g, q0, q1, k, v):
            qg = q.narrow(2, q0, q1 - q0)
            return _flash_cpu(qg, k, v, 0.0, False, attn_mask=layout.group_masks[g], scale=scale)

        results = [r for _g, r in _BlockAttention._groups(layout, q, ctx_k, ctx_v, own_k, own_v, kernel)]
        # Kept in the kernel's [b, Q, h, d] memory order, so o_proj reads the result without a copy.
        out = torch.cat([o.transpose(1, 2) for o, _lse in results], dim=1).transpose(1, 2)
        lse = torch.cat([lse for _o, lse in results], dim=2)
        ctx.save_for_backward(q, ctx_k, ctx_v, own_k, own_v, out, lse)
        ctx.layout, ctx.scale = layout, scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, ctx_k, ctx_v, own_k, own_v, out, lse = ctx.saved_tensors
        layout, scale = ctx.layout, ctx.scale

        def kernel(g, q0, q1, k, v):
            n = q1 - q0
            return _flash_cpu_backward(
                grad_out.narrow(2, q0, n),
                q.narrow(2, q0, n),
                k,
                v,
                out.narrow(2, q0, n),
                lse.narrow(2, q0, n),
                0.0,
                False,
                attn_mask=layout.group_masks[g],
                scale=scale,
            )

        dq, dk_own, dv_own = [], [], []
        dk_ctx, dv_ctx = torch.zeros_like(ctx_k), torch.zeros_like(ctx_v)
        for (own, lo, hi), (gq, gk, gv) in _BlockAttention._groups(
            layout, q, ctx_k, ctx_v, own_k, own_v, kernel
        ):
            dq.append(gq.transpose(1, 2))
            dk_own.append(gk.narrow(2, 0, own).transpose(1, 2))
            dv_own.append(gv.narrow(2, 0, own).transpose(1, 2))
            if hi > lo:
                dk_ctx.narrow(2, lo, hi - lo).add_(gk.narrow(2, own, hi - lo))
                dv_ctx.narrow(2, lo, hi - lo).add_(gv.narrow(2, own, hi - lo))

        def join(parts):
            return torch.cat(parts, dim=1).transpose(1, 2)

        return join(dq), dk_ctx, dv_ctx, join(dk_own), join(dv_own), None, None


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

    def _heads(
        self, x: torch.Tensor, proj: nn.Linear, heads: int, norm: nn.Module | None = None
    ) -> torch.Tensor:
        b, t, _ = x.shape
        y = proj(x).view(b, t, heads, self.head_dim)
        if norm is not None:
            y = norm(y)
        return y.transpose(1, 2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
        groups = self.num_heads // self.num_kv_heads
        # The CPU kernel shares KV heads itself (enable_gqa); elsewhere masked attention falls back to
        # kernels without GQA support, so the KV heads are repeated there.
        gqa = groups > 1 and q.device.type == "cpu"
        if groups > 1 and not gqa:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.attention_dropout if self.training else 0.0,
            scale=self.scaling,
            enable_gqa=gqa,
        )

    def context_kv(
        self, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (k_norm, RoPE at the context positions) and values of the fused context, ``[b, kv, T, d]``.

        The same ``k_proj``/``v_proj`` as the block tokens; the context never goes through the MLP.
        """
        k = self._heads(context, self.k_proj, self.num_kv_heads, self.k_norm)
        v = self._heads(context, self.v_proj, self.num_kv_heads)
        return _rope(k, cos, sin), v

    def _block_qkv(self, x, cos, sin):
        q = self._heads(x, self.q_proj, self.num_heads, self.q_norm)
        k = self._heads(x, self.k_proj, self.num_kv_heads, self.k_norm)
        v = self._heads(x, self.v_proj, self.num_kv_heads)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values: Any = None,
    ) -> torch.Tensor:
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
            attention_mask = index_mask(
                q_len, k.shape[-2], causal=self.is_causal, window=self.sliding_window, device=q.device
            )
        out = self._attend(q, k, v, attention_mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))

    def _slot_heads(self, h, proj: nn.Linear, heads: int, norm: nn.Module | None, bsz: int, drop: bool):
        """``_heads`` of block rows ``h`` (a tensor ``[b, N*B, H]`` or ``SlotRows``), without slot 0 if
        ``drop``."""
        d = self.head_dim
        if not isinstance(h, SlotRows):
            return self._heads(drop_first_slot(h, bsz) if drop else h, proj, heads, norm)
        b, n, _ = h.first.shape
        rest = proj(h.rest).view(1, 1, 1, heads, d)
        rest = (norm(rest) if norm is not None else rest).expand(b, n, bsz - 1, heads, d)
        if drop:
            y = rest
        else:
            first = proj(h.first).view(b, n, 1, heads, d)
            y = torch.cat([norm(first) if norm is not None else first, rest], dim=2)
        return y.reshape(b, -1, heads, d).transpose(1, 2)

    def forward_blocks(
        self,
        h: torch.Tensor | SlotRows,
        ctx_k: torch.Tensor,
        ctx_v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layout: BlockLayout,
    ) -> torch.Tensor:
        """Training layout: normed block tokens ``h`` (``[b, N*B, H]`` or ``SlotRows``; cos/sin at the
        block positions) attend to the precomputed context keys and their own block as ``layout``
        says; returns one output per query (``[b, N*queries_per_block, H]``)."""
        bsz, drop = layout.block_size, layout.drops_first_slot
        q = self._slot_heads(h, self.q_proj, self.num_heads, self.q_norm, bsz, drop)
        k = self._slot_heads(h, self.k_proj, self.num_kv_heads, self.k_norm, bsz, False)
        v = self._slot_heads(h, self.v_proj, self.num_kv_heads, None, bsz, False)
        if drop:
            q, k = _rope(q, drop_first_slot(cos, bsz), drop_first_slot(sin, bsz)), _rope(k, cos, sin)
        else:
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
        b, _h, q_len, _d = q.shape
        if q.device.type == "cpu" and not (self.training and self.attention_dropout > 0):
            out = _BlockAttention.apply(q, ctx_k, ctx_v, k, v, layout, self.scaling)
        else:
            out = self.grouped_attention(q, ctx_k, ctx_v, k, v, layout)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))

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

    @property
    def layer_type(self) -> str:
        return self.self_attn.layer_type

    def forward(self, x, context, cos, sin, attention_mask, past_key_values=None):
        # The fused context is *not* normalised here: it only enters as keys/values (k_norm handles it).
        x = x + self.self_attn(self.input_layernorm(x), context, cos, sin, attention_mask, past_key_values)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_blocks(self, x, ctx_k, ctx_v, cos, sin, layout, rows: SlotRows | None = None):
        """``rows``: ``x`` in factored form (the first layer), so the norm and projections run per row."""
        if rows is None:
            h = self.input_layernorm(x)
        else:
            h = SlotRows(self.input_layernorm(rows.first), self.input_layernorm(rows.rest))
        attn = self.self_attn.forward_blocks(h, ctx_k, ctx_v, cos, sin, layout)
        if layout.drops_first_slot:
            x = drop_first_slot(x, layout.block_size)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x))


# ---------------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------------


class DFlashDrafter(nn.Module):
    """DFlash drafter; weights interchangeable with z-lab ``DFlashDraftModel`` via ``load_state_dict``."""

    layer_class: type[DrafterLayer] = DrafterLayer
    # Block slots interact only through attention: the training layout may factor the first layer's
    # mask-token rows (``SlotRows``) and drop the last layer's slot-0 queries. DFlash 2's in-block
    # convolutions mix neighbouring slots, so it sets this False.
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
            elif isinstance(module, Qwen3RMSNorm):
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
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        x = noise_embedding
        for layer in self.layers:
            mask = attention_mask[layer.layer_type] if isinstance(attention_mask, dict) else attention_mask
            if self._checkpoint_layers():
                x = checkpoint(layer, x, context, cos, sin, mask, past_key_values, use_reentrant=False)
            else:
                x = layer(x, context, cos, sin, mask, past_key_values)
        return self.norm(x)

    def _checkpoint_layers(self) -> bool:
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

    def context_kv(self, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, keys and values ``[b, kv_heads, ctx, d]`` of a fused ``context`` at positions 0..ctx-1.

        Training computes them once per step: every block and every chunk of blocks reads slices of them.
        """
        positions = torch.arange(context.shape[1], device=context.device)[None]
        cos, sin = self.rotary_emb(context, positions)
        return [layer.self_attn.context_kv(context, cos, sin) for layer in self.layers]

    def decode_blocks(
        self,
        noise_embedding: torch.Tensor,
        context_kv: list[tuple[torch.Tensor, torch.Tensor]],
        block_positions: torch.Tensor,
        layouts: list[BlockLayout],
        rows: SlotRows | None = None,
    ) -> torch.Tensor:
        """Normed hidden states of block tokens (training layout, see ``BlockLayout``): ``[b, N*B, H]``,
        or ``[b, N*(B-1), H]`` (slots 1..B-1) when the last layout drops slot 0.

        ``block_positions`` ``[b, N*B]`` are the absolute positions of the block tokens, ``context_kv``
        comes from ``context_kv``, ``layouts`` has one layout per layer (only the last may drop slot 0).
        ``rows``: ``noise_embedding`` in factored form (``SlotRows``), when slots 1..B-1 share one row.
        """
        cos, sin = self.rotary_emb(noise_embedding, block_positions)
        x = noise_embedding
        for i, (layer, (k, v), layout) in enumerate(zip(self.layers, context_kv, layouts, strict=True)):
            args = (x, k, v, cos, sin, layout, rows if i == 0 else None)
            if self._checkpoint_layers():
                x = checkpoint(layer.forward_blocks, *args, use_reentrant=False)
            else:
                x = layer.forward_blocks(*args)
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
