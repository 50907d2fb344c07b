"""The target's features on disk: a sharded store with a manifest, random access by sample id, four dtypes.

Layout of a store directory::

    STORE/manifest.json        identity (target config + weights digest, layer ids, tokenizer, chat template and
                               its kwargs, the samples' tokens), dtype, feature width, every shard (file, bytes,
                               blake2b, samples, tokens, sample ids as ranges), complete or not
    STORE/index.bin            the merged index (sample id -> shard, offset, length, crc32, tokens digest),
                               written with the manifest when a build ends; its digest is in the manifest
    STORE/shards/*.dfs         the rows; each shard is self-describing (its own index and meta in a trailer)
    STORE/ranks/*.json         per-rank records of the shards a builder finished (their digests)
    STORE/.lock, .lock.owner   the builders' lock (flock) and who holds it

A shard file: the rows one after another (each starting at a multiple of 64 bytes; a row is ``[L, F]`` in
the storage dtype, then for fp8 the ``L`` fp32 scales), then its index (32 bytes per row: sample id,
offset, length, crc32 of the row, a digest of the row's token ids), its meta (JSON: dtype, width,
identity digest) and a 32-byte trailer (magic, where the index starts, rows, meta length, crc32 of index
and meta). Nothing is compressed: a row is one contiguous slice, read with ``pread`` straight into the
batch being assembled (announced first with ``posix_fadvise(WILLNEED)``; the page cache is the OS's; a
read-only filesystem works).

Writes: every shard is written to a temporary file beside it and renamed (``util.atomic_path``), so a
shard exists whole or not at all; the manifest and the index likewise. A build resumes from the shards
on disk (each carries its sample ids), so a crash, a full disk or a stop loses at most the shards being
written. Under torchrun every rank writes shards named by a generation and its rank (no two processes
ever write one name: no lock is needed between a job's ranks), records them in ``ranks/``, and rank 0
merges them into one manifest at the end; rank 0 holds the store's lock for the whole build, so a second
build of the same store waits or is refused (``StoreLock``). Hybrid training appends shards named by host,
pid and a random token, under a shared lock (``StoreAppender``).

Dtypes (bytes per token for F features): fp32 4F, bf16 2F, fp16 2F, fp8 F + 4 (e4m3 "fn" values, one fp32
scale per token: ``amax / 448``, so every token uses the format's whole range).

The modules, by concept: ``format`` (names, trailer, index rows, errors, codecs, the token digest),
``identity`` (what the features depend on), ``shard`` (one shard written, appended to, read), ``manifest``
(the directory: lock, manifest, merge), ``reader`` (``FeatureStore``), ``build`` (``build_store`` over ranks).
This package re-exports what its users import.
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
    estimate_bytes,
    token_digest,
)
from dflash_flow.model.feature_store.identity import compare_identity, corpus_digest, flatten_identity
from dflash_flow.model.feature_store.manifest import StoreLock, merge_store, open_for_writing
from dflash_flow.model.feature_store.reader import FeatureStore
from dflash_flow.model.feature_store.shard import StoreAppender, Write

__all__ = [
    "CODECS",
    "FP8_MAX",
    "MANIFEST",
    "Codec",
    "FeatureStore",
    "FeatureStoreError",
    "LocalComm",
    "SampleIndex",
    "StoreAppender",
    "StoreLock",
    "StoreMismatch",
    "Write",
    "build_store",
    "codec",
    "compare_identity",
    "corpus_digest",
    "estimate_bytes",
    "flatten_identity",
    "merge_store",
    "open_for_writing",
    "token_digest",
]
