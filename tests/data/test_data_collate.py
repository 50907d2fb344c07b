"""Padder logic: right padding, masks, positions, pad-to-multiple, pinning."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_flow.data.packing import PlanConfig
from dflash_flow.data.plan import BatchPlanner, pad_arrays, pad_batch, pad_samples
from dflash_flow.items import PlannedBatch, Sample


def samples():
    return [
        Sample(0, [5, 6, 7], [0, 1, 1], "a:1"),
        Sample(1, np.array([8, 9, 10, 11, 12]), np.array([0, 0, 1, 1, 1]), "a:2"),
    ]


def test_pad_arrays_right_pads_to_multiple():
    a = pad_arrays(samples(), pad_id=-1, pad_to_multiple=4)
    assert a["input_ids"].tolist() == [[5, 6, 7, -1, -1, -1, -1, -1], [8, 9, 10, 11, 12, -1, -1, -1]]
    assert a["attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 0, 0, 0]]
    assert a["position_ids"].tolist() == [[0, 1, 2, 0, 0, 0, 0, 0], [0, 1, 2, 3, 4, 0, 0, 0]]
    assert a["loss_mask"].tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [0, 0, 1, 1, 1, 0, 0, 0]]


def test_mismatched_mask_names_the_sample():
    with pytest.raises(ValueError, match="sample 3 \\(f.jsonl:9\\)"):
        pad_arrays([Sample(3, [1, 2], [1], "f.jsonl:9")])


def test_padded_batch_from_plan_matches_budget():
    lengths = np.array([3, 5, 17, 20, 2, 9])
    sm = [Sample(i, list(range(1, n + 1)), [1] * n) for i, n in enumerate(lengths)]
    plan = BatchPlanner(lengths, PlanConfig(max_tokens=48, pad_to_multiple=8), seed=0).plan(0)
    for p in range(len(plan)):
        meta = plan.meta(p)
        batch = pad_batch(
            PlannedBatch(meta, [sm[i] for i in meta.sample_ids]), pad_to_multiple=8, pin_memory=False
        )
        assert tuple(batch.input_ids.shape) == (meta.num_samples, meta.padded_len)
        assert batch.input_ids.numel() == meta.padded_tokens <= 48
        assert int(batch.attention_mask.sum()) == meta.real_tokens
        assert batch.input_ids.dtype == torch.long and not batch.input_ids.is_pinned()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned memory")
def test_pinned_on_cuda():
    meta = BatchPlanner([3, 5], PlanConfig(), seed=0).plan(0).meta(0)
    b = pad_samples(samples(), meta)
    assert b.input_ids.is_pinned()
