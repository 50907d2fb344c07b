"""The row-exact batched forward: a ragged KV cache and the rules that make each row of a batched forward
compute bit for bit what it computes alone (``batched`` decodes and walks on it; ``tests/model/test_batched.py``):

* **attention, row by row**: each row's attention runs alone over exactly its own keys (:class:`RaggedCache`;
  SDPA's CPU kernel rounds a softmax over ``n`` keys differently from ``n`` keys plus masked padding), with the
  one-row call's mask, GQA handling and layout (:class:`RowExact` intercepts ``scaled_dot_product_attention``);
* **linear layers by row count**: a CPU ``linear`` over fewer than 4 rows takes another kernel. Rows with 4 or
  more tokens share one call; rows with 1-3 go through ``bmm`` with the weight expanded (their one-row result);
* **the rest per row**: each prompt prefills alone (``decoding.prefill``); callers draw per row and batch rows
  near their end separately.

Elementwise kernels agree too, given a head width that is a multiple of 16 floats (as in every model here).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .decoding import cache_kwarg, text_config

__all__ = ["SMALL_ROWS", "RaggedCache", "RowExact", "RowPlan", "plan_writes", "target_forward"]

#: A CPU linear over fewer rows than this takes another kernel (see the module docstring).
SMALL_ROWS = 4


@attrs.define
class RowPlan:
    """One batched forward: batch row ``g`` is cache row ``rows[g]``; its ``segments`` (ranges of the keys a
    layer hands the cache) go after its ``base`` tokens; its queries are the first ``q_lens[g]``, its keys the
    first ``kv_lens[g]``. ``causal``: queries see keys up to their own position (the target's block), else no
    mask. ``axes``: padded sequence length -> each row's own length (the linear rule)."""

    rows: list[int]
    q_lens: list[int]
    kv_lens: list[int]
    causal: bool
    axes: dict[int, list[int]]
    base: list[int] = attrs.field(factory=list)
    segments: list[list[tuple[int, int]]] = attrs.field(factory=list)
    masks: list[torch.Tensor | None] = attrs.field(factory=list)
    writes: tuple[torch.Tensor, ...] = ()


class RaggedCache:
    """A KV cache whose row ``r`` holds ``lengths[r]`` tokens (per layer a ``[rows, kv heads, capacity, d]``
    store). ``update`` takes a layer's new keys as a transformers ``Cache`` does (returned unchanged:
    :class:`RowExact` reads each row's keys from here), placed as the current plan says."""

    def __init__(self, capacity: int = 64) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: list[int] = []
        self.capacity = int(capacity)
        self.plan: RowPlan | None = None
        self.layer = -1

    def add_row(self) -> int:
        self.lengths.append(0)
        return len(self.lengths) - 1

    def _store(self, store: dict[int, torch.Tensor], layer: int, like: torch.Tensor, length: int) -> torch.Tensor:
        """``store[layer]`` with room for every row and ``length`` tokens."""
        old = store.get(layer)
        rows = len(self.lengths)
        have_rows, have_len = (old.shape[0], old.shape[2]) if old is not None else (0, 0)
        if old is not None and have_rows >= rows and have_len >= length:
            return old
        cap = max(length, self.capacity, 2 * have_len if have_len < length else 0, have_len)
        n = max(rows, 2 * have_rows if have_rows < rows else 0, have_rows)
        grown = like.new_zeros(n, like.shape[1], cap, like.shape[-1])
        if old is not None:
            grown[: old.shape[0], :, : old.shape[2]] = old
        self.capacity = max(self.capacity, cap)
        store[layer] = grown
        return grown

    def fork_row(self, row: int) -> int:
        """A new row holding a copy of ``row`` (what ``BlockDrafter.fork`` copies)."""
        new = self.add_row()
        self.lengths[new] = self.lengths[row]
        for store in (self.keys, self.values):
            for layer, t in list(store.items()):
                t = self._store(store, layer, t, t.shape[2])
                t[new] = t[row]
        return new

    def load_row(self, row: int, cache: Any) -> None:
        """Row ``row`` := the contents of a transformers ``DynamicCache`` of one sequence."""
        n = int(cache.layers[0].keys.shape[-2])
        for i, layer in enumerate(cache.layers):
            for store, t in ((self.keys, layer.keys), (self.values, layer.values)):
                self._store(store, i, t, n)[row, :, :n] = t[0]
        self.lengths[row] = n

    def row_kv(self, layer: int, row: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row ``row``'s first ``length`` keys and values of ``layer`` (views)."""
        return self.keys[layer][row : row + 1, :, :length], self.values[layer][row : row + 1, :, :length]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        plan = self.plan
        if plan is None:
            raise RuntimeError("RaggedCache used outside a batched forward")
        src_g, src_t, dst_r, dst_p = plan.writes
        need = max(plan.kv_lens)
        for store, new in ((self.keys, key), (self.values, value)):
            self._store(store, layer_idx, new, need)[dst_r, :, dst_p] = new[src_g, :, src_t]
        self.layer = layer_idx
        return key, value

    # transformers may ask a cache this; the batched forwards pass positions and masks themselves
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths, default=0)


def plan_writes(rows: Sequence[int], base: Sequence[int], segments: Sequence[Sequence[tuple[int, int]]],
            device: torch.device) -> tuple[torch.Tensor, ...]:
    """Index tensors of a plan's appends: source (batch row, position) -> destination (cache row, position)."""
    sg, st, dr, dp = [], [], [], []
    for g, (row, at, segs) in enumerate(zip(rows, base, segments, strict=True)):
        for a, b in segs:
            sg += [g] * (b - a)
            st += range(a, b)
            dr += [row] * (b - a)
            dp += range(at, at + b - a)
            at += b - a
    return tuple(torch.tensor(x, dtype=torch.long, device=device) for x in (sg, st, dr, dp))


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    """transformers' ``repeat_kv`` (the same expand and reshape, so the same tensor)."""
    b, heads, length, d = x.shape
    return x[:, :, None].expand(b, heads, n, length, d).reshape(b, heads * n, length, d)


def _causal_mask(q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """What transformers' ``sdpa_mask`` gives one row of ``q_len`` queries after ``kv_len - q_len`` cached
    tokens: ``[1, 1, q, kv]`` bool, query ``i`` sees keys ``j <= kv - q + i``."""
    q = torch.arange(q_len, device=device)[:, None] + (kv_len - q_len)
    return (torch.arange(kv_len, device=device)[None, :] <= q).view(1, 1, q_len, kv_len)


def _bmm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` of ``x`` ``[G, n, in]`` through ``bmm`` with the weight expanded: each row's one-row result."""
    w = weight.t().expand(x.shape[0], *weight.t().shape)
    return torch.bmm(x, w) if bias is None else torch.baddbmm(bias.expand(*x.shape[:2], -1), x, w)


class RowExact(TorchFunctionMode):
    """Inside one batched forward: attention row by row over each row's own keys, and linear layers by row
    count (the module docstring's rules)."""

    def __init__(self, plan: RowPlan, cache: RaggedCache | None) -> None:
        super().__init__()
        self.plan = plan
        self.cache = cache

    def __enter__(self):
        if self.cache is not None:
            self.cache.plan = self.plan
        return super().__enter__()

    def __exit__(self, *exc):
        if self.cache is not None:
            self.cache.plan = None
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self._attention(*args, **kwargs)
        if func is F.linear:
            return self._linear(*args, **kwargs)
        return func(*args, **kwargs)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        plan = self.plan
        lens = plan.axes.get(x.shape[1]) if x.dim() == 3 and x.shape[0] == len(plan.rows) else None
        if lens is None or min(lens) >= SMALL_ROWS:
            return F.linear(x, weight, bias)
        if min(lens) == max(lens) == x.shape[1]:  # every row its own few tokens (one-token decoding)
            return _bmm_linear(x, weight, bias)
        out = F.linear(x, weight, bias) if max(lens) >= SMALL_ROWS else x.new_zeros(*x.shape[:2], weight.shape[0])
        for n in sorted({n for n in lens if 0 < n < SMALL_ROWS}):
            idx = [g for g, m in enumerate(lens) if m == n]
            out[idx, :n] = _bmm_linear(x[idx, :n], weight, bias)
        return out

    def _attention(self, q, k, v, attn_mask=None, **kwargs):
        plan = self.plan
        out = q.new_zeros(q.shape)
        for g, row in enumerate(plan.rows):
            ql, kl = plan.q_lens[g], plan.kv_lens[g]
            if self.cache is not None:
                kg, vg = self.cache.row_kv(self.cache.layer, row, kl)
                if k.shape[1] != kg.shape[1]:  # transformers repeated the KV heads (a masked call)
                    kg, vg = _repeat_kv(kg, k.shape[1] // kg.shape[1]), _repeat_kv(vg, k.shape[1] // kg.shape[1])
                else:  # as a DynamicCache holds them
                    kg, vg = kg.contiguous(), vg.contiguous()
            else:
                kg, vg = k[g : g + 1, :, :kl], v[g : g + 1, :, :kl]
            mask = plan.masks[g] if plan.causal else None
            out[g : g + 1, :, :ql] = F.scaled_dot_product_attention(q[g : g + 1, :, :ql], kg, vg, attn_mask=mask,
                                                                    **kwargs)
        return out


def target_forward(target: nn.Module, cache: RaggedCache, rows: Sequence[int], ids: torch.Tensor,
                    starts: Sequence[int], *, hidden_states: bool) -> Any:
    """The target on ``ids`` ``[G, q]`` (row ``g``'s first at position ``starts[g]``, after that many
    cached tokens of cache row ``rows[g]``), each row alone in attention."""
    g_rows, q = ids.shape
    device = ids.device
    positions = torch.stack([torch.arange(s, s + q, device=device) for s in starts])
    kv = [s + q for s in starts]
    plan = RowPlan(rows=list(rows), q_lens=[q] * g_rows, kv_lens=kv, causal=q > 1, axes={q: [q] * g_rows},
                 base=list(starts), segments=[[(0, q)]] * g_rows,
                 masks=[_causal_mask(q, k, device) for k in kv] if q > 1 else [])
    plan.writes = plan_writes(plan.rows, plan.base, plan.segments, device)
    # A mask given: transformers then handles the KV heads as the one-row call with its mask does; one query:
    # none, as the one-row decoding step has none.
    stand_in = torch.ones(g_rows, 1, q, 1, dtype=torch.bool, device=device) if q > 1 else None
    masks = {t: stand_in for t in set(getattr(text_config(target), "layer_types", None) or ["full_attention"])}
    with RowExact(plan, cache):
        return target(input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True,
                      output_hidden_states=hidden_states, **{cache_kwarg(target): cache})
