"""Right-pad a planned batch into tensors in pinned host memory (torch is imported inside the functions:
importing `dflash_flow.data` stays torch-free)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dflash_flow.items import BatchMeta, PaddedBatch, PlannedBatch, Sample

__all__ = ["pad_arrays", "pad_batch", "pad_samples"]


def pad_arrays(samples: Sequence[Sample], *, pad_id: int = 0, pad_to_multiple: int = 1,
               padded_len: int = 0) -> dict[str, np.ndarray]:
    """The padded numpy arrays of a batch: input_ids, attention_mask, position_ids, loss_mask ([b, S]). ``S`` is
    the longest sample rounded up to ``pad_to_multiple``, or ``padded_len`` if that is larger (the planner's
    padded length, so the Padder spends exactly what the plan budgeted)."""
    if not samples:
        raise ValueError("cannot pad an empty batch")
    lens = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=len(samples))
    longest = int(lens.max())
    m = max(int(pad_to_multiple), 1)
    width = max(-(-longest // m) * m, int(padded_len))
    b = len(samples)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    loss = np.zeros((b, width), dtype=np.int64)
    for i, s in enumerate(samples):
        n = int(lens[i])
        if len(s.loss_mask) != n:
            raise ValueError(f"sample {s.sample_id} ({s.source or 'unknown source'}): loss_mask has "
                             f"{len(s.loss_mask)} entries for {n} tokens")
        ids[i, :n] = s.input_ids
        loss[i, :n] = s.loss_mask
    cols = np.arange(width, dtype=np.int64)
    attn = (cols[None, :] < lens[:, None]).astype(np.int64)
    # Right padding: positions are 0..n-1 on real tokens; padded slots get 0 (never attended, never in the loss).
    pos = np.where(attn.astype(bool), cols[None, :], 0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": loss}


def pad_samples(samples: Sequence[Sample], meta: BatchMeta, *, pad_id: int = 0, pad_to_multiple: int = 1,
                pin_memory: bool | None = None) -> PaddedBatch:
    """`PaddedBatch` of int64 CPU tensors, pinned when CUDA is present (``pin_memory=None``) or asked."""
    import torch

    if meta.filler:
        # A filler batch keeps its rank in step with the others (data parallel); it has no samples.
        empty = np.zeros((0, 0), dtype=np.int64)
        arrays = dict.fromkeys(("input_ids", "attention_mask", "position_ids", "loss_mask"), empty)
    else:
        arrays = pad_arrays(samples, pad_id=pad_id, pad_to_multiple=pad_to_multiple, padded_len=meta.padded_len)
    pin = (pin_memory is None or bool(pin_memory)) and torch.cuda.is_available()
    tensors = {}
    for k, v in arrays.items():
        t = torch.from_numpy(v)
        # position_ids never leave the host (right padding: the target derives them), so they are not pinned.
        tensors[k] = t.pin_memory() if pin and k != "position_ids" else t
    return PaddedBatch(meta=meta, **tensors)


def pad_batch(batch: PlannedBatch, *, pad_id: int = 0, pad_to_multiple: int = 1,
              pin_memory: bool | None = None) -> PaddedBatch:
    return pad_samples(batch.samples, batch.meta, pad_id=pad_id, pad_to_multiple=pad_to_multiple, pin_memory=pin_memory)

