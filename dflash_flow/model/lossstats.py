"""The DFlash loss's statistics: what one micro-batch's loss reports (``DFlashLossOutput``), and the
statistics each objective owns (``ObjectiveStats``: the simulated acceptance of a block, plus the variable
prefix's own). A variant's statistics are its loss terms' (``model.terms``). The names of every extra
statistic are declared once, by the strategies (``model.strategies``: ``metric_names``); the code here
pairs them with their values, never spelling a key twice."""

from __future__ import annotations

from typing import Any

import attrs
import torch

from dflash_flow.model.blockplan import BlockPlan
from dflash_flow.model.strategies import Objective, VariablePrefix

__all__ = [
    "DFlashLossOutput", "ObjectiveStats", "PrefixStats", "StepSums", "acceptance_runs", "objective_stats", "zero_extras",
]


@attrs.define(eq=False)
class DFlashLossOutput:
    """Loss (with graph) and detached statistics; properties sync per access, ``metrics()`` syncs once."""

    loss: torch.Tensor
    weight_sum: torch.Tensor  # sum of loss weights (the loss denominator)
    correct_per_position: torch.Tensor  # [B] correct argmax on supervised slots, per slot k
    supervised_per_position: torch.Tensor  # [B] supervised slots per k
    acceptance_sum: torch.Tensor  # sum over kept blocks of the simulated acceptance length
    kept_blocks: torch.Tensor  # number of kept (non-padding) blocks
    # Scalar statistics of a variant or objective (DFlash 2's selector, the variable prefix), as
    # (numerator, denominator): metrics() reports numerator / denominator (0 when the denominator is 0).
    extra: dict[str, tuple[torch.Tensor, torch.Tensor]] = attrs.field(factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.supervised_per_position.sum().item())

    @property
    def accuracy(self) -> float:
        n = self.supervised_per_position.sum().item()
        return float(self.correct_per_position.sum().item() / n) if n else 0.0

    @property
    def position_accuracy(self) -> list[float]:
        """Accuracy of slots k = 1..B-1 (0.0 where a slot had no supervised token)."""
        c = self.correct_per_position[1:].tolist()
        s = self.supervised_per_position[1:].tolist()
        return [ci / si if si else 0.0 for ci, si in zip(c, s, strict=True)]

    @property
    def acceptance_length(self) -> float:
        """Mean over kept blocks of ``1 + sum_k prod_{j<=k} [argmax_j == t_j]`` (the bonus token counts);
        under the variable-prefix objective the products start at the block's first masked slot ``l``."""
        n = self.kept_blocks.item()
        return float(self.acceptance_sum.item() / n) if n else 0.0

    def metrics(self, prefix: str = "") -> dict[str, float]:
        """The scalar statistics (the per-slot accuracies are :meth:`values`' typed sequence), from :meth:`values`."""
        scalars, _positions = self.values()
        return {f"{prefix}{k}": v for k, v in scalars.items()}

    @property
    def stat_names(self) -> list[str]:
        """The names of :meth:`stat_vector`'s scalar entries, in order (the per-slot accuracies follow them)."""
        return ["loss", "accuracy", "acceptance_length", "num_tokens", "num_blocks", *self.extra]

    def stat_vector(self) -> torch.Tensor:
        """:meth:`values` as one tensor on the statistics' device, read nowhere: the scalars (``stat_names``) then
        the accuracy of slots k = 1..B-1, in float64 (float32 on MPS), with the arithmetic of :meth:`values`
        (each input rounded to float32 first, a ratio 0 where its denominator is 0), so a caller can sum the
        micro-batches of a step on the device and read them once."""
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
        """(scalar statistics, accuracy of slots k = 1..B-1), fetched from the device in one transfer."""
        names = list(self.extra)
        flat = torch.cat(
            [
                self.loss.detach().float().reshape(1),
                self.acceptance_sum.float().reshape(1),
                self.kept_blocks.float().reshape(1),
                self.correct_per_position.float(),
                self.supervised_per_position.float(),
                *(t.detach().float().reshape(1) for name in names for t in self.extra[name]),
            ]
        ).tolist()
        loss, accept, blocks = flat[:3]
        block = self.correct_per_position.numel()
        correct, supervised = flat[3 : 3 + block], flat[3 + block : 3 + 2 * block]
        ratios = flat[3 + 2 * block :]
        total = sum(supervised)
        out = {
            "loss": loss,
            "accuracy": sum(correct) / total if total else 0.0,
            "acceptance_length": accept / blocks if blocks else 0.0,
            "num_tokens": total,
            "num_blocks": blocks,
        }
        for i, name in enumerate(names):
            num, den = ratios[2 * i], ratios[2 * i + 1]
            out[name] = num / den if den else 0.0
        positions = [correct[k] / supervised[k] if supervised[k] else 0.0 for k in range(1, block)]
        return out, positions


def acceptance_runs(hits: torch.Tensor, plan: BlockPlan) -> torch.Tensor:
    """``[b, N]``: per block, the run of consecutive correct slots ``hits`` ``[b, N, B-1]`` from slot 1 (an
    unsupervised slot ends it); under the variable-prefix objective from the first masked slot ``l`` (slots
    1..l-1 are given, not drafted)."""
    if plan.prefix_lengths is None:
        return hits.long().cumprod(dim=-1).sum(dim=-1)
    shown = torch.arange(1, plan.block_size, device=hits.device) < plan.prefix_lengths[:, :, None]
    return ((hits | shown).long().cumprod(dim=-1) * ~shown).sum(dim=-1)


class ObjectiveStats:
    """The DFlash objective's statistics: none beyond the simulated acceptance every objective reports."""

    names: tuple[str, ...] = Objective.metric_names

    def extras(self, plan: BlockPlan, run: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """``{name: (numerator, denominator)}`` of its statistics, given each block's acceptance ``run``."""
        return {}


class PrefixStats(ObjectiveStats):
    """The variable prefix's: the mean visible prefix ``l`` of kept blocks, and the acceptance of the blocks
    drawn with ``l = 1`` (the inference regime)."""

    names = VariablePrefix.metric_names

    def extras(self, plan: BlockPlan, run: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        kept, lengths = plan.keep, plan.prefix_lengths
        first = kept & (lengths == 1)
        values = (((lengths * kept).sum().float(), kept.sum().float()),
                  (((1 + run).float() * first).sum(), first.sum().float()))
        return dict(zip(self.names, values, strict=True))


def objective_stats(plan: BlockPlan) -> ObjectiveStats:
    """The statistics of the objective that drew ``plan`` (visible prefixes: the variable prefix's)."""
    return ObjectiveStats() if plan.prefix_lengths is None else PrefixStats()


def zero_extras(names: tuple[str, ...], zero: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each statistic of ``names`` as 0 / 0 (a micro-batch without a supervised block)."""
    return {name: (zero.sum(), zero.sum()) for name in names}


class StepSums:
    """An optimizer step's statistics summed over its micro-batches on the device (``DFlashLossOutput.stat_vector``),
    read once at the step together with the gradient norm (:meth:`read`: the step's one device->host read), and
    the micro-batches, tokens and samples it counted (fillers train nothing and are not counted)."""

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
        """After an optimizer step."""
        self.sum = None
        self.counted = self.tokens = self.samples = 0

    def state(self) -> dict[str, Any]:
        """A partial step's sums, as plain values (a checkpoint's partial accumulation)."""
        _norm, sums, pos_sums = self.read()
        return {"sums": sums, "pos_sums": pos_sums, "counted": self.counted, "tokens": self.tokens,
                "samples": self.samples}

    def load(self, acc: dict[str, Any]) -> None:
        sums = {str(k): float(v) for k, v in acc["sums"].items()}
        self.names = list(sums)
        values = list(sums.values()) + [float(v) for v in acc["pos_sums"]]
        self.sum = torch.tensor(values, dtype=self.wide, device=self.device) if values else None
        self.counted, self.tokens, self.samples = int(acc["counted"]), int(acc["tokens"]), int(acc["samples"])
