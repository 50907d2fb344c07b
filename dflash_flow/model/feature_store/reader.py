"""A store opened for reading: random access by sample id."""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_flow.model.feature_store.format import (
    CODECS,
    INDEX,
    MANIFEST,
    MERGED_DTYPE,
    REOPEN,
    SHARDS,
    FeatureStoreError,
    Shard,
)
from dflash_flow.model.feature_store.manifest import (
    first_of_each,
    merged_rows,
    read_manifest,
    shard_names,
)

log = logging.getLogger(__name__)


class FeatureStore:
    """A store opened for reading (thread-safe, never writes). ``complete=True`` wants a finished build (the
    merged index); ``complete=False`` also opens one being written, listing ``shards/`` (``refresh()``)."""

    def __init__(self, root: str | os.PathLike, *, complete: bool = True, max_open: int = 256):
        self.root = Path(root)
        m = read_manifest(self.root)
        if m is None:
            raise FeatureStoreError(f"{self.root} is not a feature store (no {MANIFEST}): build one with "
                                    "`dflash-flow features build PIPELINE`")
        self.manifest = m
        self.identity: dict[str, Any] = m["identity"]
        self.codec = CODECS[m["dtype"]]
        self.width = int(m["width"])
        self.layer_ids = list(m["identity"].get("layer_ids") or [])
        self._lock = threading.Lock()
        self._open: dict[int, Shard] = {}
        self._max_open = max_open
        self._files: list[str] = []
        self._expect: list[int | None] = []
        self._sids = np.zeros(0, np.int64)
        self._loc = np.zeros(0, MERGED_DTYPE)
        self.duplicates = 0
        if complete:
            if not m.get("complete"):
                have, want = m.get("samples", 0), m.get("expected_samples")
                raise FeatureStoreError(
                    f"feature store {self.root} is incomplete ({have} of {want if want is not None else '?'} samples): "
                    f"{REOPEN}")
            self._load_merged()
        else:
            self.refresh()

    def _load_merged(self) -> None:
        m = self.manifest
        self._files = [s["file"] for s in m["shards"]]
        self._expect = [int(s["bytes"]) for s in m["shards"]]
        try:
            data = (self.root / INDEX).read_bytes()
        except FileNotFoundError:
            raise FeatureStoreError(f"feature store {self.root}: {INDEX} is missing: {REOPEN}") from None
        if hashlib.blake2b(data, digest_size=20).hexdigest() != m.get("index_blake2b"):
            raise FeatureStoreError(f"feature store {self.root}: {INDEX} does not match the manifest's digest: {REOPEN}")
        loc = np.frombuffer(data, dtype=MERGED_DTYPE).copy()
        if loc.size != int(m["samples"]):
            raise FeatureStoreError(f"feature store {self.root}: {INDEX} has {loc.size} rows, the manifest {m['samples']}")
        missing = [f for f in self._files if not (self.root / f).is_file()]
        if missing:
            raise FeatureStoreError(f"feature store {self.root}: shard(s) {', '.join(missing[:5])} missing"
                                    f"{' (and more)' if len(missing) > 5 else ''}: {REOPEN}")
        self._sids, self._loc = loc["sid"].copy(), loc

    def refresh(self) -> int:
        """Look for shards written since (hybrid training, a build going on); returns how many were added."""
        known = set(self._files)
        new = [n for n in shard_names(self.root) if f"{SHARDS}/{n}" not in known]
        if not new:
            return 0
        rows, added = [self._loc], 0
        digest = self.manifest.get("identity_digest")
        for name in new:
            try:
                shard = Shard(self.root / SHARDS / name)
            except FeatureStoreError as exc:
                log.warning("%s (skipped)", exc)
                continue
            if digest and shard.meta.get("identity") != digest:
                shard.close()
                log.warning("shard %s belongs to another build of this path (skipped): delete it", shard.path)
                continue
            with self._lock:
                k = len(self._files)
                self._files.append(f"{SHARDS}/{name}")
                self._expect.append(shard.size)
                self._open[k] = shard
            self._trim_open()
            rows.append(merged_rows(shard.index, k))
            added += 1
        loc, duplicates = first_of_each(rows)
        self.duplicates += duplicates
        with self._lock:
            self._loc = loc
            self._sids = self._loc["sid"].copy()
        return added

    def __len__(self) -> int:
        return int(self._sids.size)

    def __contains__(self, sid: int) -> bool:
        return self._find(int(sid)) is not None

    def sample_ids(self) -> np.ndarray:
        return self._sids.copy()

    @property
    def tokens(self) -> int:
        return int(self._loc["length"].sum())

    def _find(self, sid: int) -> np.void | None:
        sids = self._sids
        i = int(np.searchsorted(sids, sid))
        if i < sids.size and sids[i] == sid:
            return self._loc[i]
        return None

    def _shard(self, k: int) -> Shard:
        shard = self._open.get(k)
        if shard is not None:
            return shard
        with self._lock:
            shard = self._open.get(k)
            if shard is None:
                shard = Shard(self.root / self._files[k], expect_bytes=self._expect[k])
                self._open[k] = shard
        self._trim_open()
        return shard

    def _trim_open(self) -> None:
        with self._lock:
            while len(self._open) > self._max_open:
                k = next(iter(self._open))
                self._open.pop(k).close()

    def locate(self, sid: int) -> tuple[Shard, int, int, int, int] | None:
        """(shard, offset, length, crc32, tokens digest) of sample ``sid``; None when the store has none."""
        rec = self._find(int(sid))
        if rec is None:
            return None
        return self._shard(int(rec["shard"])), int(rec["offset"]), int(rec["length"]), int(rec["crc"]), int(rec["tokens"])

    def payload(self, sid: int) -> tuple[np.ndarray, int, int, int] | None:
        """(stored bytes, length, crc32, tokens digest) of sample ``sid``."""
        loc = self.locate(sid)
        if loc is None:
            return None
        shard, offset, length, crc, tokens = loc
        return shard.read(offset, length), length, crc, tokens

    def row(self, sid: int, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Sample ``sid``'s features ``[L, F]`` (None when the store does not hold it)."""
        p = self.payload(sid)
        if p is None:
            return None
        payload, length, _, _ = p
        return self.codec.decode(payload, length, self.width, out_dtype or self.codec.default_out_dtype())

    def prefetch(self, sids: Iterable[int]) -> None:
        """Ask the kernel to start reading these samples' rows now (a batch's rows read side by side)."""
        for sid in sids:
            loc = self.locate(int(sid))
            if loc is not None:
                shard, offset, length, _, _ = loc
                shard.advise(offset, length)

    def read_into(self, out: torch.Tensor, sid: int, *, tokens: int | None = None) -> bool:
        """Decode sample ``sid`` into ``out [L, F]`` (CPU); False when absent. ``tokens``: the batch's token
        digest of the row; a different stored one raises."""
        loc = self.locate(sid)
        if loc is None:
            return False
        shard, offset, length, _, stored = loc
        if length != out.shape[0]:
            raise FeatureStoreError(
                f"feature store {self.root}: sample {sid} has {length} tokens there but {out.shape[0]} in this batch: "
                "the store was built from other data, tokenizer or chat template")
        if tokens is not None and tokens != stored:
            raise FeatureStoreError(
                f"feature store {self.root}: the tokens of sample {sid} differ from the ones it was built from: "
                "the store was built from other data, tokenizer or chat template (field 'tokens')")
        raw = self.codec.direct(out)
        if raw is not None:
            shard.read(offset, length, into=raw)  # one copy, into the batch
        else:
            self.codec.decode_into(shard.read(offset, length), out)
        return True

    def close(self) -> None:
        with self._lock:
            for shard in self._open.values():
                shard.close()
            self._open.clear()

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
