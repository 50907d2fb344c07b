"""Batched greedy decoding for regeneration (continuous batching), each row bit for bit what it gives alone
(not transformers' ``generate``'s: other kernels). A batched float computation may round a row differently
(a CPU ``linear`` over 1-3 rows takes other kernels; attention over padded keys rounds differently), so: the
prefill runs per prompt; a step runs every slot (at least ``MIN_ROWS``, idle slots standing in); attention
runs over fixed blocks of ``BLOCK`` keys on fixed shapes (keys past a row's length masked to an exact 0),
combined by a sequential ``cumsum``. Llama-shaped decoders only (``SlotDecoder.supports``); others decode one
prompt at a time (``generation.greedy_continuations``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn

from .decoding import full_attention, prefill, target_device, text_config

__all__ = ["BLOCK", "MIN_ROWS", "SlotDecoder"]

MIN_ROWS = 4  # a CPU linear over fewer rows takes another kernel
BLOCK = 32  # keys per attention block


@attrs.define(eq=False)
class _Parts:
    """A Llama-shaped decoder's parts, called directly on the decoding step (transformers' own modules)."""

    embed: Any
    layers: Any
    norm: Any
    rotary: Any
    lm_head: Any
    rope: Any  # the modeling module's apply_rotary_pos_emb
    kv_heads: int
    head_dim: int


def _parts(model: nn.Module) -> _Parts | None:
    import sys

    config = text_config(model)
    if getattr(config, "model_type", None) not in ("llama", "qwen2", "qwen3", "mistral"):
        return None
    base = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in need) or getattr(model, "lm_head", None) is None or \
            not full_attention(config):
        return None
    attn = base.layers[0].self_attn
    if getattr(config, "use_sliding_window", False) or any(
            getattr(layer.self_attn, "sliding_window", None) for layer in base.layers) or (
            config.model_type == "mistral" and getattr(config, "sliding_window", None)):
        return None
    rope = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if rope is None or getattr(config, "final_logit_softcapping", None) or getattr(config, "attn_logit_softcapping", None):
        return None
    return _Parts(base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.lm_head, rope,
                  int(config.num_key_value_heads), int(attn.head_dim))


class SlotDecoder:
    """Greedy decoding of many prompts in ``slots`` rows (continuous batching): ``add(key, ids)`` prefills a
    free slot; ``step()`` decodes a token per busy slot and returns the ended replies, ``(key, new ids, "stop" |
    "length")``. Busy rows are kept first, so a step computes only them (at least ``MIN_ROWS``)."""

    def __init__(self, model: nn.Module, *, slots: int, max_new_tokens: int, stop_ids: Sequence[int] = ()):
        if max_new_tokens < 1 or slots < 1:
            raise ValueError("slots and max_new_tokens must be >= 1")
        parts = _parts(model)
        if parts is None:
            raise ValueError("batched decoding needs a Llama-shaped decoder (SlotDecoder.supports)")
        self.model, self.parts = model, parts
        self.slots = int(slots)
        self.rows = max(self.slots, MIN_ROWS)
        self.max_new = int(max_new_tokens)
        self.stops = {int(t) for t in stop_ids}
        self.device = target_device(model)
        self.busy = 0  # rows 0 .. busy-1 are decoding
        self.keys: list[Any] = [None] * self.rows  # the caller's key of each row's prompt
        self.lengths = [0] * self.rows  # tokens in each row's cache
        self.new: list[list[int]] = [[] for _ in range(self.rows)]
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.nblocks = 0
        self.finished: list[tuple[Any, list[int], str]] = []

    @staticmethod
    def supports(model: nn.Module) -> bool:
        return _parts(model) is not None

    @property
    def free(self) -> int:
        return self.slots - self.busy

    def _room(self, tokens: int) -> None:
        """Every layer's cache holds ``tokens`` per row (grown by whole blocks, contents kept)."""
        need = -(-tokens // BLOCK)
        if need <= self.nblocks:
            return
        grow = max(need, 2 * self.nblocks)
        p, dt = self.parts, next(self.model.parameters()).dtype
        shape = (self.rows, p.kv_heads, grow, BLOCK, p.head_dim)
        kv = []
        for i in range(len(p.layers)):
            k, v = torch.zeros(shape, dtype=dt, device=self.device), torch.zeros(shape, dtype=dt, device=self.device)
            if self.kv:
                k[:, :, : self.nblocks], v[:, :, : self.nblocks] = self.kv[i]
            kv.append((k, v))
        self.kv, self.nblocks = kv, grow

    def _ended(self, tokens: list[int]) -> str | None:
        if tokens[-1] in self.stops:
            return "stop"
        return "length" if len(tokens) >= self.max_new else None

    @torch.inference_mode()
    def add(self, key: Any, ids: Sequence[int]) -> None:
        """Prefill ``ids`` (alone: the model's own forward) into a free slot; its first token is chosen."""
        if not self.free:
            raise RuntimeError("no free slot")
        if not len(ids):
            raise ValueError("empty prompt")
        row = self.busy
        ids_t = torch.as_tensor(list(ids), dtype=torch.long, device=self.device)[None]
        out, cache = prefill(self.model, ids_t, hidden_states=False)
        tokens = [int(out.logits[0, -1].argmax())]
        reason = self._ended(tokens)
        if reason is not None:
            self.finished.append((key, tokens, reason))
            return
        n = ids_t.shape[1]
        self._room(n + self.max_new)
        for (k, v), layer in zip(self.kv, cache.layers, strict=True):
            k[row].view(k.shape[1], -1, k.shape[-1])[:, :n] = layer.keys[0]
            v[row].view(v.shape[1], -1, v.shape[-1])[:, :n] = layer.values[0]
        self.keys[row], self.lengths[row], self.new[row] = key, n, tokens
        self.busy += 1

    def _drop(self, row: int) -> None:
        """Row ``row`` ended: the last busy row takes its place."""
        last = self.busy - 1
        if row != last:
            used = -(-self.lengths[last] // BLOCK)
            for k, v in self.kv:
                k[row, :, :used], v[row, :, :used] = k[last, :, :used], v[last, :, :used]
            self.keys[row], self.lengths[row], self.new[row] = self.keys[last], self.lengths[last], self.new[last]
        self.keys[last], self.lengths[last], self.new[last] = None, 0, []
        self.busy -= 1

    @torch.inference_mode()
    def step(self) -> list[tuple[Any, list[int], str]]:
        """One token for every busy slot; the replies that ended since the last call (prefills included)."""
        if self.busy:
            n, rows = self.busy, max(self.busy, MIN_ROWS)
            # rows past the busy ones stand in (the linear's row count): token 0 at position 0, their own key
            tokens = torch.tensor([[self.new[r][-1]] for r in range(n)] + [[0]] * (rows - n), dtype=torch.long,
                                  device=self.device)
            choice = self._forward(tokens, self.lengths[:n] + [0] * (rows - n)).tolist()
            ended = []
            for r in range(n):
                self.lengths[r] += 1
                self.new[r].append(int(choice[r]))
                reason = self._ended(self.new[r])
                if reason is not None:
                    self.finished.append((self.keys[r], self.new[r], reason))
                    ended.append(r)
            for r in reversed(ended):
                self._drop(r)
        done, self.finished = self.finished, []
        return done

    def _forward(self, tokens: torch.Tensor, at: list[int]) -> torch.Tensor:
        p = self.parts
        rows = tokens.shape[0]
        pos = torch.tensor(at, dtype=torch.long, device=self.device)
        n_keys = pos + 1
        width = -(-int(n_keys.max()) // BLOCK)  # blocks in use
        keep = (torch.arange(width * BLOCK, device=self.device)[None] < n_keys[:, None]).view(rows, 1, width, 1, BLOCK)
        h = p.embed(tokens)
        cos, sin = p.rotary(h, pos[:, None])
        row_idx = torch.arange(rows, device=self.device)
        blk, off = pos // BLOCK, pos % BLOCK
        for layer, (kc, vc) in zip(p.layers, self.kv, strict=True):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(rows, 1, -1, p.head_dim)
            k = attn.k_proj(x).view(rows, 1, -1, p.head_dim)
            v = attn.v_proj(x).view(rows, 1, -1, p.head_dim)
            if hasattr(attn, "q_norm"):
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = p.rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)  # [rows, heads, 1, d]
            kc[row_idx, :, blk, off] = k[:, :, 0]
            vc[row_idx, :, blk, off] = v[:, 0]
            o = _block_attention(q, kc[:rows, :, :width], vc[:rows, :, :width], keep, attn.scaling)
            h = h + attn.o_proj(o.reshape(rows, 1, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return p.lm_head(p.norm(h))[:, -1].argmax(dim=-1)


def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """One query per row over its keys in blocks: ``q`` ``[rows, heads, 1, d]``, ``k``/``v`` ``[rows, kv heads,
    blocks, BLOCK, d]``, ``keep`` ``[rows, 1, blocks, 1, BLOCK]`` (a row's keys); ``[rows, heads, d]``."""
    rows, heads, _, d = q.shape
    kv_heads = k.shape[1]
    blocks = k.shape[2]
    group = heads // kv_heads
    # query heads grouped by their kv head, one copy per block: a bmm of fixed [group, d] x [d, BLOCK] products
    # (a broadcast matmul would fold the blocks into one wider product, whose rounding depends on the width)
    q = q.reshape(rows, kv_heads, 1, group, d).expand(rows, kv_heads, blocks, group, d)
    s = torch.bmm(q.reshape(-1, group, d), k.reshape(-1, BLOCK, d).transpose(1, 2))
    s = s.view(rows, kv_heads, blocks, group, BLOCK) * scaling
    s = s.masked_fill(~keep, float("-inf"))
    top = s.amax(dim=(-1, -3), keepdim=True)  # the row's max over its keys (exact: masked keys are -inf)
    e = torch.exp(s - top)  # masked keys: exactly 0
    pv = torch.bmm(e.reshape(-1, group, BLOCK), v.reshape(-1, BLOCK, d)).view(rows, kv_heads, blocks, group, d)
    part = torch.cat([pv, e.sum(-1, keepdim=True)], dim=-1)  # per block: p.v and the exp-sum
    total = part.cumsum(dim=2)[:, :, -1]  # a sequential scan over blocks: trailing all-masked blocks add 0
    return (total[..., :d] / total[..., d:]).reshape(rows, heads, d)
