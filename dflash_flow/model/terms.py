"""Each drafter variant's loss terms and their statistics, called polymorphically by the loss
(``model.objective``): ``HeadTerms`` for DFlash (the LM head's weighted cross-entropy), ``SelectorTerms``
for DFlash 2 (the same over its top-k candidates, plus the selector's candidate cross-entropy,
``dflash2.selector_terms``). ``terms_for`` picks them by the variant's name (``model.strategies``); the
statistics' names are the strategy's ``metric_names``.

A chunk's terms (``chunk``) take the drafter's normed hidden states of the chunk's supervised slots;
``total`` adds the variant's own loss to the DFlash loss once every chunk is in (summed over chunks and
divided once: chunked and one-pass runs give the same loss and gradients); ``extras`` are its statistics.
"""

from __future__ import annotations

from typing import Any

import torch

from dflash_flow.model.blockplan import BlockPlan
from dflash_flow.model.drafter_layers import maybe_compiled
from dflash_flow.model.fused import weighted_cross_entropy
from dflash_flow.model.lossstats import acceptance_runs
from dflash_flow.model.strategies import DFlash2, Variant

__all__ = ["HeadTerms", "SelectorTerms", "terms_for"]

Extras = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _head_terms(drafter, lm_head, h, labels, weights):
    """Weighted cross-entropy sum and argmax of the LM head's logits for rows ``h``."""
    logits = drafter.compute_logits(h, lm_head).float()
    return weighted_cross_entropy(logits, labels, weights), logits.argmax(dim=-1)


class HeadTerms:
    """DFlash: the LM head's weighted cross-entropy; no term or statistic of its own."""

    names: tuple[str, ...] = Variant.metric_names

    def __init__(self, loss_weight: float = 0.0) -> None:
        self.loss_weight = float(loss_weight)

    def chunk(self, drafter: Any, lm_head: Any, h: torch.Tensor, plan: BlockPlan, start: int, stop: int) -> tuple:
        """``(loss sum, argmax [b, n, B-1], *own parts)`` of blocks ``start..stop-1`` whose supervised slots'
        hidden states are ``h`` ``[b*n*(B-1), H]``."""
        labels = plan.labels[:, start:stop, 1:].reshape(-1)
        weights = plan.weights[:, start:stop, 1:].reshape(-1)
        loss_sum, pred = maybe_compiled(_head_terms, drafter.compiled)(drafter, lm_head, h, labels, weights)
        return loss_sum, pred.view(plan.anchors.shape[0], stop - start, plan.block_size - 1)

    def total(self, loss: torch.Tensor, parts: list[tuple]) -> tuple[torch.Tensor, Any]:
        """The whole loss from the DFlash loss and the chunks' own parts; with what ``extras`` needs."""
        return loss, None

    def activation_bytes_per_token(self, drafter: Any, elem: int) -> int:
        """Bytes its own parts keep for the backward per block token (``layout.activation_bytes_per_block``),
        beyond the DFlash drafter's; ``elem``: bytes per weight element."""
        return 0

    def extras(self, plan: BlockPlan, parts: list[tuple], sums: Any, loss_sum: torch.Tensor,
               weight_sum: torch.Tensor) -> Extras:
        return {}


class SelectorTerms(HeadTerms):
    """DFlash 2 (``dflash2`` module docstring): the head's cross-entropy gathered over the top-k candidates,
    and the selector's, teacher-forced with the true previous tokens."""

    names = DFlash2.metric_names

    def chunk(self, drafter: Any, lm_head: Any, h: torch.Tensor, plan: BlockPlan, start: int, stop: int) -> tuple:
        from dflash_flow.model.dflash2 import selector_terms, top_candidate_indices

        shape = (plan.anchors.shape[0], stop - start, plan.block_size - 1)
        labels = plan.labels[:, start:stop, 1:].reshape(-1)
        weights = plan.weights[:, start:stop, 1:].reshape(-1)
        selector = drafter.candidate_selector
        logits = drafter.compute_logits(h, lm_head).float()
        candidates = top_candidate_indices(logits, selector.top_k)
        ce_sum, unary = weighted_cross_entropy(logits, labels, weights, gather=candidates)
        # max's indices: argmax's (the first maximum, checked with ties), in under half its CPU time.
        pred = logits.max(dim=-1).indices.view(shape)
        sel_sum, sel_weight, hits, present = selector_terms(
            selector,
            h,
            logits,
            labels,
            plan.labels[:, start:stop, :-1].reshape(-1),  # the true previous token of each slot
            weights,
            plan.supervised[:, start:stop, 1:].reshape(-1),
            candidates=(unary, candidates),
        )
        return ce_sum, pred, sel_sum, sel_weight, hits.view(shape), present.view(shape)

    def activation_bytes_per_token(self, drafter: Any, elem: int) -> int:
        """Four convolutions per layer (in, out, taps), the candidates' codes."""
        selector, h = drafter.candidate_selector, int(drafter.config.hidden_size)
        return len(drafter.layers) * elem * 16 * h + 4 * 3 * selector.top_k * selector.successor_codebook.shape[1]

    def total(self, loss: torch.Tensor, parts: list[tuple]) -> tuple[torch.Tensor, Any]:
        selector_sum = sum(part[0] for part in parts)
        selector_weight = sum(part[1] for part in parts)
        loss = loss + float(self.loss_weight) * selector_sum / selector_weight.clamp(min=1e-6)
        return loss, (selector_sum, selector_weight)

    def extras(self, plan: BlockPlan, parts: list[tuple], sums: Any, loss_sum: torch.Tensor,
               weight_sum: torch.Tensor) -> Extras:
        """The two loss terms, the teacher-forced selector's accuracy, the share of supervised slots whose true
        token is a candidate (the ceiling of that accuracy), and the simulated acceptance of the selector's
        greedy walk (the run of its correct picks: along it the walk's predecessors are the true ones)."""
        selector_sum, selector_weight = sums
        hits = torch.cat([part[2] for part in parts], dim=1)  # [b, N, B-1]
        present = torch.cat([part[3] for part in parts], dim=1)
        supervised = plan.supervised[:, :, 1:].sum().float()
        run = acceptance_runs(hits, plan)
        kept = plan.keep
        values = (
            (loss_sum.detach(), weight_sum.detach()),
            (selector_sum.detach(), selector_weight.detach()),
            (hits.sum().float(), supervised),
            (present.sum().float(), supervised),
            (((1 + run).float() * kept).sum(), kept.sum().float()),
        )
        return dict(zip(self.names, values, strict=True))


#: The loss terms of each variant, by its strategy's name.
TERMS: dict[str, type[HeadTerms]] = {Variant.name: HeadTerms, DFlash2.name: SelectorTerms}


def terms_for(variant: Variant | str, loss_weight: float | None = None) -> HeadTerms:
    """The loss terms of ``variant`` (a strategy, or its name), its own term weighted ``loss_weight``
    (default: the strategy's ``loss_weight``)."""
    name = variant if isinstance(variant, str) else variant.name
    if loss_weight is None:
        loss_weight = 0.0 if isinstance(variant, str) else variant.loss_weight
    return TERMS[name](loss_weight)
