"""The DFlash 2 drafter: DFlash plus in-block convolutions and a candidate selector.

Contract (must stay equal to z-lab ``dflash.model.DFlash2DraftModel`` 0.1.0, which inference loads):

* every DFlash parameter (``drafter.DFlashDrafter``), plus per layer ``layers.{i}.attention_conv`` and
  ``layers.{i}.mlp_conv``, each ``base_kernel`` ``[2, K, H]`` and ``kernel_projection`` (Linear
  ``H -> 2*K*G``, no bias, ``G = H / conv_group_size``), and ``candidate_selector.{predecessor_codebook,
  successor_codebook}`` ``[V, r]`` and ``candidate_selector.hidden_projection`` (Linear ``H -> r``);
  the codebooks are stored without ``.weight``, the key layout z-lab's ``from_pretrained`` maps;
* ``dflash_config`` carries ``conv_kernel_size`` (K), ``conv_group_size``, ``selector_rank`` (r) and
  ``selector_top_k``; ``architectures: [DFlash2DraftModel]``;
* the convolution (two taps by default: the slot itself and its predecessor) runs along the block's
  slots and never reaches past the block's first slot (it sees zeros there). Around each sublayer: the
  normed input is convolved (``base_kernel[0]`` plus a per-slot, per-group correction predicted from
  that normed input) before the attention or MLP, and the sublayer's output is convolved again
  (``base_kernel[1]``, the correction's second half). The context features are not convolved: they
  enter as keys and values only, as in DFlash;
* the selector keeps each draft slot's top-k unary logits and walks one path: the score of candidate
  ``c`` after predecessor ``a`` is ``U(c) + <A[a] * P(h), B[c]>`` (``A``/``B`` the codebooks, ``P``
  the hidden projection, ``h`` the slot's normed hidden state); slot 1's predecessor is the block's
  first (known) token. Greedy takes the best score; sampling draws from ``softmax(scores / T)`` over
  the candidates (temperature only, as z-lab does), which is the proposal speculative sampling checks.

A fresh drafter starts at the identity (NeMo AutoModel's start): it computes what the DFlash drafter with the
same weights does. Training (docs/dflash2.md): the DFlash loss, plus ``selector_loss_weight *`` the selector's
cross-entropy over each supervised slot's top-k candidates after the *true* previous token (``selector_terms``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.drafter_config import draft_value, make_drafter_config
from dflash_flow.model.drafter_layers import DrafterLayer, SlotRows, gated_mlp
from dflash_flow.model.strategies import (
    DFLASH2_DEFAULTS,
    DFLASH2_KEYS,
    Variant,
    as_variant,
    dflash2_problems,
    dflash2_settings,
    knobs,
)

ARCHITECTURE = "DFlash2DraftModel"


def is_dflash2_config(config: Any) -> bool:
    """Whether a drafter config describes a DFlash 2 drafter (its ``architectures``)."""
    return ARCHITECTURE in (getattr(config, "architectures", None) or [])


def make_dflash2_config(target_config: Any, *, conv_kernel_size: int | None = None,
                        conv_group_size: int | None = None, selector_rank: int | None = None,
                        selector_top_k: int | None = None, **drafter_kw: Any):
    """``drafter.make_drafter_config`` plus the DFlash 2 settings (written into ``dflash_config``, where
    z-lab reads them; None: ``DFLASH2_DEFAULTS``). Raises ValueError naming every bad setting."""
    config = make_drafter_config(target_config, **drafter_kw)
    settings = dflash2_settings(conv_kernel_size, conv_group_size, selector_rank, selector_top_k)
    problems = dflash2_problems(settings, hidden_size=config.hidden_size, vocab_size=config.vocab_size,
                                block_size=int(draft_value(config, "block_size", 16)))
    if problems:
        raise ValueError("invalid DFlash 2 settings: " + "; ".join(message for _, message in problems))
    config.dflash_config = {**config.dflash_config, **settings}
    config.architectures = [ARCHITECTURE]
    config.auto_map = {"AutoModel": f"dflash.{ARCHITECTURE}"}
    return config


def variant_config(target_config: Any, variant: Variant, **drafter_kw: Any):
    """The drafter config of a variant strategy (``strategies.Variant`` or ``DFlash2``): its export settings go
    into ``dflash_config``."""
    if variant.name == "dflash2":
        return make_dflash2_config(target_config, **variant.export_settings(), **drafter_kw)
    return make_drafter_config(target_config, **drafter_kw)


def make_variant_config(target_config: Any, *, variant: str = "dflash", **kw: Any):
    """The drafter config of ``variant`` (``dflash`` or ``dflash2``) with its knobs given flat; a knob of
    another variant is refused rather than silently dropped."""
    given = {k: kw.pop(k) for k in DFLASH2_KEYS if k in kw}
    cls = as_variant(variant).__class__
    own = {f.name for f in knobs(cls)}
    wrong = sorted(k for k, v in given.items() if v is not None and k not in own)
    if wrong:
        raise ValueError(f"{', '.join(wrong)} only apply to variant: dflash2 (variant is {variant})")
    return variant_config(target_config, cls(**{k: v for k, v in given.items() if k in own}), **kw)


# -- the in-block convolution
class _BlockCausalConv(torch.autograd.Function):
    """``block_causal_conv`` on ``xs`` ``[b, N, B, G, gs]``, ``dyn`` ``[b, N, B, K, G, 1]``, ``w`` ``[K, G, gs]``.
    Forward: tap ``o`` adds ``w[o] * x[t - o]`` then ``dyn[o] * x[t - o]`` to slots ``t >= o`` in place: z-lab's
    roundings of its zero-padded sum, without the padding. Backward: the gradients autograd gives that
    formulation, bit for bit (each ``grad * x`` product once for both its reductions, summed in autograd's order).
    """

    @staticmethod
    def forward(ctx, xs, dyn, w):
        out = (w[0] * xs).addcmul_(dyn[:, :, :, 0], xs)
        for o in range(1, min(w.shape[0], xs.shape[2])):
            prev = xs[:, :, :-o]
            out[:, :, o:].add_(w[o] * prev).addcmul_(dyn[:, :, o:, o], prev)
        ctx.save_for_backward(xs, dyn, w)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        # Few buffers (each fresh one costs its page faults): ``scratch`` holds one product at a time.
        xs, dyn, w = ctx.saved_tensors
        grad_dyn, grad_w = torch.empty_like(dyn, memory_format=torch.contiguous_format), torch.empty_like(w)
        scratch = grad * xs
        grad_dyn[:, :, :, 0] = scratch.sum(-1, keepdim=True)
        grad_w[0] = scratch.sum((0, 1, 2))
        grad_x = None
        for o in range(1, w.shape[0]):
            if o >= xs.shape[2]:  # the tap never reaches into the block
                grad_dyn[:, :, :, o] = 0
                grad_w[o] = 0
                continue
            prev, tail = xs[:, :, :-o], grad[:, :, o:]
            scratch[:, :, :o] = 0  # the kernel's gradient sums over the padded slots, as autograd's does
            torch.mul(tail, prev, out=scratch[:, :, o:])
            grad_w[o] = scratch.sum((0, 1, 2))
            grad_dyn[:, :, :o, o] = 0
            grad_dyn[:, :, o:, o] = scratch[:, :, o:].sum(-1, keepdim=True)
            shifted = torch.empty_like(xs)
            shifted[:, :, -o:] = 0
            torch.mul(tail, dyn[:, :, o:, o], out=shifted[:, :, :-o]).add_(torch.mul(tail, w[o], out=scratch[:, :, o:]))
            grad_x = shifted if grad_x is None else grad_x.add_(shifted)
        if grad_x is None:
            return torch.mul(grad, dyn[:, :, :, 0]).add_(torch.mul(grad, w[0], out=scratch)), grad_dyn, grad_w
        grad_x.add_(torch.mul(grad, dyn[:, :, :, 0], out=scratch))
        return grad_x.add_(torch.mul(grad, w[0], out=scratch)), grad_dyn, grad_w


def block_causal_conv(
    x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, group_size: int, block: int
) -> torch.Tensor:
    """``y[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o]`` along each block's slots.

    ``x`` ``[b, T, H]`` holds ``T / block`` blocks end to end; tap ``o`` reads slot ``t - o`` of the same block
    (zero before its first slot), so blocks side by side (training) give what each alone gives (inference).
    ``dynamic`` ``[b, T, K, G]``, ``base`` ``[K, H]``. Tap by tap, base then correction: z-lab's rounding.
    """
    b, t, h = x.shape
    groups = h // group_size
    taps = base.shape[0]
    xs = x.view(b, t // block, block, groups, group_size)
    dyn = dynamic.reshape(b, t // block, block, taps, groups, 1)
    w = base.view(taps, groups, group_size).to(x.dtype)
    return _BlockCausalConv.apply(xs, dyn, w).view(b, t, h)


class GroupedDynamicConv(nn.Module):
    """The convolution around one sublayer: ``prepare`` before it, ``finish`` after it. Both halves'
    corrections are predicted once, from the sublayer's (normed) input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide the hidden size {hidden_size}")
        self.kernel_size = int(kernel_size)
        self.group_size = int(group_size)
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, self.kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * self.kernel_size * self.groups, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The identity: unit self-tap, no correction (a fresh DFlash 2 layer is a DFlash layer)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        conv = block_causal_conv(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, block)
        return conv, dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor, block: int) -> torch.Tensor:
        return block_causal_conv(x, dynamic, self.base_kernel[1], self.group_size, block)


class DFlash2Layer(DrafterLayer):
    """A DFlash decoder layer with the in-block convolution around its attention and its MLP."""

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        kernel = int(draft_value(config, "conv_kernel_size", DFLASH2_DEFAULTS["conv_kernel_size"]))
        group = int(draft_value(config, "conv_group_size", DFLASH2_DEFAULTS["conv_group_size"]))
        self.block_size = int(draft_value(config, "block_size", 16))
        self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
        self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group)

    def _block(self, length: int) -> int:
        # The inference layout holds one (possibly shortened) block; the dense training layout N whole
        # blocks (NeMo AutoModel's rule: a multiple of block_size is that many blocks).
        return self.block_size if length % self.block_size == 0 else length

    def _sublayers(self, x, attend, block: int, prepared=None):
        h, dyn = prepared or self.attention_conv.prepare(self.input_layernorm(x), block)
        x = x + self.attention_conv.finish(attend(h), dyn, block)
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x), block)
        # drafter_layers.gated_mlp: Qwen3's MLP with the training path's fused SiLU gate (the same values).
        return x + self.mlp_conv.finish(gated_mlp(self.mlp, h), dyn, block)

    def _prepare_rows(self, rows: SlotRows, block: int):
        """``attention_conv.prepare`` of the first layer's input given as ``rows``: ``(SlotRows, dynamic)``. The
        convolution reads slots t-K+1..t, so only slots 0..K-1 differ and slots K..B-1 are one row."""
        taps = min(self.attention_conv.kernel_size, block)
        b, n, hidden = rows.first.shape
        rest = self.input_layernorm(rows.rest)
        head = torch.cat([self.input_layernorm(rows.first)[:, :, None], rest.expand(b, n, taps - 1, hidden)], dim=2)
        h_head, dyn_head = self.attention_conv.prepare(head.view(b, n * taps, hidden), taps)
        h_rest, dyn_rest = self.attention_conv.prepare(rest.expand(1, taps, hidden), taps)
        dyn_head = dyn_head.view(b, n, taps, *dyn_head.shape[2:])
        dyn = torch.cat([dyn_head, dyn_rest[:, -1:, None].expand(b, n, block - taps, -1, -1)], dim=2)
        return SlotRows(h_head.view(b, n, taps, hidden), h_rest[0, -1]), dyn.view(b, n * block, *dyn.shape[3:])

    def forward(self, x, context, cos, sin, attention_mask, past_key_values=None):
        def attend(h):
            return self.self_attn(h, context, cos, sin, attention_mask, past_key_values)

        return self._sublayers(x, attend, self._block(x.shape[1]))

    def forward_blocks(self, x, ctx_k, ctx_v, cos, sin, layout, rows: SlotRows | None = None):
        """``rows``: ``x`` in factored form (``SlotRows``; the first layer), so the input norm, the first
        convolution and the q/k/v projections run on K rows per block and one shared row."""
        if layout.drops_first_slot:
            raise ValueError("DFlash 2 layers need every slot of every block (the convolution mixes neighbours)")

        def attend(h):
            return self.self_attn.forward_blocks(h, ctx_k, ctx_v, cos, sin, layout)

        block = layout.block_size
        factored = rows is not None and self.attention_conv.kernel_size < block
        return self._sublayers(x, attend, block, self._prepare_rows(rows, block) if factored else None)


# -- the candidate selector


def _table(weight: Any) -> torch.Tensor:
    """A codebook's ``[V, r]`` table: ours is a parameter, z-lab's an ``nn.Embedding``."""
    return weight.weight if isinstance(weight, nn.Embedding) else weight


def _lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return table.index_select(0, ids.reshape(-1)).view(*ids.shape, table.shape[-1])


class CandidateSelector(nn.Module):
    """Low-rank pair scores over each slot's top-k candidates (see the module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, top_k: int, init_std: float = 0.02) -> None:
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k must be in [1, {vocab_size}], got {top_k}")
        self.top_k = int(top_k)
        self.init_std = float(init_std)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Scores start as the unary logits: the successor codebook is zero (one factor of a bilinear
        form suffices); it gets gradient at once, the other two from the next step on."""
        with torch.no_grad():
            self.predecessor_codebook.normal_(0.0, self.init_std)
            self.successor_codebook.zero_()
            self.hidden_projection.weight.normal_(0.0, self.init_std)

    def pair_scores(self, hidden: torch.Tensor, unary: torch.Tensor, candidates: torch.Tensor,
                    predecessors: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` scores of ``candidates`` (``[..., k]``, unary logits ``unary``) after
        ``predecessors`` (``[...]``), at slots with normed hidden states ``hidden`` (``[..., H]``)."""
        # index_select: F.embedding's values and gradients (checked bit for bit), a cheaper backward on CPU.
        gate = _lookup(self.predecessor_codebook, predecessors) * self.hidden_projection(hidden)
        return unary + torch.einsum("...r,...kr->...k", gate, _lookup(self.successor_codebook, candidates))


def select_path(selector: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, *,
                temperature: float = 0.0, generator: torch.Generator | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The decode-time walk of a selector (ours or z-lab's) through a block's draft slots' candidates.

    ``hidden`` ``[b, P, H]``, ``logits`` ``[b, P, V]``, ``anchor_ids`` ``[b]`` the block's first token. Returns
    the path ``[b, P]``, the candidates ``[b, P, k]`` and, when ``temperature > 0``, each step's proposal
    ``[b, P, k]`` (else None); candidates and draws are made as z-lab's walk makes them (same generator, same path).
    """
    pred_table = _table(selector.predecessor_codebook)
    succ_table = _table(selector.successor_codebook)
    unary, candidates = torch.topk(logits, selector.top_k, dim=-1, sorted=False)
    gates = selector.hidden_projection(hidden)
    previous = anchor_ids
    path, probs = [], []
    for p in range(hidden.shape[1]):
        scores = unary[:, p] + torch.einsum(
            "br,bkr->bk", F.embedding(previous, pred_table) * gates[:, p], F.embedding(candidates[:, p], succ_table)
        )
        if temperature > 0:
            q = torch.softmax(scores.float() / temperature, dim=-1)
            index = torch.multinomial(q, 1, generator=generator)[:, 0]
            probs.append(q)
        else:
            index = scores.argmax(dim=-1)
        previous = candidates[:, p].gather(-1, index[:, None])[:, 0]
        path.append(previous)
    return torch.stack(path, dim=1), candidates, torch.stack(probs, dim=1) if probs else None



def select_proposal(selector: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, anchor_ids: torch.Tensor, *,
                    temperature: float = 0.0, generator: torch.Generator | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One block's :func:`select_path` (``[1, P]``) and, when sampled, its proposal over the whole vocabulary
    ``[P, V]`` (float32, zero outside the candidates; else None)."""
    path, candidates, probs = select_path(selector, hidden, logits, anchor_ids, temperature=temperature,
                                          generator=generator)
    if probs is None:
        return path, None
    full = torch.zeros(probs.shape[1], logits.shape[-1], dtype=torch.float32, device=probs.device)
    return path, full.scatter_(-1, candidates[0], probs[0].float())

def top_candidates(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(logits, k, dim=-1)`` of ``[M, V]`` logits: the same values, descending, at the same
    indices (but for ties, which may come in another order), with the values' gradient
    (``logits.gather`` at ``top_candidate_indices``)."""
    candidates = top_candidate_indices(logits, k)
    return logits.gather(-1, candidates), candidates


def top_candidate_indices(logits: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of ``top_candidates`` (no gradient), in two small top-k's: the vocabulary is cut into ``V / 8``
    columns of 8 tokens ``j, j + V/8, ...``; the top k are among the 8k tokens of the k columns with the largest
    maxima (those hold k tokens at least as large as the k-th maximum, every other column at most that)."""
    rows, vocab = logits.shape
    parts = 8
    with torch.no_grad():
        flat = logits.detach()
        if vocab % parts or 2 * k * parts > vocab:
            return torch.topk(flat, k, dim=-1).indices
        width = vocab // parts
        columns = flat.view(rows, parts, width).amax(dim=1).topk(k, dim=-1).indices
        tokens = (columns[:, :, None] + torch.arange(0, vocab, width, device=flat.device)).view(rows, k * parts)
        return tokens.gather(-1, flat.gather(-1, tokens).topk(k, dim=-1).indices)


def selector_terms(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
                   predecessors: torch.Tensor, weights: torch.Tensor, supervised: torch.Tensor,
                   candidates: tuple[torch.Tensor, torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The selector's training terms over ``M`` draft slots: ``hidden`` ``[M, H]``, ``logits`` ``[M, V]``,
    ``labels`` and ``predecessors`` ``[M]`` (the true tokens and their previous ones), ``weights`` ``[M]``
    (0 where unsupervised). Returns ``(loss_sum, weight_sum, hits, in_candidates)``: the weighted candidate
    cross-entropy over slots whose true token is a candidate, their weight sum, and ``[M]`` bool masks of
    supervised slots where the selector picks the true token and where it is a candidate. ``candidates``:
    ``(unary, indices)`` already taken from ``logits``, else taken here."""
    unary, candidates = candidates if candidates is not None else top_candidates(logits, selector.top_k)
    scores = selector.pair_scores(hidden, unary, candidates, predecessors).float()
    match = candidates == labels[:, None]
    present = match.any(dim=-1)
    target = match.to(torch.int64).argmax(dim=-1)  # 0 where absent (weight 0 there)
    w = weights * present.to(weights.dtype)
    ce = F.cross_entropy(scores, target, reduction="none")
    with torch.no_grad():
        picked = candidates.gather(-1, scores.argmax(dim=-1, keepdim=True))[:, 0]
        hits = (picked == labels) & supervised
        in_candidates = present & supervised
    return (ce * w).sum(), w.sum(), hits, in_candidates


# -- the drafter


class DFlash2Drafter(DFlashDrafter):
    """DFlash 2 drafter; weights interchangeable with z-lab ``DFlash2DraftModel`` (codebooks without
    ``.weight``, as its ``from_pretrained`` maps them)."""

    layer_class = DFlash2Layer
    independent_slots = False

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.vocab_size,
            config.hidden_size,
            int(draft_value(config, "selector_rank", DFLASH2_DEFAULTS["selector_rank"])),
            int(draft_value(config, "selector_top_k", DFLASH2_DEFAULTS["selector_top_k"])),
            init_std=float(getattr(config, "initializer_range", 0.02)),
        )

    def reset_parameters(self) -> None:
        super().reset_parameters()
        for module in self.modules():  # the selector is built (and resets itself) after DFlashDrafter.__init__
            if isinstance(module, (GroupedDynamicConv, CandidateSelector)):
                module.reset_parameters()


def drafter_from_config(config: Any) -> DFlashDrafter:
    """A fresh drafter of the variant ``config`` describes (DFlash 2 or DFlash)."""
    return DFlash2Drafter(config) if is_dflash2_config(config) else DFlashDrafter(config)


def drafter_variant(config: Any) -> str:
    return "dflash2" if is_dflash2_config(config) else "dflash"
