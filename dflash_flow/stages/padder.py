"""Padder: right-pads a planned batch into tensors in pinned host memory."""

from __future__ import annotations

from typing import Optional

import attrs

from dflash_flow.core import Stage, StageContext, cfg
from dflash_flow.core.metrics import Counter, Gauge, Summary, stage_metric
from dflash_flow.items import PaddedBatch, PlannedBatch


@attrs.define
class PadderMetrics:
    seq_len: Summary = stage_metric("tokens", "Sequence lengths (mean, max)")
    batch_size: Summary = stage_metric("samples", "Samples per batch")
    real_tokens: Counter = stage_metric("tokens", "Real tokens padded")
    padded_tokens: Counter = stage_metric("tokens", "Tokens after padding")
    padding_efficiency: Gauge = stage_metric("ratio", "Real / padded tokens so far")


@attrs.define(kw_only=True, eq=False)
class Padder(Stage):
    """Right-pads a batch to its planned length: input_ids, attention_mask, position_ids, loss_mask."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.data.plan  # noqa: F401

    input_type = PlannedBatch
    output_type = PaddedBatch
    stage_metrics = (PadderMetrics,)
    cardinality = "1:1"
    replicas_affect_result = False  # stateless, per batch; the trainer restores the plan's order

    pad_id: int = cfg(0, ge=0, doc="Token id written into padding (masked out everywhere).")
    pad_to_multiple: int = cfg(1, ge=1, doc="Round padded length up to a multiple of this.")
    pin_memory: Optional[bool] = cfg(None, result=False, doc="Pin host memory for non-blocking device copies; null: "
                                     "when CUDA is available.")

    def setup(self, ctx: StageContext) -> None:
        self._m = ctx.metrics.declare(PadderMetrics)

    def process(self, item: PlannedBatch):
        from dflash_flow.data.plan import pad_batch

        out = pad_batch(item, pad_id=self.pad_id, pad_to_multiple=self.pad_to_multiple, pin_memory=self.pin_memory)
        m = self._m
        for n in item.meta.lengths:
            m.seq_len.observe(n)
        m.batch_size.observe(item.meta.num_samples)
        m.real_tokens.inc(item.meta.real_tokens)
        m.padded_tokens.inc(int(out.input_ids.numel()))
        if m.padded_tokens.value:  # a filler batch (no samples) may come first: no ratio before any token
            m.padding_efficiency.set(m.real_tokens.value / m.padded_tokens.value)
        return (out,)
