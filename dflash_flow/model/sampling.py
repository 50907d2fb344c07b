"""The speculative-sampling rule: Sampling (temperature, top-k, top-p), its distribution, verify_sampled."""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

__all__ = ["Sampling", "sample_from", "sampling_probs", "verify_sampled"]


def _check_sampling(inst: Sampling, _attr: Any, _value: Any) -> None:
    if not (math.isfinite(inst.temperature) and inst.temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0, got {inst.temperature}")
    if not 0 < inst.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {inst.top_p}")
    if isinstance(inst.top_k, bool) or not isinstance(inst.top_k, int) or inst.top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {inst.top_k!r}")


@attrs.frozen
class Sampling:
    """How the target (and the drafter's proposals) choose tokens: ``temperature == 0`` is greedy; otherwise
    logits / ``temperature``, the ``top_k`` largest (0 = all), then the smallest set whose mass reaches
    ``top_p``, renormalised (transformers', vLLM's and z-lab's order)."""

    temperature: float = attrs.field(default=0.0, converter=float)
    top_p: float = attrs.field(default=1.0, converter=float)
    top_k: int = attrs.field(default=0, validator=_check_sampling)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The sampling distribution (float32, last dim the vocabulary) of ``logits`` under ``sampling``
    (temperature > 0). Ties at the k-th largest logit are all kept, as transformers' top-k does."""
    if sampling.greedy:
        raise ValueError("sampling_probs needs temperature > 0 (temperature 0 is argmax)")
    scores = logits.float() / sampling.temperature
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = scores.topk(sampling.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)
    if sampling.top_p < 1.0:
        ranked, order = probs.sort(dim=-1, descending=True)
        above = ranked.cumsum(dim=-1) - ranked  # mass of the tokens ranked above each one
        ranked = ranked.masked_fill(above >= sampling.top_p, 0.0)  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter(-1, order, ranked)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def sample_from(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per row of ``probs`` (``[..., V]`` -> ``[...]``): a single ``multinomial`` call over all
    rows, so a block's drafts take the same draws from the generator as z-lab's loop."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).view(probs.shape[:-1])


def verify_sampled(drafts: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor,
                   generator: torch.Generator | None) -> tuple[int, int]:
    """The speculative-sampling acceptance rule for one block (see the module docstring).

    ``drafts`` ``[g]`` were sampled from ``draft_probs`` ``[g, V]``; ``target_probs`` ``[g + 1, V]`` is the
    target's distribution after each block slot. Returns ``(accepted drafts, next token)``: the next
    token is sampled from ``norm(max(0, p - q))`` at the first rejected slot, or from ``p`` after the
    last draft when all were accepted. Draws: ``g`` uniforms (none when ``g == 0``), then one multinomial.
    """
    g = int(drafts.numel())
    accepted = 0
    if g:
        index = drafts.reshape(g, 1)
        p = target_probs[:g].gather(-1, index)[:, 0]
        q = draft_probs.gather(-1, index)[:, 0]
        u = torch.rand(q.shape, generator=generator, dtype=q.dtype, device=q.device)
        # u < p/q without dividing: a draft the target gives at least q's mass is always accepted.
        accepted = int((u * q < p).to(torch.int32).cumprod(0).sum())
    if accepted == g:
        nxt = sample_from(target_probs[g : g + 1], generator)
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0.0)
        # Exactly p == q leaves no residual mass; the rejection then had probability 0 (rounding): use p.
        dist = residual if bool(residual.sum() > 0) else target_probs[accepted]
        nxt = sample_from(dist[None], generator)
    return accepted, int(nxt[0])
