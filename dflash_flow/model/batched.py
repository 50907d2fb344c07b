"""Batched decoding for evaluation: many prompts (or teacher-forced walks) at once, each row computing
bit for bit what it computes alone.

Evaluation decodes a few dozen short prompts with a small model; one at a time, every step pays the
framework's per-forward cost for a handful of tokens. Here the active rows of a step go through the target
(and the drafter) in one forward, while each row's acceptance stays its own: a row commits what
``generation.spec_generate`` would commit for that prompt alone, its drafter and target KV caches hold
exactly its own tokens, and it stops on its own stop token or length.

Same numbers, not just close ones: a batched float computation may round differently from the one-row
computation, and a greedy argmax near a tie then flips. Three things make a row's numbers identical here
(checked bit for bit on CPU by ``tests/model/test_batched.py``):

* **attention, row by row**: each row's attention runs alone over exactly its own keys (a ragged KV cache,
  :class:`RaggedCache`; no padding among the keys: SDPA's CPU kernel rounds a softmax over ``n`` keys
  differently from one over ``n`` keys plus masked padding), with the mask, GQA handling and memory layout
  the one-row call has (:class:`_RowExact` intercepts ``scaled_dot_product_attention``);
* **linear layers by row count**: a CPU ``linear`` over fewer than 4 rows takes another kernel than over 4
  or more, and a row's result differs between them. Rows that have 4 or more tokens of their own share one
  call (rows are independent in that kernel); rows with 1-3 tokens (the drafter's new context after a short
  acceptance, the plain greedy reference's one token) go through ``bmm`` with the weight expanded, which
  gives each row exactly its one-row result;
* **everything else per row where it draws or is ragged**: the prefill runs per prompt (the one-row call
  itself), each prompt samples from its own generator in the one-row order, rows near their end (a shorter
  block) form batches of their own.

Elementwise kernels (RoPE's cos/sin, SiLU, the norms) are per element and the same in both; this holds
when a head's width is a multiple of 16 floats, as in every model here (a vector kernel's scalar tail
could otherwise round one element differently). The target must be a decoder whose attention layers are
all full causal attention, and the drafter one of ours whose layers attend without a mask (DFlash's
default); :func:`batchable` says so, else the callers decode one prompt at a time.
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
from .decoding import cache_kwarg, new_cache, target_device
from .generation import SpecResult
from .sampling import Sampling, sample_from, sampling_probs, verify_sampled

__all__ = ["RaggedCache", "batchable", "greedy_generate_batch", "spec_generate_batch"]

#: A CPU linear over fewer rows than this takes another kernel (see the module docstring).
SMALL_ROWS = 4


# ---------------------------------------------------------------------------------------------------
# The ragged cache and the row-exact forward
# ---------------------------------------------------------------------------------------------------


@attrs.define
class _Plan:
    """One batched forward: batch row ``g`` is cache row ``rows[g]``; its ``segments`` (ranges along the
    sequence axis of the keys a layer hands the cache) are appended after its ``base`` tokens; its queries
    are the first ``q_lens[g]`` and its keys the first ``kv_lens[g]``. ``causal``: each row's queries see
    the keys up to their own position (the target's block); else no mask (the drafter, one-token
    decoding, or a no-cache forward, whose call says ``is_causal`` itself). ``axes``: padded sequence
    length -> each row's own length (the linear rule)."""

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
    """A KV cache whose rows each hold their own number of tokens (per layer one ``[rows, kv heads,
    capacity, d]`` store; row ``r`` holds ``lengths[r]`` tokens, what lies past them is stale). Layers hand
    it their new keys through ``update`` as they hand a transformers ``Cache`` (it returns them unchanged:
    :class:`_RowExact` reads each row's keys from here); what each batch row appends, and where, is the
    current plan's."""

    def __init__(self, capacity: int = 64) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.lengths: list[int] = []
        self.capacity = int(capacity)
        self.plan: _Plan | None = None
        self.layer = -1

    def add_row(self) -> int:
        self.lengths.append(0)
        return len(self.lengths) - 1

    def _store(self, store: dict[int, torch.Tensor], layer: int, like: torch.Tensor, length: int) -> torch.Tensor:
        """``store[layer]`` with room for every row and ``length`` tokens."""
        old = store.get(layer)
        rows = len(self.lengths)
        if old is not None and old.shape[0] >= rows and old.shape[2] >= length:
            return old
        cap = max(length, self.capacity, 2 * old.shape[2] if old is not None and old.shape[2] < length else 0,
                  old.shape[2] if old is not None else 0)
        n = max(rows, 2 * old.shape[0] if old is not None and old.shape[0] < rows else 0,
                old.shape[0] if old is not None else 0)
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


def _writes(rows: Sequence[int], base: Sequence[int], segments: Sequence[Sequence[tuple[int, int]]],
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


class _RowExact(TorchFunctionMode):
    """Inside one batched forward: attention row by row over each row's own keys, and linear layers by row
    count (the module docstring's rules)."""

    def __init__(self, plan: _Plan, cache: RaggedCache | None) -> None:
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
            w = weight.t().expand(x.shape[0], *weight.t().shape)
            return torch.bmm(x, w) if bias is None else torch.baddbmm(bias.expand(*x.shape[:2], -1), x, w)
        if max(lens) >= SMALL_ROWS:
            out = F.linear(x, weight, bias)
        else:
            out = x.new_zeros(*x.shape[:2], weight.shape[0])
        for n in sorted({n for n in lens if 0 < n < SMALL_ROWS}):
            idx = [g for g, m in enumerate(lens) if m == n]
            xs = x[idx, :n]
            w = weight.t().expand(len(idx), *weight.t().shape)
            y = torch.bmm(xs, w) if bias is None else torch.baddbmm(bias.expand(len(idx), n, -1), xs, w)
            out[idx, :n] = y
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


# ---------------------------------------------------------------------------------------------------
# Which models batch
# ---------------------------------------------------------------------------------------------------


def batchable(target: nn.Module, drafter: nn.Module | None = None) -> bool:
    """Whether :func:`spec_generate_batch` (``drafter`` given) or :func:`greedy_generate_batch` reproduces
    the one-prompt loops for these models: a target whose layers are all full causal attention through SDPA
    (fp32), and one of our drafters whose layers attend without a mask."""
    config = getattr(target, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if any(t != "full_attention" for t in getattr(text, "layer_types", None) or ["full_attention"]):
        return False
    if next(target.parameters()).dtype != torch.float32:
        return False
    if drafter is None:
        return True
    from .drafter import DFlashDrafter

    if not isinstance(drafter, DFlashDrafter) or next(drafter.parameters()).dtype != torch.float32:
        return False
    return all(not layer.self_attn.is_causal and layer.self_attn.sliding_window is None for layer in drafter.layers)


# ---------------------------------------------------------------------------------------------------
# The drafter's side, many rows at once
# ---------------------------------------------------------------------------------------------------


class BatchDrafter:
    """``block_drafter.BlockDrafter`` for many rows: each row a draft KV cache of its own (a row of one
    :class:`RaggedCache`), one drafter forward for the rows of a step."""

    def __init__(self, target: nn.Module, drafter: nn.Module, settings: DraftSettings) -> None:
        self.one = BlockDrafter(target, drafter, settings)
        self.drafter = drafter
        self.settings = settings
        self.cache = RaggedCache()
        self.calls = 0  # row-calls: one per row per step, as BlockDrafter counts one per call

    @property
    def selects(self) -> bool:
        return self.one.selects

    def new_row(self) -> int:
        return self.cache.add_row()

    def fork(self, row: int) -> int:
        return self.cache.fork_row(row)

    def forward(
        self,
        rows: Sequence[int],
        blocks: torch.Tensor,
        contexts: Sequence[torch.Tensor],
        starts: Sequence[int],
        then: Callable[[torch.Tensor, torch.Tensor], Any] | None = None,
    ) -> Any:
        """The drafter on ``blocks`` ``[G, v]`` (row ``g``'s first token at position ``starts[g]``) with
        each row's pending context ``contexts[g]`` ``[1, c, F]``: ``then(hidden, logits)`` of the slots
        1.. (``[G, v - 1, H]`` and ``[G, v - 1, V]``), run inside the row-exact mode (a selector's walk
        batches exactly there); without ``then``, ``(hidden, logits)``. Each row's cache is cropped back to
        its block's start, as ``BlockDrafter.hidden`` does."""
        one, device = self.one, self.one.device
        g_rows, v = blocks.shape
        cs = [int(c.shape[1]) for c in contexts]
        c_pad = max(cs)
        while c_pad in (v, v - 1):  # the context's padded length names it for the linear rule
            c_pad += 1
        width = contexts[0].shape[-1]
        ctx = contexts[0].new_zeros(g_rows, c_pad, width, device=device)
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
        plan = _Plan(
            rows=list(rows), q_lens=[v] * g_rows, kv_lens=[b + c + v for b, c in zip(base, cs, strict=True)],
            causal=False, axes={c_pad: cs, v: [v] * g_rows, v - 1: [v - 1] * g_rows}, base=base,
            segments=[[(0, c), (c_pad, c_pad + v)] for c in cs],
        )
        plan.writes = _writes(plan.rows, plan.base, plan.segments, device)
        with _RowExact(plan, self.cache):
            hidden = self.drafter(position_ids=positions, noise_embedding=noise, target_hidden=ctx,
                                  attention_mask=None, past_key_values=self.cache, use_cache=True)
            if not isinstance(hidden, torch.Tensor):
                hidden = hidden[0]
            hidden = hidden[:, 1:v]
            logits = one._logits(hidden)
            result = then(hidden, logits) if then is not None else (hidden, logits)
        for r, s in zip(rows, starts, strict=True):
            self.cache.lengths[r] = s
        self.calls += g_rows
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


# ---------------------------------------------------------------------------------------------------
# The target's side
# ---------------------------------------------------------------------------------------------------


def _target_forward(target: nn.Module, cache: RaggedCache, rows: Sequence[int], ids: torch.Tensor,
                    starts: Sequence[int], *, hidden_states: bool) -> Any:
    """The target on ``ids`` ``[G, q]`` (row ``g``'s first at position ``starts[g]``, after that many
    cached tokens of cache row ``rows[g]``), each row alone in attention."""
    g_rows, q = ids.shape
    device = ids.device
    positions = torch.stack([torch.arange(s, s + q, device=device) for s in starts])
    kv = [s + q for s in starts]
    plan = _Plan(rows=list(rows), q_lens=[q] * g_rows, kv_lens=kv, causal=q > 1, axes={q: [q] * g_rows},
                 base=list(starts), segments=[[(0, q)]] * g_rows,
                 masks=[_causal_mask(q, k, device) for k in kv] if q > 1 else [])
    plan.writes = _writes(plan.rows, plan.base, plan.segments, device)
    config = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
    # A mask given: transformers then handles the KV heads as the one-row call with its mask does; one query:
    # none, as the one-row decoding step has none.
    stand_in = torch.ones(g_rows, 1, q, 1, dtype=torch.bool, device=device) if q > 1 else None
    masks = {t: stand_in for t in set(getattr(config, "layer_types", None) or ["full_attention"])}
    with _RowExact(plan, cache):
        return target(input_ids=ids, position_ids=positions, attention_mask=masks, use_cache=True,
                      output_hidden_states=hidden_states, **{cache_kwarg(target): cache})


def _prefill(target: nn.Module, ids: torch.Tensor, *, hidden_states: bool) -> tuple[Any, Any]:
    """One prompt's prefill, the one-row call itself: (output, its DynamicCache)."""
    cache = new_cache(target.config)
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    out = target(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1,
                 output_hidden_states=hidden_states, **{cache_kwarg(target): cache})
    return out, cache


# ---------------------------------------------------------------------------------------------------
# Speculative decoding
# ---------------------------------------------------------------------------------------------------


@attrs.define
class _Row:
    seq: torch.Tensor
    n_in: int
    max_length: int
    start: int
    pending: torch.Tensor | None
    cache_row: int
    draft_row: int
    generator: torch.Generator | None
    accept_lengths: list[int] = attrs.field(factory=list)
    forwards: int = 1
    calls: int = 0
    stopped: bool = False


def spec_generate_batch(
    target: nn.Module,
    drafter: nn.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    target_layer_ids: Sequence[int] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    sampling: Sampling | None = None,
    generators: Sequence[torch.Generator | None] | None = None,
    traces: Sequence[list] | None = None,
    accepted_drafts: Sequence[list] | None = None,
    batch_size: int = 64,
) -> list[SpecResult]:
    """``generation.spec_generate`` of every prompt, ``batch_size`` prompts decoding together: per prompt
    the same output, acceptance lengths, forward counts, trace and accepted drafts (``traces[i]`` /
    ``accepted_drafts[i]`` as ``trace`` / ``accepted_drafts`` there), given each prompt's own generator
    (``generators[i]``; None: a fresh one seeded 0, as there). Needs :func:`batchable` models."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    out: list[SpecResult] = []
    for lo in range(0, len(prompts), max(1, int(batch_size))):
        hi = min(len(prompts), lo + max(1, int(batch_size)))
        out.extend(_spec_chunk(
            target, drafter, prompts[lo:hi], max_new_tokens=max_new_tokens,
            settings=draft_settings(drafter, block_size=block_size, mask_token_id=mask_token_id,
                                    target_layer_ids=target_layer_ids),
            stop_token_ids=stop_token_ids, sampling=sampling if sampling is not None else Sampling(),
            generators=None if generators is None else generators[lo:hi],
            traces=None if traces is None else traces[lo:hi],
            accepted_drafts=None if accepted_drafts is None else accepted_drafts[lo:hi],
        ))
    return out


@torch.inference_mode()
def _spec_chunk(target, drafter, prompts, *, max_new_tokens, settings, stop_token_ids, sampling, generators,
                traces, accepted_drafts) -> list[SpecResult]:
    block_size = settings.block_size
    if block_size < 2:
        raise ValueError("batched speculative decoding needs block_size >= 2 (a drafter that proposes)")
    device = target_device(target)
    greedy = sampling.greedy
    stops = torch.tensor(list(stop_token_ids or ()), dtype=torch.long, device=device)
    fill = settings.mask_token_id if settings.mask_token_id is not None else 0
    cache = RaggedCache()
    drafts = BatchDrafter(target, drafter, settings)
    rows: list[_Row] = []
    for i, prompt in enumerate(prompts):
        ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
        if ids.shape[1] == 0:
            raise ValueError("empty prompt")
        n_in = ids.shape[1]
        max_length = n_in + max_new_tokens
        gen = generators[i] if generators is not None else None
        if not greedy and gen is None:
            gen = torch.Generator(device=device).manual_seed(0)
        seq = torch.full((max_length + 1,), fill, dtype=torch.long, device=device)
        seq[:n_in] = ids[0]
        pre, dyn = _prefill(target, ids, hidden_states=True)
        last = pre.logits[0, -1:]
        seq[n_in] = last.argmax(dim=-1)[0] if greedy else sample_from(sampling_probs(last, sampling), gen)[0]
        row = _Row(seq, n_in, max_length, n_in, features(pre.hidden_states, settings.layer_ids), cache.add_row(),
                   drafts.new_row(), gen)
        cache.load_row(row.cache_row, dyn)
        row.stopped = bool(stops.numel()) and bool(torch.isin(seq[n_in], stops))
        rows.append(row)

    def active(r: _Row) -> bool:
        return r.start + 1 < r.max_length and not r.stopped

    while any(active(r) for r in rows):
        by_verify: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            if active(r):
                by_verify.setdefault(min(block_size, r.max_length - r.start), []).append(i)
        for verify, members in by_verify.items():
            _spec_step(target, drafts, cache, [rows[i] for i in members], verify, sampling, settings, stops,
                       [traces[i] for i in members] if traces is not None else None,
                       [accepted_drafts[i] for i in members] if accepted_drafts is not None else None)

    results = []
    for r in rows:
        output = r.seq[: min(r.start + 1, r.max_length)].clone()[None]
        results.append(SpecResult(output, r.accept_lengths, r.forwards, r.calls, r.n_in))
    return results


def _propose_row(drafter, hidden, logits, block, temperature, generator):
    """``BlockDrafter.propose`` after its forward: a DFlash 2 selector's sampled walk of one row."""
    from .dflash2 import select_path

    path, candidates, probs = select_path(drafter.candidate_selector, hidden, logits, block[:, 0].to(hidden.device),
                                          temperature=temperature, generator=generator)
    if probs is None:
        return path, None
    full = torch.zeros(probs.shape[1], logits.shape[-1], dtype=torch.float32, device=probs.device)
    return path, full.scatter_(-1, candidates[0], probs[0].float())


def _spec_step(target, drafts: BatchDrafter, cache: RaggedCache, rows: list[_Row], verify: int,
               sampling: Sampling, settings: DraftSettings, stops: torch.Tensor, traces, accepted_drafts) -> None:
    """One verify step of ``rows`` (all with blocks of ``verify`` slots), as ``spec_generate``'s loop body."""
    greedy = sampling.greedy
    starts = [r.start for r in rows]
    blocks = torch.stack([r.seq[r.start : r.start + verify] for r in rows]).clone()
    draft_probs: list[torch.Tensor | None] = [None] * len(rows)
    contexts = [r.pending for r in rows]
    draft_rows = [r.draft_row for r in rows]
    if greedy:
        blocks[:, 1:] = drafts.greedy_drafts(draft_rows, blocks, contexts, starts).to(blocks.device)
    else:
        hidden, logits = drafts.forward(draft_rows, blocks, contexts, starts)
        for g, r in enumerate(rows):  # each row draws from its own generator, in the one-row order
            if drafts.selects:
                proposed, probs = _propose_row(drafts.drafter, hidden[g : g + 1], logits[g : g + 1], blocks[g : g + 1],
                                               sampling.temperature, r.generator)
                blocks[g, 1:] = proposed[0].to(blocks.device)
                draft_probs[g] = probs.to(blocks.device) if probs is not None else None
            else:
                draft_probs[g] = sampling_probs(logits[g], sampling)
                blocks[g, 1:] = sample_from(draft_probs[g], r.generator)
    for r in rows:
        r.calls += 1
    if traces is not None:
        for g, trace in enumerate(traces):
            trace.append((starts[g], blocks[g, 1:].tolist()))
    out = _target_forward(target, cache, [r.cache_row for r in rows], blocks, starts, hidden_states=True)
    feats = features(out.hidden_states, settings.layer_ids)
    for g, r in enumerate(rows):
        r.forwards += 1
        start = r.start
        if greedy:
            posterior = out.logits[g].argmax(dim=-1)
            matches = (blocks[g, 1:] == posterior[:-1]).int()
            accepted = int(matches.cumprod(0).sum())
            nxt = posterior[accepted]
        else:
            target_probs = sampling_probs(out.logits[g], sampling)
            q = draft_probs[g] if draft_probs[g] is not None else target_probs[:0]
            accepted, nxt = verify_sampled(blocks[g, 1:], q, target_probs, r.generator)
        if accepted_drafts is not None:
            accepted_drafts[g].append(int(accepted))
        r.seq[start + 1 : start + 1 + accepted] = blocks[g, 1 : 1 + accepted]
        r.seq[start + 1 + accepted] = nxt
        produced = min(accepted + 1, r.max_length - start - 1)
        if stops.numel():
            hit = torch.isin(r.seq[start + 1 : start + 1 + produced], stops).nonzero()
            if hit.numel():
                produced = int(hit[0, 0]) + 1
                r.stopped = True
        cache.lengths[r.cache_row] = start + produced
        r.pending = feats[g : g + 1, :produced]
        r.start = start + produced
        r.accept_lengths.append(produced)


# ---------------------------------------------------------------------------------------------------
# Plain greedy decoding (the lossless reference)
# ---------------------------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_generate_batch(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] | None = None,
    *,
    batch_size: int = 64,
) -> list[SpecResult]:
    """``generation.greedy_generate`` of every prompt, ``batch_size`` at a time: the same tokens, each
    row's numbers its own (one token per row and step through the row-exact forward)."""
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    device = target_device(target)
    stops = {int(t) for t in stop_token_ids or ()}
    results: list[SpecResult] = []
    step = max(1, int(batch_size))
    for lo in range(0, len(prompts), step):
        chunk = prompts[lo : lo + step]
        cache = RaggedCache()
        ids_list, new, done = [], [], []
        for prompt in chunk:
            ids = torch.as_tensor(list(prompt), dtype=torch.long, device=device)[None]
            if ids.shape[1] == 0:
                raise ValueError("empty prompt")
            pre, dyn = _prefill(target, ids, hidden_states=False)
            row = cache.add_row()
            cache.load_row(row, dyn)
            tok = int(pre.logits[0, -1].float().argmax())
            ids_list.append(ids)
            new.append([tok])
            done.append(tok in stops or max_new_tokens == 1)
        while not all(done):
            live = [i for i, d in enumerate(done) if not d]
            toks = torch.tensor([[new[i][-1]] for i in live], dtype=torch.long, device=device)
            starts = [cache.lengths[i] for i in live]
            out = _target_forward(target, cache, live, toks, starts, hidden_states=False)
            for g, i in enumerate(live):
                cache.lengths[i] += 1
                tok = int(out.logits[g, -1].float().argmax())
                new[i].append(tok)
                done[i] = tok in stops or len(new[i]) >= max_new_tokens
        for ids, tokens in zip(ids_list, new, strict=True):
            output = torch.cat([ids, torch.tensor([tokens], device=device)], dim=1)
            results.append(SpecResult(output, [1] * (len(tokens) - 1), len(tokens), 0, ids.shape[1]))
    return results


# ---------------------------------------------------------------------------------------------------
# The teacher-forced walk
# ---------------------------------------------------------------------------------------------------


@attrs.define
class _WalkRow:
    """One walk (a conversation at one horizon) of :func:`walk_batch`: ``walk._walk``'s state."""

    conv: int
    horizon: int
    start: int
    pending: torch.Tensor
    lengths: list[int]
    forks: list[int]
    draft_row: int
    calls: int = 0


@torch.inference_mode()
def walk_batch(target: nn.Module, drafter: nn.Module, inputs: Sequence[Any], horizons: Sequence[int],
               settings: DraftSettings) -> list[tuple[dict[int, Any], int]]:
    """``walk._walk_horizons`` of every prepared conversation (``walk.WalkInput``), the walks of all of them
    drafting together: per conversation its results per horizon (``walk.WalkResult``'s fields: accept
    lengths, tokens, complete) and the drafter calls they took, each the one-conversation result (the forks
    of the shorter horizons are rows forked from the longest one's, at the same step the one-conversation
    walk forks them)."""
    longest, *shorter = sorted({int(h) for h in horizons}, reverse=True)
    block_size = settings.block_size
    mask = settings.mask_token_id if settings.mask_token_id is not None else 0
    drafts = BatchDrafter(target, drafter, settings)
    results: list[dict[int, Any]] = [{} for _ in inputs]
    calls = [0] * len(inputs)
    rows: list[_WalkRow] = []
    for c, inp in enumerate(inputs):
        rows.append(_WalkRow(c, longest, inp.n_in, inp.feats[:, : inp.n_in], [], list(shorter), drafts.new_row()))

    def fork(r: _WalkRow, h: int) -> _WalkRow:
        return _WalkRow(r.conv, h, r.start, r.pending, list(r.lengths), [], drafts.fork(r.draft_row))

    def settle(r: _WalkRow, work: list[_WalkRow]) -> int | None:
        """Advance ``r`` to its next drafter call (its block's size) or its end (None), as ``_walk``'s loop."""
        inp = inputs[r.conv]
        max_length = inp.n_in + r.horizon
        end = inp.n_in + inp.reply_len - 1
        while True:
            start = r.start
            for h in [h for h in r.forks if start + block_size + 1 > inp.n_in + h]:
                r.forks.remove(h)
                work.append(fork(r, h))
            if not (start + 1 < max_length and start < end):
                for h in r.forks:  # the loop ended before their turn
                    work.append(fork(r, h))
                r.forks = []
                complete = start + 1 >= max_length or (start == end and inp.stopped)
                results[r.conv][r.horizon] = (r.lengths, min(start + 1, max_length) - inp.n_in, complete)
                calls[r.conv] += r.calls
                return None
            verify = min(block_size, max_length - start)
            if verify > 1:
                return verify
            advance(r, 0)

    def advance(r: _WalkRow, accepted: int) -> None:
        inp = inputs[r.conv]
        start = r.start
        produced = min(accepted + 1, inp.n_in + r.horizon - start - 1, inp.n_in + inp.reply_len - 1 - start)
        r.pending = inp.feats[:, start : start + produced]
        r.start = start + produced
        r.lengths.append(produced)

    live = list(rows)
    while live:
        waiting: dict[int, list[_WalkRow]] = {}
        work = list(live)
        while work:
            r = work.pop(0)
            verify = settle(r, work)
            if verify is not None:
                waiting.setdefault(verify, []).append(r)
        live = [r for group in waiting.values() for r in group]
        for verify, group in waiting.items():
            blocks = torch.full((len(group), verify), mask, dtype=torch.long)
            for g, r in enumerate(group):
                blocks[g, 0] = inputs[r.conv].seq[r.start]
            proposed = drafts.greedy_drafts([r.draft_row for r in group], blocks,
                                            [r.pending for r in group], [r.start for r in group])
            for g, r in enumerate(group):
                inp = inputs[r.conv]
                seq = inp.seq
                end = inp.n_in + inp.reply_len - 1
                ref = seq[r.start + 1 : min(r.start + verify, end + 1)]
                d = proposed[g].to(seq.device)
                r.calls += 1
                advance(r, int((d[: ref.numel()] == ref).int().cumprod(0).sum()))
    return [(results[c], calls[c]) for c in range(len(inputs))]
