"""Padder: right-pads a planned batch into tensors in pinned host memory."""

from __future__ import annotations

from typing import Optional

import attrs

from dflash_flow.core import Stage, StageContext, cfg
from dflash_flow.items import PaddedBatch, PlannedBatch


@attrs.define(kw_only=True, eq=False)
class Padder(Stage):
    """Right-pads a batch to its planned length: input_ids, attention_mask, position_ids, loss_mask."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.data.collate  # noqa: F401

    input_type = PlannedBatch
    output_type = PaddedBatch
    cardinality = "1:1"
    replicas_affect_result = False  # stateless, per batch; the trainer restores the plan's order

    pad_id: int = cfg(0, ge=0, doc="Token id written into padding (masked out everywhere).")
    pad_to_multiple: int = cfg(1, ge=1, doc="Round padded length up to a multiple of this.")
    pin_memory: Optional[bool] = cfg(
        None, result=False, doc="Pin host memory for non-blocking device copies; null: when CUDA is available."
    )

    def setup(self, ctx: StageContext) -> None:
        m = ctx.metrics
        self._m_len = m.summary("seq_len", "tokens", "Sequence lengths (mean, max)")
        self._m_bs = m.summary("batch_size", "samples", "Samples per batch")
        self._m_real = m.counter("real_tokens", "tokens", "Real tokens padded")
        self._m_padded = m.counter("padded_tokens", "tokens", "Tokens after padding")
        self._m_eff = m.gauge("padding_efficiency", "ratio", "Real / padded tokens so far")

    def process(self, item: PlannedBatch):
        from dflash_flow.data.collate import pad_batch

        out = pad_batch(
            item, pad_id=self.pad_id, pad_to_multiple=self.pad_to_multiple, pin_memory=self.pin_memory
        )
        for n in item.meta.lengths:
            self._m_len.observe(n)
        self._m_bs.observe(item.meta.num_samples)
        self._m_real.inc(item.meta.real_tokens)
        self._m_padded.inc(int(out.input_ids.numel()))
        if self._m_padded.value:  # a filler batch (no samples) may come first: no ratio before any token
            self._m_eff.set(self._m_real.value / self._m_padded.value)
        return (out,)
