"""Helpers for the feature-store tests: a TargetBackend over the in-process extractor (the protocol of
``model.backend``, built from plain values), samples as a ``SampleIndex``, a comm of real threads, and
mounting a small tmpfs or a read-only bind where this process may (root with CAP_SYS_ADMIN)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_flow.model.feature_store import SampleIndex
from dflash_flow.model.features import TargetFeatureExtractor

LAYERS = [1, 5]


class ExtractorBackend:
    """The TargetBackend protocol over ``TargetFeatureExtractor`` (what ``InProcessBackend`` does), counting
    the rows it computes."""

    def __init__(self, model: Any, layer_ids: list[int] = LAYERS):
        self.model = model
        self.layer_ids = list(layer_ids)
        embed = model.get_input_embeddings()
        self.hidden_size = int(embed.embedding_dim)
        self.vocab_size = int(embed.num_embeddings)
        self.rows_independent = False  # a padded batch through the model, as in process
        self.rows = 0
        self.setups = 0
        self.closed = 0
        self.extractor: TargetFeatureExtractor | None = None

    def setup(self, *, devices, out_device, name) -> None:  # noqa: ARG002
        self.setups += 1
        self.extractor = TargetFeatureExtractor(self.model, self.layer_ids, output_device=out_device)

    def features(self, input_ids, attention_mask, lengths, sample_ids):  # noqa: ARG002
        self.rows += int(input_ids.shape[0])
        return self.extractor(input_ids, attention_mask)

    def close(self) -> None:
        self.closed += 1


def make_samples(n: int, *, seed: int = 0, first_id: int = 0, lo: int = 4, hi: int = 40, vocab: int = 500) -> tuple[SampleIndex, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    toks = [rng.integers(1, vocab, int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]
    ids = np.arange(first_id, first_id + n, dtype=np.int64)
    return SampleIndex(ids, np.asarray([len(t) for t in toks], dtype=np.int64), lambda i: toks[i]), toks


def extractor_compute(extractor: TargetFeatureExtractor, counter: list[int] | None = None):
    """``build_store``'s compute: each sample alone (a batch of one), as the cache and hybrid compute it."""

    def compute(batch):
        rows = []
        for _sid, toks in batch:
            ids = torch.as_tensor(np.asarray(toks), dtype=torch.long)[None]
            rows.append(extractor(ids, torch.ones_like(ids))[0])
            if counter is not None:
                counter[0] += 1
        return rows

    return compute


def padded(toks: list[np.ndarray], order: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    lengths = [len(toks[i]) for i in order]
    s = max(lengths)
    ids = torch.zeros(len(order), s, dtype=torch.long)
    for r, i in enumerate(order):
        ids[r, : lengths[r]] = torch.as_tensor(toks[i], dtype=torch.long)
    mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()
    return ids, mask, lengths


class ThreadComm:
    """A job's ranks as real threads: ``all_gather_object`` and ``barrier`` over a shared board."""

    def __init__(self, rank: int, world: int, board: dict, barrier: threading.Barrier):
        self.rank, self.world_size, self._board, self._barrier = rank, world, board, barrier
        self._round = 0

    @classmethod
    def group(cls, world: int) -> list[ThreadComm]:
        board: dict = {}
        barrier = threading.Barrier(world)
        return [cls(r, world, board, barrier) for r in range(world)]

    def all_gather_object(self, obj):
        self._round += 1
        self._board[(self._round, self.rank)] = obj
        self._barrier.wait()
        out = [self._board[(self._round, r)] for r in range(self.world_size)]
        self._barrier.wait()
        return out

    def barrier(self) -> None:
        self._barrier.wait()


def can_mount() -> bool:
    if os.geteuid() != 0:
        return False
    probe = Path("/tmp") / f"dflash-mount-probe-{os.getpid()}"
    probe.mkdir(exist_ok=True)
    try:
        ok = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(probe)], capture_output=True).returncode == 0
        if ok:
            subprocess.run(["umount", str(probe)], check=True)
        return ok
    finally:
        with contextlib.suppress(OSError):
            probe.rmdir()


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@contextlib.contextmanager
def read_only(src: Path, at: Path) -> Iterator[Path]:
    """``src`` seen read-only at ``at``: a read-only bind mount as root, else ``src`` with no write permission."""
    if can_mount():
        at.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "--bind", "-o", "ro", str(src), str(at)], check=True)
        try:
            yield at
        finally:
            subprocess.run(["umount", "-l", str(at)], check=False)
        return
    modes = {}
    for p in [src, *src.rglob("*")]:
        modes[p] = p.stat().st_mode
        p.chmod(modes[p] & ~0o222)
    try:
        yield src
    finally:
        for p, m in modes.items():
            p.chmod(m)
