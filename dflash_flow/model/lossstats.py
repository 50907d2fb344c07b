"""The DFlash loss's statistics and each variant's loss terms. ``DFlashLossOutput``: what one micro-batch's
loss reports; ``objective_extras``: each objective's own; ``HeadTerms`` / ``SelectorTerms``: the LM head's
weighted cross-entropy (DFlash) and DFlash 2's selector term, picked by ``terms_for``. Every extra statistic's
name is declared once, by the strategies' ``metric_names``; here they are only paired with values."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from dflash_flow.model.blockplan import BlockPlan
from dflash_flow.model.drafter_layers import maybe_compiled
from dflash_flow.model.fused import weighted_cross_entropy
from dflash_flow.model.strategies import DFlash2, VariablePrefix, Variant

Extras = dict[str, tuple[torch.Tensor, torch.Tensor]]


@attrs.define(eq=False)
class DFlashLossOutput:
    """Loss (with graph) and detached statistics (``values()`` reads them from the device once)."""

    loss: torch.Tensor
    weight_sum: torch.Tensor  # sum of loss weights (the loss denominator)
    correct_per_position: torch.Tensor  # [B] correct argmax on supervised slots, per slot k
    supervised_per_position: torch.Tensor  # [B] supervised slots per k
    acceptance_sum: torch.Tensor  # sum over kept blocks of 1 + their run of correct slots (``acceptance_runs``)
    kept_blocks: torch.Tensor  # number of kept (non-padding) blocks
    # Scalar statistics of a variant or objective (DFlash 2's selector, the variable prefix), as
    # (numerator, denominator): metrics() reports numerator / denominator (0 when the denominator is 0).
    extra: Extras = attrs.field(factory=dict)

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The scalar statistics of :meth:`values`."""
        scalars, _positions = self.values()
        return {f"{prefix}{k}": v for k, v in scalars.items()}

    @property
    def stat_names(self) -> list[str]:
        """The names of :meth:`stat_vector`'s scalar entries, in order (the per-slot accuracies follow them)."""
        return ["loss", "accuracy", "acceptance_length", "num_tokens", "num_blocks", *self.extra]

    def stat_vector(self) -> torch.Tensor:
        """:meth:`values` as one device tensor (``stat_names``, then the per-slot accuracies), in float64
        (float32 on MPS) with the same arithmetic, so a step's micro-batches are summed on the device, read once."""
        wide = torch.float32 if self.loss.device.type == "mps" else torch.float64

        def f(t: torch.Tensor) -> torch.Tensor:
            return t.detach().float().to(wide).reshape(-1)

        def ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
            return torch.where(den != 0, num / torch.where(den != 0, den, torch.ones_like(den)), torch.zeros_like(num))

        correct, supervised = f(self.correct_per_position), f(self.supervised_per_position)
        total, blocks = supervised.sum().reshape(1), f(self.kept_blocks)
        parts = [f(self.loss), ratio(correct.sum().reshape(1), total), ratio(f(self.acceptance_sum), blocks), total,
                 blocks]
        parts += [ratio(f(num), f(den)) for num, den in self.extra.values()]
        parts.append(ratio(correct[1:], supervised[1:]))
        return torch.cat(parts)

    def values(self) -> tuple[dict[str, float], list[float]]:
        """(scalar statistics by ``stat_names``, accuracy of slots k = 1..B-1), in one device->host transfer."""
        names, flat = self.stat_names, self.stat_vector().tolist()
        return dict(zip(names, flat[: len(names)], strict=True)), flat[len(names) :]


def acceptance_runs(hits: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``[b, N]``: per block, the run of consecutive correct slots ``hits`` ``[b, N, B-1]`` from slot 1 (an
    unsupervised slot ends it); under the variable-prefix objective from the first masked slot ``l`` (slots
    1..l-1 are given, not drafted)."""
    if plan.prefix_lengths is None:
        return hits.long().cumprod(dim=-1).sum(dim=-1)
    shown = torch.arange(1, plan.block_size, device=hits.device) < plan.prefix_lengths[:, :, None]
    return ((hits | shown).long().cumprod(dim=-1) * ~shown).sum(dim=-1)


def objective_extras(plan: BlockPlan, run: torch.Tensor) -> Extras:
    """The objective's own statistics: DFlash has none; the variable prefix the mean visible prefix ``l`` of kept
    blocks, and the acceptance of the blocks drawn with ``l = 1`` (the inference regime)."""
    if plan.prefix_lengths is None:
        return {}
    kept, lengths = plan.keep, plan.prefix_lengths
    first = kept & (lengths == 1)
    values = (((lengths * kept).sum().float(), kept.sum().float()),
              (((1 + run).float() * first).sum(), first.sum().float()))
    return dict(zip(VariablePrefix.metric_names, values, strict=True))


class StepSums:
    """An optimizer step's statistics summed on the device (``DFlashLossOutput.stat_vector``), read once with
    the gradient norm (:meth:`read`), and the micro-batches, tokens and samples it counted (fillers are not)."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.sum: torch.Tensor | None = None
        self.names: list[str] = []  # the scalars' names; the accuracy per block slot follows them
        self.counted = self.tokens = self.samples = 0

    @property
    def wide(self) -> torch.dtype:
        return torch.float32 if self.device.type == "mps" else torch.float64

    def add(self, out: DFlashLossOutput, meta: Any) -> None:
        stats = out.stat_vector()
        self.names = out.stat_names
        self.sum = stats if self.sum is None else self.sum + stats
        self.counted += 1
        self.tokens += meta.real_tokens
        self.samples += meta.num_samples

    def read(self, norm: torch.Tensor | None = None) -> tuple[float | None, dict[str, float], list[float]]:
        """(gradient norm, the statistic sums by name, per-slot accuracy sums), in one transfer."""
        if norm is not None and hasattr(norm, "full_tensor"):  # FSDP: a DTensor, every rank's same value
            norm = norm.full_tensor()
        parts = [] if norm is None else [norm.detach().reshape(1).to(self.device, self.wide)]
        if self.sum is not None:
            parts.append(self.sum.to(self.device, self.wide))
        flat = torch.cat(parts).tolist() if parts else []
        grad_norm = flat.pop(0) if norm is not None else None
        names = self.names if self.sum is not None else []
        return grad_norm, dict(zip(names, flat[: len(names)], strict=True)), flat[len(names) :]

    def reset(self) -> None:
        self.sum = None
        self.counted = self.tokens = self.samples = 0

    def state(self) -> dict[str, Any]:
        """A partial step's sums as plain values (a checkpoint's partial accumulation)."""
        _norm, sums, pos_sums = self.read()
        return {"sums": sums, "pos_sums": pos_sums, "counted": self.counted, "tokens": self.tokens,
                "samples": self.samples}

    def load(self, acc: dict[str, Any]) -> None:
        sums = {str(k): float(v) for k, v in acc["sums"].items()}
        self.names = list(sums)
        values = list(sums.values()) + [float(v) for v in acc["pos_sums"]]
        self.sum = torch.tensor(values, dtype=self.wide, device=self.device) if values else None
        self.counted, self.tokens, self.samples = int(acc["counted"]), int(acc["tokens"]), int(acc["samples"])


def _head_terms(drafter, lm_head, h, labels, weights):
    logits = drafter.compute_logits(h, lm_head).float()
    return weighted_cross_entropy(logits, labels, weights), logits.argmax(dim=-1)


class HeadTerms:
    """DFlash: the LM head's weighted cross-entropy; no term or statistic of its own."""

    names: tuple[str, ...] = Variant.metric_names

    def __init__(self, loss_weight: float = 0.0) -> None:
        self.loss_weight = float(loss_weight)

    def chunk(self, drafter: Any, lm_head: Any, h: torch.Tensor, plan: BlockPlan, start: int, stop: int) -> tuple:
        """``(loss sum, argmax [b, n, B-1], *own parts)`` of blocks ``start..stop-1``; ``h`` ``[b*n*(B-1), H]``:
        their supervised slots' hidden states. ``total`` adds the variant's own loss once every chunk is in."""
        labels = plan.labels[:, start:stop, 1:].reshape(-1)
        weights = plan.weights[:, start:stop, 1:].reshape(-1)
        loss_sum, pred = maybe_compiled(_head_terms, drafter.compiled)(drafter, lm_head, h, labels, weights)
        return loss_sum, pred.view(plan.anchors.shape[0], stop - start, plan.block_size - 1)

    def total(self, loss: torch.Tensor, parts: list[tuple]) -> tuple[torch.Tensor, Any]:
        return loss, None

    def activation_bytes_per_token(self, drafter: Any, elem: int) -> int:
        """Bytes its own parts keep for the backward per block token, beyond the DFlash drafter's."""
        return 0

    def extras(self, plan: BlockPlan, parts: list[tuple], sums: Any, loss_sum: torch.Tensor,
               weight_sum: torch.Tensor) -> Extras:
        return {}


class SelectorTerms(HeadTerms):
    """DFlash 2: the head's cross-entropy over the top-k candidates, and the selector's (teacher-forced)."""

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
        previous = plan.labels[:, start:stop, :-1].reshape(-1)  # the true previous token of each slot
        sel_sum, sel_weight, hits, present = selector_terms(
            selector, h, logits, labels, previous, weights, plan.supervised[:, start:stop, 1:].reshape(-1),
            candidates=(unary, candidates))
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
        """The two loss terms, the selector's accuracy, the candidates' recall (its ceiling), and the simulated
        acceptance of the selector's greedy walk (along its run of correct picks the predecessors are true)."""
        selector_sum, selector_weight = sums
        hits = torch.cat([part[2] for part in parts], dim=1)  # [b, N, B-1]
        present = torch.cat([part[3] for part in parts], dim=1)
        supervised = plan.supervised[:, :, 1:].sum().float()
        run = acceptance_runs(hits, plan)
        kept = plan.keep
        values = ((loss_sum.detach(), weight_sum.detach()), (selector_sum.detach(), selector_weight.detach()),
                  (hits.sum().float(), supervised), (present.sum().float(), supervised),
                  (((1 + run).float() * kept).sum(), kept.sum().float()))
        return dict(zip(self.names, values, strict=True))


TERMS: dict[str, type[HeadTerms]] = {Variant.name: HeadTerms, DFlash2.name: SelectorTerms}


def terms_for(variant: str, loss_weight: float = 0.0) -> HeadTerms:
    """The loss terms of the variant named ``variant``, its own term weighted ``loss_weight``."""
    return TERMS[variant](loss_weight)
