"""The target's features on disk: a sharded store with a manifest, random access by sample id, four dtypes
(docs/features.md). ``STORE/manifest.json``, ``index.bin`` (the merged index), ``shards/*.dfs`` (rows, with
their index in a trailer), ``ranks/*.json`` (what each builder rank finished), ``.lock``. Every file is written
beside its name and renamed, so a shard exists whole or not at all and a build resumes from those on disk.
"""

from __future__ import annotations

from dflash_flow.model.feature_store.build import LocalComm, SampleIndex, build_store
from dflash_flow.model.feature_store.format import (
    CODECS,
    FP8_MAX,
    MANIFEST,
    Codec,
    FeatureStoreError,
    StoreAppender,
    StoreMismatch,
    codec,
    estimate_bytes,
    token_digest,
)
from dflash_flow.model.feature_store.manifest import (
    StoreLock,
    compare_identity,
    corpus_digest,
    flatten_identity,
    merge_store,
    open_for_writing,
)
from dflash_flow.model.feature_store.reader import FeatureStore

__all__ = [
    "CODECS", "FP8_MAX", "MANIFEST", "Codec", "FeatureStore", "FeatureStoreError", "LocalComm", "SampleIndex",
    "StoreAppender", "StoreLock", "StoreMismatch", "build_store", "codec", "compare_identity",
    "corpus_digest", "estimate_bytes", "flatten_identity", "merge_store", "open_for_writing", "token_digest"
]
