"""The target's features on disk: a sharded store with a manifest, random access by sample id, four dtypes
(layout, dtypes and the build over ranks: docs/features.md).

``STORE/manifest.json`` (identity, dtype, width, every shard, complete or not), ``index.bin`` (the merged
index), ``shards/*.dfs`` (the rows, each shard self-describing: its index and meta in a trailer, rows aligned
to 64 bytes, read with ``pread`` straight into the batch), ``ranks/*.json`` (what each builder rank
finished), ``.lock`` (``StoreLock``). Every file is written beside its name and renamed, so a shard exists
whole or not at all and a build resumes from the shards on disk. Under torchrun each rank writes shards
named by generation and rank and rank 0 merges them; hybrid training appends shards named by host, pid and
a random token under a shared lock (``StoreAppender``).

Modules: ``format`` (names, trailer, index rows, errors, codecs, digests, identity), ``shard`` (one shard
written, appended to, read), ``manifest`` (lock, manifest, merge), ``reader`` (``FeatureStore``), ``build``.
"""

from __future__ import annotations

from dflash_flow.model.feature_store.build import LocalComm, SampleIndex, build_store
from dflash_flow.model.feature_store.format import (
    CODECS,
    FP8_MAX,
    MANIFEST,
    Codec,
    FeatureStoreError,
    StoreMismatch,
    codec,
    compare_identity,
    corpus_digest,
    estimate_bytes,
    flatten_identity,
    token_digest,
)
from dflash_flow.model.feature_store.manifest import StoreLock, merge_store, open_for_writing
from dflash_flow.model.feature_store.reader import FeatureStore
from dflash_flow.model.feature_store.shard import StoreAppender

__all__ = [
    "CODECS", "FP8_MAX", "MANIFEST", "Codec", "FeatureStore", "FeatureStoreError", "LocalComm", "SampleIndex",
    "StoreAppender", "StoreLock", "StoreMismatch", "build_store", "codec", "compare_identity",
    "corpus_digest", "estimate_bytes", "flatten_identity", "merge_store", "open_for_writing", "token_digest"
]
