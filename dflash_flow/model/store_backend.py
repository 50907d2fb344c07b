"""``StoreBackend``: the target's features from a store on disk, as a TargetBackend (``model.backend``'s protocol:
``layer_ids``, ``hidden_size``, ``setup``, ``features``, ``close``).

* ``offline``: every row is read from a finished store (``model.feature_store``); no target is loaded. The
  store's identity must match what the pipeline declares (``identity``: refused naming the field), each
  row's tokens must be the batch's (a digest per row), and a sample the store lacks is an error naming it.
* ``hybrid``: a row the store does not hold yet is computed through the wrapped backend (``inner``: the
  in-process target or the engine), alone (a batch of one, its own length: what it is does not depend on
  its batch), written to the store and kept in the RAM tier; later epochs read it. A computed row is
  passed through the store's codec before use, so the values trained on are the values a later read gives
  (with fp32 the codec changes nothing). Without ``path`` the store is RAM only: what
  ``TargetForward.cache_features`` has always done.

Lookup order for a row: the RAM tier (``feature_cache.FeatureCache``, ``ram_budget_bytes``), the rows of
the shard being written, the store on disk (and, before computing or failing, a fresh look at the shards
other processes wrote, at most every ``rescan_s``), then the target. One backend serves every replica of a
stage in a process (a copy is the backend itself) and is thread-safe; ``setup``/``close`` count the
replicas, so the store is closed (its shards merged into the manifest) when the last one closes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from dflash_flow.model.feature_cache import FeatureCache
from dflash_flow.model.feature_store import (
    CODECS,
    Codec,
    FeatureStore,
    FeatureStoreError,
    StoreAppender,
    StoreLock,
    StoreMismatch,
    Write,
    codec,
    compare_identity,
    merge_store,
    open_for_writing,
    token_digest,
)

__all__ = ["StoreBackend", "expected_identity", "store_backend"]

MODES = ("offline", "hybrid")


class StoreBackend:
    """A TargetBackend over a feature store (see the module doc). Construct with plain values; ``inner`` is
    the backend that computes (hybrid only)."""

    def __init__(
        self,
        *,
        mode: str,
        path: str | Path | None,
        inner: Any = None,
        identity: Mapping[str, Any] | None = None,
        layer_ids: Sequence[int] | None = None,
        dtype: str = "auto",
        ram_budget_bytes: int = 0,
        shard_bytes: int = 256 * 2**20,
        verify_tokens: bool = True,
        out_dtype: torch.dtype | None = None,
        rescan_s: float = 5.0,
        write: Write | None = None,
    ) -> None:
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
        self.identity = dict(identity or {})
        self.dtype = dtype
        self.verify_tokens = verify_tokens
        self.shard_bytes = int(shard_bytes)
        self.rescan_s = float(rescan_s)
        self._write = write
        self._out_dtype = out_dtype
        self.ram = FeatureCache(budget_bytes=int(ram_budget_bytes))
        self.layer_ids: list[int] = list(layer_ids) if layer_ids is not None else list(getattr(inner, "layer_ids", []) or [])
        self.hidden_size: int = int(getattr(inner, "hidden_size", 0) or 0)
        self.vocab_size: int = int(getattr(inner, "vocab_size", 0) or 0)
        self.store: FeatureStore | None = None
        self.codec: Codec | None = None
        self._appender: StoreAppender | None = None
        self._lock = StoreLock(self.path) if self.path is not None and mode == "hybrid" else None
        self._guard = threading.RLock()
        self._users = 0
        self._out_device: torch.device = torch.device("cpu")
        self._last_scan = 0.0
        self._name = "target"
        self._compute_dtype: str | None = None
        self.disk_hits = 0
        self.computed = 0

    def __deepcopy__(self, memo: dict) -> StoreBackend:
        return self  # one backend for a stage's replicas (deep copies of one template)

    @property
    def width(self) -> int:
        return len(self.layer_ids) * self.hidden_size

    # -- protocol -------------------------------------------------------------------------------------
    def setup(self, *, devices: list[str], out_device: str, name: str) -> None:
        with self._guard:
            self._users += 1
            if self._users > 1:
                return
            self._name = name
            self._out_device = torch.device(out_device)
            if self.mode == "offline":
                self._open_offline()
            else:
                self.inner.setup(devices=devices, out_device=out_device, name=name)
                self.layer_ids = list(self.inner.layer_ids)
                self.hidden_size = int(self.inner.hidden_size)
                self.vocab_size = int(getattr(self.inner, "vocab_size", 0) or 0)
                if self.path is not None:
                    self._open_hybrid()

    def _check_layers(self, stored: Sequence[int]) -> None:
        for want in (self.layer_ids, self.identity.get("layer_ids")):
            if want and list(want) != list(stored):
                raise StoreMismatch(self.path, [("layer_ids", list(stored), list(want))])

    def _open_offline(self) -> None:
        store = FeatureStore(self.path, complete=True)
        fields = compare_identity(store.identity, self.identity)
        if fields:
            store.close()
            raise StoreMismatch(self.path, fields)
        try:
            self._check_layers(store.layer_ids)
        except StoreMismatch:
            store.close()
            raise
        if self.dtype != "auto" and self.dtype != store.codec.name:
            store.close()
            raise StoreMismatch(self.path, [("dtype", store.codec.name, self.dtype)])
        self.store, self.codec = store, store.codec
        self.layer_ids = list(store.layer_ids)
        self.hidden_size = store.width // max(len(store.layer_ids), 1)
        # Token ids are checked against it before a batch is read (a store records its target's).
        self.vocab_size = int(store.manifest.get("vocab_size") or 0) or 2**31 - 1

    def _open_hybrid(self) -> None:
        assert self._lock is not None
        self._lock.acquire(exclusive=False, what="hybrid training")  # a build going on: refused at once
        try:
            store = FeatureStore(self.path, complete=False) if (self.path / "manifest.json").exists() else None
        except FeatureStoreError:
            self._lock.release()
            raise
        if store is None:
            return  # created with the first row (its dtype may come from the target's)
        fields = compare_identity(store.identity, {**self.identity, "layer_ids": self.layer_ids})
        if store.width != self.width:
            fields.append(("width", store.width, self.width))
        if self.dtype != "auto" and self.dtype != store.codec.name:
            fields.append(("dtype", store.codec.name, self.dtype))
        if fields:
            store.close()
            self._lock.release()
            raise StoreMismatch(self.path, fields)
        self._start_writing(store.codec)
        self.store = store

    def _start_writing(self, c: Codec) -> None:
        m = open_for_writing(self.path, identity={**self.identity, "layer_ids": self.layer_ids}, codec=c, width=self.width,
                             vocab_size=self.vocab_size or None, compute_dtype=self._compute_dtype)
        self.codec = c
        self._appender = StoreAppender(self.path, codec=c, width=self.width, identity_digest=m["identity_digest"],
                                       shard_bytes=self.shard_bytes, write=self._write, on_shard=self._on_shard)

    def _on_shard(self, _info) -> None:
        if self.store is None:
            self.store = FeatureStore(self.path, complete=False)
        else:
            self.store.refresh()

    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, lengths: Sequence[int],
                 sample_ids: Sequence[Any]) -> torch.Tensor:
        """``[b, S, n * H]`` for a right-padded batch, every row from the RAM tier, the store or (hybrid) the
        target; padding zero."""
        b, s = input_ids.shape
        if len(lengths) != b or len(sample_ids) != b:
            raise ValueError(f"a batch of {b} rows needs {b} lengths and sample ids (got {len(lengths)}, {len(sample_ids)})")
        ids_cpu = input_ids.detach().to("cpu")
        if self.store is not None:  # the batch's rows read side by side
            self.store.prefetch(int(sid) for sid in sample_ids if sid is not None and int(sid) not in self.ram)
        out: torch.Tensor | None = None
        hits = misses = 0
        for i, (length, sid) in enumerate(zip(lengths, sample_ids, strict=True)):
            length = int(length)
            toks = ids_cpu[i, :length]
            if sid is None:  # a row without an id cannot be looked up: computed (hybrid), never stored
                if self.mode == "offline":
                    raise FeatureStoreError(f"{self._name}: a row without a sample id cannot be read from feature store "
                                            f"{self.path}")
                ids = toks.unsqueeze(0)
                out = self._place(out, b, s, i, self.inner.features(ids, torch.ones_like(ids), [length], [None])[0, :length]
                                  .detach().to("cpu"))
                continue
            sid = int(sid)
            row = self.ram.get(sid, length)
            if row is not None:
                hits += 1
                out = self._place(out, b, s, i, row)
                continue
            misses += 1
            digest = token_digest(toks) if (self.verify_tokens or self.mode == "hybrid") else None
            if out is None and self._out_dtype_known():
                out = self._new_out(b, s)
            if out is not None and self._read(out[i, :length], sid, digest):
                self.disk_hits += 1
                self.ram.put(sid, out[i, :length].clone())
                continue
            row = self._compute(toks, attention_mask, i, sid, digest)
            out = self._place(out, b, s, i, row)
        self.ram.count(hits, misses)
        if out is None:
            raise ValueError("a batch with no rows has no features")
        if self._out_device.type != "cpu":
            out = out.pin_memory().to(self._out_device, non_blocking=True)
        return out

    def close(self) -> None:
        with self._guard:
            if self._users == 0:
                return
            self._users -= 1
            if self._users:
                return
            try:
                if self._appender is not None:
                    self._appender.close()
                    self._appender = None
                    if self._lock is not None and self._lock.try_exclusive():
                        merge_store(self.path)  # no other writer now: the manifest lists every shard
            finally:
                if self._lock is not None:
                    self._lock.release()
                if self.store is not None:
                    self.store.close()
                if self.inner is not None:
                    self.inner.close()

    # -- rows -----------------------------------------------------------------------------------------
    def _out_dtype_known(self) -> bool:
        if self._out_dtype is None and self.codec is not None:
            self._out_dtype = self.codec.default_out_dtype()
        return self._out_dtype is not None and self.width > 0

    def _new_out(self, b: int, s: int) -> torch.Tensor:
        return torch.zeros((b, s, self.width), dtype=self._out_dtype)

    def _place(self, out: torch.Tensor | None, b: int, s: int, i: int, row: torch.Tensor) -> torch.Tensor:
        if out is None:
            if self._out_dtype is None:
                self._out_dtype = row.dtype
            out = self._new_out(b, s)
        out[i, : row.shape[0]] = row
        return out

    def _read(self, dst: torch.Tensor, sid: int, digest: int | None) -> bool:
        appender = self._appender
        if appender is not None:
            pending = appender.pending.get(sid)
            if pending is not None:
                payload, _ = pending
                self.codec.decode_into(payload, dst)
                return True
        if self.store is not None and self.store.read_into(dst, sid, tokens=digest if self.verify_tokens else None):
            return True
        if self.store is not None and time.monotonic() - self._last_scan >= self.rescan_s:
            self._last_scan = time.monotonic()  # other processes' shards (hybrid under torchrun)
            if self.store.refresh():
                return self.store.read_into(dst, sid, tokens=digest if self.verify_tokens else None)
        return False

    def _compute(self, toks: torch.Tensor, attention_mask: torch.Tensor, i: int, sid: int,
                 digest: int | None) -> torch.Tensor:
        if self.mode == "offline":
            raise FeatureStoreError(
                f"{self._name}: sample {sid} is not in feature store {self.path}: it was built from other data "
                "(run `dflash-flow features build PIPELINE` for this pipeline's data)")
        length = toks.shape[0]
        ids = toks.unsqueeze(0)  # the inner backend moves its inputs where its model is
        row = self.inner.features(ids, torch.ones_like(ids), [length], [sid])[0, :length].detach().to("cpu")
        self.computed += 1
        if self.path is None:
            self.ram.put(sid, row)
            return row
        with self._guard:
            if self.codec is None:
                self._compute_dtype = str(row.dtype).removeprefix("torch.")
                self._start_writing(codec(self.dtype, row.dtype))
        payload = self.codec.encode(row)
        row = self.codec.decode(payload, length, self.width, self._out_dtype or self.codec.default_out_dtype())
        self._appender.append(sid, digest if digest is not None else token_digest(toks), payload)
        self.ram.put(sid, row)
        return row

    def stats(self) -> dict[str, float]:
        """Counters for the stage's metrics: RAM hits, disk reads, rows computed and written, RAM use."""
        return {"ram_hits": self.ram.hits, "disk_hits": self.disk_hits, "computed": self.computed,
                "ram_rows": len(self.ram), "ram_mb": self.ram.bytes / 2**20,
                "written": self._appender.rows if self._appender is not None else 0}


def expected_identity(spec: Any, *, layer_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The identity a store must have for this run's model spec (``model.spec.ModelSpec``): the target's config
    and weights digest, the layer ids, the tokenizer's fingerprint. What cannot be had here (an offline run on
    a machine without the target) is None: not compared (each row's tokens still are)."""
    import logging

    from dflash_flow.model.feature_identity import target_fingerprint

    log = logging.getLogger(__name__)
    ident: dict[str, Any] = {"layer_ids": list(layer_ids) if layer_ids is not None else None}
    try:
        ident["target"] = target_fingerprint(spec.target, trust_remote_code=spec.trust_remote_code)
    except Exception as exc:  # noqa: BLE001 - not readable here: the store's own record is trusted, said once
        log.info("the target %s cannot be read here (%s): the store's target fingerprint is not compared", spec.target, exc)
    if ident["layer_ids"] is None:
        try:
            ident["layer_ids"] = spec.layer_ids()
        except ValueError:
            pass  # depth unknown here: the store's layer ids (offline) or the target's (hybrid)
    if spec.tokenizer:
        try:
            from transformers import AutoTokenizer

            from dflash_flow.data.keys import tokenizer_fingerprint

            ident["tokenizer"] = tokenizer_fingerprint(AutoTokenizer.from_pretrained(spec.tokenizer))
        except Exception as exc:  # noqa: BLE001
            log.info("the tokenizer %s cannot be read here (%s): not compared", spec.tokenizer, exc)
    return ident


def store_backend(spec: Any, *, inner: Any, output_dir: Any = None, name: str = "target", rank: int = 0) -> StoreBackend:  # noqa: ARG001
    """The backend ``TargetForward`` runs for ``model.features`` mode offline or hybrid (``spec.features``, a
    ``FeaturesConfig``), wrapping ``inner`` (None offline: no target is loaded)."""
    conf = spec.features
    path = Path(conf.path).expanduser() if conf.path else None
    layer_ids = list(spec.explicit_layer_ids) if spec.explicit_layer_ids is not None else None
    return StoreBackend(
        mode=conf.mode, path=path, inner=inner, identity=expected_identity(spec, layer_ids=layer_ids),
        layer_ids=layer_ids, dtype=conf.dtype, ram_budget_bytes=conf.ram_budget_bytes,
        shard_bytes=min(conf.shard_bytes, 256 * 2**20), verify_tokens=conf.verify_tokens)
