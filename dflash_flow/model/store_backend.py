"""``StoreBackend``: the target's features from a store on disk, as a TargetBackend (``model.backend``).

``offline``: every row from a finished store of the pipeline's identity; no target is loaded. ``hybrid``: a row
the store lacks is computed alone through ``inner``, passed through the store's codec (so training sees what a
later read gives), written to the store and kept in RAM (without ``path``: RAM only). A row is looked up in
RAM, the shard being written, the store, then the target.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_flow.model.feature_cache import FeatureCache, compute_alone
from dflash_flow.model.feature_store import (
    CODECS,
    Codec,
    FeatureStore,
    FeatureStoreError,
    StoreAppender,
    StoreLock,
    StoreMismatch,
    codec,
    compare_identity,
    merge_store,
    open_for_writing,
    token_digest,
)

__all__ = ["StoreBackend", "StoreTier", "expected_identity", "store_backend"]

MODES = ("offline", "hybrid")


class StoreTier:
    """What the replicas of a stage in one process share for one store (RAM tier, store, writer, lock)."""

    def __init__(self, *, mode: str, path: Path | None, identity: Mapping[str, Any], dtype: str, ram_budget_bytes: int,
                 shard_bytes: int, verify_tokens: bool, rescan_s: float = 5.0) -> None:
        self.mode, self.path, self.identity, self.dtype = mode, path, dict(identity), dtype
        self.shard_bytes, self.verify_tokens, self.rescan_s = shard_bytes, verify_tokens, rescan_s
        self.key: Any = None
        self.ram = FeatureCache(budget_bytes=int(ram_budget_bytes))
        self.store: FeatureStore | None = None
        self.codec: Codec | None = None
        self.appender: StoreAppender | None = None
        self.lock = StoreLock(path) if path is not None and mode == "hybrid" else None
        self.guard = threading.RLock()
        self.users = 0
        self.opened = False
        self.layer_ids: list[int] = []
        self.hidden_size = 0
        self.vocab_size = 0
        self.compute_dtype: str | None = None
        self.out_dtype: torch.dtype | None = None
        self.last_scan = 0.0
        self.disk_hits = 0

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def open_offline(self, layer_ids: Sequence[int] | None) -> None:
        store = FeatureStore(self.path, complete=True)
        fields = compare_identity(store.identity, self.identity)
        for want in (layer_ids, self.identity.get("layer_ids")):
            if want and list(want) != list(store.layer_ids) and not any(f[0] == "layer_ids" for f in fields):
                fields.append(("layer_ids", list(store.layer_ids), list(want)))
        if fields := fields + self._dtype_differs(store):
            store.close()
            raise StoreMismatch(self.path, fields)
        self.store, self.codec = store, store.codec
        self.layer_ids = list(store.layer_ids)
        self.hidden_size = store.width // max(len(store.layer_ids), 1)
        # Token ids are checked against it before a batch is read (a store records its target's).
        self.vocab_size = int(store.manifest.get("vocab_size") or 0) or 2**31 - 1

    def open_hybrid(self, layer_ids: Sequence[int], hidden_size: int, vocab_size: int) -> None:
        self.layer_ids, self.hidden_size, self.vocab_size = list(layer_ids), int(hidden_size), int(vocab_size)
        if self.path is None:
            return  # RAM only
        assert self.lock is not None
        self.lock.acquire(exclusive=False, what="hybrid training")  # a build going on: refused at once
        try:
            store = FeatureStore(self.path, complete=False) if (self.path / "manifest.json").exists() else None
        except FeatureStoreError:
            self.lock.release()
            raise
        if store is None:
            return  # created with the first row (its dtype may come from the target's)
        fields = compare_identity(store.identity, {**self.identity, "layer_ids": self.layer_ids})
        if store.width != self.width:
            fields.append(("width", store.width, self.width))
        if fields := fields + self._dtype_differs(store):
            store.close()
            self.lock.release()
            raise StoreMismatch(self.path, fields)
        self.store = store
        self._start_writing(store.codec)

    def _dtype_differs(self, store: FeatureStore) -> list[tuple[str, Any, Any]]:
        return [("dtype", store.codec.name, self.dtype)] if self.dtype not in ("auto", store.codec.name) else []

    def _start_writing(self, c: Codec) -> None:
        m = open_for_writing(self.path, identity={**self.identity, "layer_ids": self.layer_ids}, codec=c,
                             width=self.width, vocab_size=self.vocab_size or None, compute_dtype=self.compute_dtype)
        self.codec = c
        self.appender = StoreAppender(self.path, codec=c, width=self.width, identity_digest=m["identity_digest"],
                                      shard_bytes=self.shard_bytes, on_shard=self._on_shard)

    def _on_shard(self, _info) -> None:
        if self.store is None:
            self.store = FeatureStore(self.path, complete=False)
        else:
            self.store.refresh()

    def close(self) -> None:
        """The last user: flush, merge the shards into the manifest (when no other process writes), unlock."""
        try:
            if self.appender is not None:
                self.appender.close()
                self.appender = None
                if self.lock is not None and self.lock.try_exclusive():
                    merge_store(self.path)
        finally:
            if self.lock is not None:
                self.lock.release()
            if self.store is not None:
                self.store.close()

    def read(self, dst: torch.Tensor, sid: int, digest: int | None) -> bool:
        appender = self.appender
        if appender is not None:
            pending = appender.pending.get(sid)
            if pending is not None:
                self.codec.decode_into(pending[0], dst)
                return True
        tokens = digest if self.verify_tokens else None
        if self.store is not None and self.store.read_into(dst, sid, tokens=tokens):
            return True
        if self.store is not None and time.monotonic() - self.last_scan >= self.rescan_s:
            self.last_scan = time.monotonic()  # other processes' shards (hybrid under torchrun)
            if self.store.refresh():
                return self.store.read_into(dst, sid, tokens=tokens)
        return False

    def keep(self, sid: int, toks: torch.Tensor, digest: int | None, row: torch.Tensor) -> torch.Tensor:
        """Store a row just computed (and keep it in RAM); returns the values a later read gives."""
        if self.path is None:
            self.ram.put(sid, row)
            return row
        with self.guard:
            if self.codec is None:
                self.compute_dtype = str(row.dtype).removeprefix("torch.")
                self._start_writing(codec(self.dtype, row.dtype))
        length = row.shape[0]
        payload = self.codec.encode(row)
        row = self.codec.decode(payload, length, self.width, self.out_dtype or self.codec.default_out_dtype())
        self.appender.append(sid, digest if digest is not None else token_digest(toks), payload)
        self.ram.put(sid, row)
        return row


_TIERS: dict[Any, StoreTier] = {}
_TIERS_LOCK = threading.Lock()


class StoreBackend:
    """A TargetBackend over a feature store; ``inner`` computes (hybrid only); ``tier``: the shared state."""

    def __init__(self, *, mode: str, path: str | Path | None, inner: Any = None, identity: Mapping[str, Any] | None = None,
                 layer_ids: Sequence[int] | None = None, dtype: str = "auto", ram_budget_bytes: int = 0,
                 shard_bytes: int = 256 * 2**20, verify_tokens: bool = True, tier: StoreTier | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"StoreBackend mode must be one of {MODES}, got {mode!r}")
        if mode == "offline" and path is None:
            raise FeatureStoreError("offline features need a store: set model.features.path")
        if mode == "hybrid" and inner is None:
            raise ValueError("hybrid features need the backend that computes them (inner)")
        if dtype != "auto" and dtype not in CODECS:
            raise FeatureStoreError(f"unknown feature store dtype {dtype!r}; known: auto, {', '.join(CODECS)}")
        self.mode = mode
        self.path = None if path is None else Path(path).expanduser()
        self.inner = inner
        self.tier = tier or StoreTier(mode=mode, path=self.path, identity=identity or {}, dtype=dtype,
                                      ram_budget_bytes=ram_budget_bytes, shard_bytes=shard_bytes,
                                      verify_tokens=verify_tokens)
        self._want_layers = list(layer_ids) if layer_ids is not None else None
        self.layer_ids: list[int] = list(layer_ids or getattr(inner, "layer_ids", []) or [])
        self.hidden_size: int = int(getattr(inner, "hidden_size", 0) or 0)
        self.vocab_size: int = int(getattr(inner, "vocab_size", 0) or 0)
        self.rows_independent = False  # rows from disk or RAM are independent, but a cache above adds nothing
        self._users = 0
        self._out_device: torch.device = torch.device("cpu")
        self._name = "target"

    def __deepcopy__(self, memo: dict) -> StoreBackend:
        return self  # a copy of a stage holding one backend holds the same backend

    @property
    def ram(self) -> FeatureCache:
        return self.tier.ram

    @property
    def disk_hits(self) -> int:
        return self.tier.disk_hits

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    def setup(self, *, devices: list[str], out_device: str, name: str) -> None:
        self._users += 1
        if self._users > 1:
            return
        self._name = name
        self._out_device = torch.device(out_device)
        if self.mode == "hybrid":
            self.inner.setup(devices=devices, out_device=out_device, name=name)
        t = self.tier
        with t.guard:
            if not t.opened:
                if self.mode == "offline":
                    t.open_offline(self._want_layers)
                else:
                    t.open_hybrid(self.inner.layer_ids, self.inner.hidden_size, getattr(self.inner, "vocab_size", 0) or 0)
                t.opened = True
            t.users += 1
        self.layer_ids, self.hidden_size, self.vocab_size = list(t.layer_ids), t.hidden_size, t.vocab_size

    def close(self) -> None:
        if self._users == 0:
            return
        self._users -= 1
        if self._users:
            return
        t = self.tier
        try:
            with t.guard:
                t.users -= 1
                last = t.users == 0 and t.opened
                if last:
                    t.opened = False
                    with _TIERS_LOCK:
                        if _TIERS.get(t.key) is t:
                            del _TIERS[t.key]
                    t.close()
        finally:
            if self.inner is not None:
                self.inner.close()

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Sequence[int],
                 sample_ids: Sequence[Any]) -> torch.Tensor:
        """``[b, S, n * H]`` for a right-padded batch (padding zero)."""
        b, s = input_ids.shape
        if len(lengths) != b or len(sample_ids) != b:
            raise ValueError(f"a batch of {b} rows needs {b} lengths and sample ids (got {len(lengths)}, {len(sample_ids)})")
        t = self.tier
        ids_cpu = input_ids.detach().to("cpu")
        if t.store is not None:  # the batch's rows read side by side
            t.store.prefetch(int(sid) for sid in sample_ids if sid is not None and int(sid) not in t.ram)
        out: torch.Tensor | None = None
        hits = misses = 0
        todo: list[tuple[int, int | None, torch.Tensor, int | None]] = []  # (row, sample id, tokens, digest)
        for i, (length, sid) in enumerate(zip(lengths, sample_ids, strict=True)):
            length = int(length)
            toks = ids_cpu[i, :length]
            if sid is None:  # a row without an id cannot be looked up: computed (hybrid), never stored
                if self.mode == "offline":
                    raise FeatureStoreError(f"{self._name}: a row without a sample id cannot be read from feature store "
                                            f"{self.path}")
                todo.append((i, None, toks, None))
                continue
            sid = int(sid)
            row = t.ram.get(sid, length)
            if row is not None:
                hits += 1
                out = self._place(out, b, s, i, row)
                continue
            misses += 1
            digest = token_digest(toks) if (t.verify_tokens or self.mode == "hybrid") else None
            if out is None and self._out_dtype_known():
                out = self._new_out(b, s)
            if out is not None and t.read(out[i, :length], sid, digest):
                t.disk_hits += 1
                t.ram.put(sid, out[i, :length].clone())
                continue
            if self.mode == "offline":
                raise FeatureStoreError(
                    f"{self._name}: sample {sid} is not in feature store {self.path}: it was built from other data "
                    "(run `dflash-flow features build PIPELINE` for this pipeline's data)")
            todo.append((i, sid, toks, digest))
        # The rows no tier holds, each computed alone (in one call where the target's rows are independent).
        rows = compute_alone(self.inner.features, [toks for _, _, toks, _ in todo], [sid for _, sid, _, _ in todo],
                             together=self.inner.rows_independent) if todo else []
        for (i, sid, toks, digest), row in zip(todo, rows, strict=True):
            row = row.detach().to("cpu")
            out = self._place(out, b, s, i, row if sid is None else t.keep(sid, toks, digest, row))
        t.ram.count(hits, misses)
        if out is None:
            raise ValueError("a batch with no rows has no features")
        if self._out_device.type != "cpu":
            out = out.pin_memory().to(self._out_device, non_blocking=True)
        return out

    def _out_dtype_known(self) -> bool:
        t = self.tier
        if t.out_dtype is None and t.codec is not None:
            t.out_dtype = t.codec.default_out_dtype()
        return t.out_dtype is not None and self.width > 0

    def _new_out(self, b: int, s: int) -> torch.Tensor:
        return torch.zeros((b, s, self.width), dtype=self.tier.out_dtype)

    def _place(self, out: torch.Tensor | None, b: int, s: int, i: int, row: torch.Tensor) -> torch.Tensor:
        if out is None:
            if self.tier.out_dtype is None:
                self.tier.out_dtype = row.dtype
            out = self._new_out(b, s)
        out[i, : row.shape[0]] = row
        return out


def expected_identity(spec: Any, *, layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The identity a store must have for this run's ``ModelSpec``: target fingerprint, layer ids, tokenizer
    fingerprint; what cannot be read here is None (not compared)."""
    import logging

    from dflash_flow.model.feature_identity import target_fingerprint

    log = logging.getLogger(__name__)
    ident: dict[str, Any] = {"layer_ids": list(layer_ids) if layer_ids is not None else None}
    try:
        ident["target"] = target_fingerprint(spec.target, trust_remote_code=spec.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - not readable here: the store's own record is trusted, said once
        log.info("the target %s cannot be read here (%s): the store's target fingerprint is not compared", spec.target, exc)
    if ident["layer_ids"] is None:
        with contextlib.suppress(ValueError):  # depth unknown here: the store's (offline) or the target's ids
            ident["layer_ids"] = spec.layer_ids()
    if spec.tokenizer:
        try:
            from transformers import AutoTokenizer

            from dflash_flow.data.store import tokenizer_fingerprint

            ident["tokenizer"] = tokenizer_fingerprint(AutoTokenizer.from_pretrained(spec.tokenizer))
        except Exception as exc:  # noqa: BLE001
            log.info("the tokenizer %s cannot be read here (%s): not compared", spec.tokenizer, exc)
    return ident


def store_backend(spec: Any, *, inner: Any, output_dir: Any = None, name: str = "target", rank: int = 0) -> StoreBackend:  # noqa: ARG001
    """A ``TargetForward`` replica's backend for ``model.features`` offline or hybrid (one tier per stage)."""
    conf = spec.features
    path = Path(conf.path).expanduser().resolve() if conf.path else None
    layer_ids = list(spec.explicit_layer_ids) if spec.explicit_layer_ids is not None else None
    key = (conf.mode, str(path) if path is not None else f"ram:{name}")
    with _TIERS_LOCK:  # the replicas of the stage share one tier (keyed by the store, or by the stage without one)
        tier = _TIERS.get(key)
        if tier is None:
            tier = _TIERS[key] = StoreTier(
                mode=conf.mode, path=path, identity=expected_identity(spec, layer_ids=layer_ids), dtype=conf.dtype,
                ram_budget_bytes=conf.ram_budget_bytes, shard_bytes=min(conf.shard_bytes, 256 * 2**20),
                verify_tokens=conf.verify_tokens)
            tier.key = key
    return StoreBackend(mode=conf.mode, path=path, inner=inner, layer_ids=layer_ids, dtype=conf.dtype, tier=tier)
