"""The RAM tier of the target's features, read by later epochs instead of running the target (the feature
store's first tier; ``TargetForward.cache_features`` alone). Each sample's features are computed alone (no
padding) whether or not they are cached, so they do not depend on which batch, epoch, replica or process
computed them. One cache serves every replica of a stage in a process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where features are computed: a stage's config needs none
    import torch


class FeatureCache:
    """Per-sample features ``[length, F]`` by sample id, up to ``budget_bytes`` (what does not fit is
    computed again each time it is needed; nothing is evicted, so the hits are the same every epoch)."""

    def __init__(self, budget_bytes: int = 0) -> None:
        self.budget_bytes = int(budget_bytes)
        self.bytes = 0
        self.hits = 0
        self.misses = 0
        self.full = False  # a sample did not fit: it (and any later one that does not fit) is recomputed
        self.warned_full = False  # the stage said so (once for all its replicas)
        self._rows: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()

    def __deepcopy__(self, memo: dict) -> FeatureCache:
        return self  # shared by a stage's replicas (copies of one template)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id: int) -> bool:
        return sample_id in self._rows

    def get(self, sample_id: int, length: int) -> torch.Tensor | None:
        row = self._rows.get(sample_id)
        if row is None or row.shape[0] != length:
            return None
        return row

    def count(self, hits: int, misses: int) -> None:
        with self._lock:
            self.hits += hits
            self.misses += misses

    def put(self, sample_id: int, row: torch.Tensor) -> bool:
        """Keep ``row``; False (and ``full`` set) when it would exceed the budget."""
        size = row.numel() * row.element_size()
        with self._lock:
            if sample_id in self._rows:
                return True
            if self.bytes + size > self.budget_bytes:
                self.full = True
                return False
            self._rows[sample_id] = row
            self.bytes += size
            return True


def compute_alone(features: Callable[..., torch.Tensor], rows: Sequence[torch.Tensor],
                  sample_ids: Sequence[Any], *, together: bool = False) -> list[torch.Tensor]:
    """Each 1-D row of tokens' features ``[length, F]`` as if computed alone, through ``features(input_ids,
    attention_mask, lengths, sample_ids)`` (a TargetBackend's). ``together``: the backend computes every row
    independently (``rows_independent``), so all go in one right-padded call; otherwise one call per row (a
    padded batch through an in-process model is not bit-equal to its rows alone)."""
    import torch

    if not rows:
        return []
    lengths = [int(r.shape[0]) for r in rows]
    if not together:
        out = []
        for r, length, sid in zip(rows, lengths, sample_ids, strict=True):
            ids = r.unsqueeze(0)
            out.append(features(ids, torch.ones_like(ids), [length], [sid])[0, :length])
        return out
    ids = torch.zeros((len(rows), max(lengths)), dtype=rows[0].dtype, device=rows[0].device)
    mask = torch.zeros_like(ids)
    for i, (r, length) in enumerate(zip(rows, lengths, strict=True)):
        ids[i, :length] = r
        mask[i, :length] = 1
    batch = features(ids, mask, lengths, list(sample_ids))
    return [batch[i, :length] for i, length in enumerate(lengths)]


def per_sample_features(features: Callable[..., torch.Tensor], input_ids: torch.Tensor,
                        lengths: Sequence[int], sample_ids: Sequence[int], cache: FeatureCache | None, *,
                        device: Any = None, together: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Features ``[b, S, F]`` of a right-padded batch, each row computed alone or read from ``cache`` (padded
    positions zero), and the rows that ran the target."""
    import torch

    b, s = input_ids.shape
    if len(lengths) != b:
        raise ValueError(f"{len(lengths)} lengths for a batch of {b} rows")
    if len(sample_ids) != b:
        cache, sample_ids = None, [None] * b  # rows without ids: computed alone, not kept
    lengths = [int(n) for n in lengths]
    found: dict[int, torch.Tensor] = {}
    if cache is not None:
        for i, (length, sid) in enumerate(zip(lengths, sample_ids, strict=True)):
            row = cache.get(int(sid), length)
            if row is not None:
                found[i] = row
    computed = [i for i in range(b) if i not in found]
    new = compute_alone(features, [input_ids[i, : lengths[i]] for i in computed],
                        [sample_ids[i] for i in computed], together=together)
    for i, row in zip(computed, new, strict=True):
        found[i] = row
        if cache is not None:
            cache.put(int(sample_ids[i]), row)
    if cache is not None:
        cache.count(b - len(computed), len(computed))
    if not found:
        raise ValueError("a batch with no rows has no features")
    first = next(iter(found.values()))
    out = torch.zeros((b, s, first.shape[-1]), dtype=first.dtype, device=device or first.device)
    for i, row in found.items():
        out[i, : lengths[i]] = row
    return out, computed
