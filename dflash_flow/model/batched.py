"""Batched decoding for evaluation, each row bit for bit what it computes alone: many prompts at once (each
committing what ``generation.spec_generate`` commits for it alone), and the drafter's side of the batched
teacher-forced walk (:class:`BatchDrafter`, for ``walk.walk_batch``). The row-exact rules:

* attention row by row, over exactly the row's own keys (:class:`RaggedCache`; SDPA's CPU kernel rounds a
  softmax over ``n`` keys differently from ``n`` plus masked padding), with the one-row call's mask, GQA
  handling and layout (:class:`RowExact`);
* linear layers by row count: a CPU ``linear`` over fewer than ``SMALL_ROWS`` rows takes another kernel, so
  rows of 1-3 tokens go through ``bmm`` with the weight expanded (their one-row result);
* the rest per row: each prompt prefills alone and samples from its own generator in the one-row order; rows
  near their end (a shorter block) form batches of their own.

Elementwise kernels agree too, given a head width that is a multiple of 16 floats (as in every model here).
:func:`batchable` says whether the models allow it; else callers decode one prompt at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from .block_drafter import BlockDrafter, DraftSettings, draft_settings, features
from .decoding import cache_kwarg, full_attention, prefill, target_device, text_config
from .generation import Decoding, Sampling, SpecResult, accept, as_batch_of_one, propose, start_decoding

__all__ = ["SMALL_ROWS", "BatchDrafter", "RaggedCache", "RowExact", "RowPlan", "batchable", "greedy_generate_batch",
           "plan_writes", "spec_generate_batch", "target_forward"]

SMALL_ROWS = 4  # a CPU linear over fewer rows takes another kernel


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


def batchable(target: nn.Module, drafter: nn.Module | None = None) -> bool:
    """Whether the batched loops reproduce the one-prompt ones for these models: an fp32 SDPA target of full
    causal attention layers and (when given) one of our fp32 drafters attending without a mask."""
    config = getattr(target, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    if not full_attention(text_config(target)) or next(target.parameters()).dtype != torch.float32:
        return False
    if drafter is None:
        return True
    from .drafter import DFlashDrafter

    if not isinstance(drafter, DFlashDrafter) or next(drafter.parameters()).dtype != torch.float32:
        return False
    return all(not layer.self_attn.is_causal and layer.self_attn.sliding_window is None for layer in drafter.layers)


class BatchDrafter:
    """``block_drafter.BlockDrafter`` for many rows: each row a draft KV cache of its own (a row of one
    :class:`RaggedCache`), one row-exact drafter forward for the rows of a step."""

    def __init__(self, target: nn.Module, drafter: nn.Module, settings: DraftSettings) -> None:
        self.one = BlockDrafter(target, drafter, settings)
        self.drafter = drafter
        self.settings = settings
        self.cache = RaggedCache()
        self.selects = self.one.selects

    def forward(self, rows: Sequence[int], blocks: torch.Tensor, contexts: Sequence[torch.Tensor],
                starts: Sequence[int],
                then: Callable[[torch.Tensor, torch.Tensor], Any] | None = None) -> Any:
        """The drafter on ``blocks`` ``[G, v]`` (row ``g`` starting at ``starts[g]``, context ``contexts[g]``
        ``[1, c, F]``): ``then(hidden, logits)`` of slots 1.. inside the row-exact mode (default: the pair).
        Each row's cache is cropped back to its block's start, as ``BlockDrafter.hidden`` does."""
        one, device = self.one, self.one.device
        g_rows, v = blocks.shape
        cs = [int(c.shape[1]) for c in contexts]
        c_pad = max(cs)
        while c_pad in (v, v - 1):  # the context's padded length names it for the linear rule
            c_pad += 1
        ctx = contexts[0].new_zeros(g_rows, c_pad, contexts[0].shape[-1], device=device)
        positions = torch.empty(g_rows, c_pad + v, dtype=torch.long, device=device)
        for g, (c, s) in enumerate(zip(contexts, starts, strict=True)):
            ctx[g, : cs[g]] = c[0].to(device)
            positions[g, : cs[g]] = torch.arange(s - cs[g], s, device=device)
            positions[g, cs[g] : c_pad] = s
            positions[g, c_pad:] = torch.arange(s, s + v, device=device)
        noise = F.embedding(blocks.to(device), one.embed_weight)
        if self.settings.embed_scale != 1.0:
            noise = noise * self.settings.embed_scale
        base = [self.cache.lengths[r] for r in rows]
        plan = RowPlan(
            rows=list(rows), q_lens=[v] * g_rows, kv_lens=[b + c + v for b, c in zip(base, cs, strict=True)],
            causal=False, axes={c_pad: cs, v: [v] * g_rows, v - 1: [v - 1] * g_rows}, base=base,
            segments=[[(0, c), (c_pad, c_pad + v)] for c in cs],
        )
        plan.writes = plan_writes(plan.rows, plan.base, plan.segments, device)
        with RowExact(plan, self.cache):
            hidden = self.drafter(position_ids=positions, noise_embedding=noise, target_hidden=ctx,
                                  attention_mask=None, past_key_values=self.cache, use_cache=True)
            if not isinstance(hidden, torch.Tensor):
                hidden = hidden[0]
            hidden = hidden[:, 1:v]
            logits = one._logits(hidden)
            result = then(hidden, logits) if then is not None else (hidden, logits)
        for r, s in zip(rows, starts, strict=True):
            self.cache.lengths[r] = s
        return result

    def greedy_drafts(self, rows, blocks, contexts, starts) -> torch.Tensor:
        """Each row's greedy drafts ``[G, v - 1]``: the argmax, or a DFlash 2 selector's walk (batched:
        its ops are per row)."""
        if not self.selects:
            return self.forward(rows, blocks, contexts, starts, lambda h, lg: lg.argmax(dim=-1))
        from .dflash2 import select_path

        def walk(hidden, logits):
            return select_path(self.drafter.candidate_selector, hidden, logits, blocks[:, 0].to(hidden.device))[0]

        return self.forward(rows, blocks, contexts, starts, walk)


@attrs.define(eq=False)
class _Row(Decoding):
    cache_row: int = 0
    draft_row: int = 0


@torch.inference_mode()
def spec_generate_batch(target: nn.Module, drafter: nn.Module, prompts: Sequence[Sequence[int]], *,
                        max_new_tokens: int, block_size: int | None = None, mask_token_id: int | None = None,
                        target_layer_ids: Sequence[int] | None = None,
                        stop_token_ids: Sequence[int] | None = None, sampling: Sampling | None = None,
                        generators: Sequence[torch.Generator | None] | None = None,
                        traces: Sequence[list] | None = None, accepted_drafts: Sequence[list] | None = None,
                        batch_size: int = 64) -> list[SpecResult]:
    """``generation.spec_generate`` of every prompt (``traces[i]``, ``accepted_drafts[i]``, ``generators[i]`` as
    there), ``batch_size`` prompts together, each with the same results. Needs :func:`batchable` models."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    settings = draft_settings(drafter, block_size=block_size, mask_token_id=mask_token_id,
                              target_layer_ids=target_layer_ids)
    if len(prompts) and settings.block_size < 2:
        raise ValueError("batched speculative decoding needs block_size >= 2 (a drafter that proposes)")
    sampling = sampling if sampling is not None else Sampling()
    device = target_device(target)
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)
    step = max(1, int(batch_size))
    out: list[SpecResult] = []
    for lo in range(0, len(prompts), step):
        cache, drafts = RaggedCache(), BatchDrafter(target, drafter, settings)
        rows: dict[int, _Row] = {}
        for i in range(lo, min(lo + step, len(prompts))):
            d, dyn = start_decoding(target, as_batch_of_one(list(prompts[i]), device), max_new_tokens, settings,
                                    sampling, generators[i] if generators is not None else None, stops)
            rows[i] = _Row(**attrs.asdict(d, recurse=False), cache_row=cache.add_row(), draft_row=drafts.cache.add_row())
            cache.load_row(rows[i].cache_row, dyn)
        while any(r.active for r in rows.values()):
            by_verify: dict[int, list[int]] = {}
            for i, r in rows.items():
                if r.active:
                    by_verify.setdefault(min(settings.block_size, r.max_length - r.start), []).append(i)
            for verify, members in by_verify.items():
                _spec_step(target, drafts, cache, [rows[i] for i in members], verify, sampling, settings, stops,
                           [traces[i] for i in members] if traces is not None else None,
                           [accepted_drafts[i] for i in members] if accepted_drafts is not None else None)
        out.extend(r.result(r.target_forwards - 1) for r in rows.values())  # a drafter call every step
    return out


def _spec_step(target, drafts: BatchDrafter, cache: RaggedCache, rows: list[_Row], verify: int,
               sampling: Sampling, settings: DraftSettings, stops: torch.Tensor, traces, accepted_drafts) -> None:
    """One verify step of ``rows`` (all with blocks of ``verify`` slots), as ``spec_generate``'s loop body."""
    starts = [r.start for r in rows]
    blocks = torch.stack([r.seq[r.start : r.start + verify] for r in rows]).clone()
    draft_probs: list[torch.Tensor | None] = [None] * len(rows)
    contexts = [r.pending for r in rows]
    draft_rows = [r.draft_row for r in rows]
    if sampling.greedy:
        blocks[:, 1:] = drafts.greedy_drafts(draft_rows, blocks, contexts, starts).to(blocks.device)
    else:
        hidden, logits = drafts.forward(draft_rows, blocks, contexts, starts)
        for g, r in enumerate(rows):  # each row draws from its own generator, in the one-row order
            proposed, draft_probs[g] = propose(drafts.drafter, drafts.selects, hidden[g : g + 1], logits[g : g + 1],
                                               blocks[g : g + 1], sampling, r.generator)
            blocks[g, 1:] = proposed[0]
    if traces is not None:
        for g, trace in enumerate(traces):
            trace.append((starts[g], blocks[g, 1:].tolist()))
    out = target_forward(target, cache, [r.cache_row for r in rows], blocks, starts, hidden_states=True)
    feats = features(out.hidden_states, settings.layer_ids)
    for g, r in enumerate(rows):
        r.target_forwards += 1
        accepted, nxt = accept(out.logits[g], blocks[g, 1:], draft_probs[g], sampling, r.generator)
        if accepted_drafts is not None:
            accepted_drafts[g].append(int(accepted))
        r.commit(blocks[g, 1:], accepted, nxt, stops, feats[g : g + 1])
        cache.lengths[r.cache_row] = r.start


@torch.inference_mode()
def greedy_generate_batch(target: nn.Module, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop_token_ids: Sequence[int] | None = None, *,
                          batch_size: int = 64) -> list[SpecResult]:
    """``generation.greedy_generate`` of every prompt, ``batch_size`` at a time: the same tokens, each
    row's numbers its own (one token per row and step through the row-exact forward)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target_device(target)
    stops = {int(t) for t in stop_token_ids or ()}
    results: list[SpecResult] = []
    step = max(1, int(batch_size))
    for lo in range(0, len(prompts), step):
        cache = RaggedCache()
        ids_list, new, done = [], [], []
        for prompt in prompts[lo : lo + step]:
            ids = as_batch_of_one(list(prompt), device)
            pre, dyn = prefill(target, ids, hidden_states=False)
            cache.load_row(cache.add_row(), dyn)
            tok = int(pre.logits[0, -1].float().argmax())
            ids_list.append(ids)
            new.append([tok])
            done.append(tok in stops or max_new_tokens == 1)
        while not all(done):
            live = [i for i, d in enumerate(done) if not d]
            toks = torch.tensor([[new[i][-1]] for i in live], dtype=torch.long, device=device)
            out = target_forward(target, cache, live, toks, [cache.lengths[i] for i in live], hidden_states=False)
            for g, i in enumerate(live):
                cache.lengths[i] += 1
                tok = int(out.logits[g, -1].float().argmax())
                new[i].append(tok)
                done[i] = tok in stops or len(new[i]) >= max_new_tokens
        results.extend(SpecResult.greedy(ids, tokens) for ids, tokens in zip(ids_list, new, strict=True))
    return results
