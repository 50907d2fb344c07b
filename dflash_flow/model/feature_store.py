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
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import struct
import threading
import time
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs
import numpy as np
import torch

from dflash_flow.core.errors import DflashFlowError
from dflash_flow.util import atomic_path, atomic_write_bytes, atomic_write_text, config_hash, fsync_dir

__all__ = [
    "CODECS",
    "BuildProgress",
    "BuildResult",
    "Codec",
    "FeatureStore",
    "FeatureStoreError",
    "LocalComm",
    "SampleIndex",
    "ShardInfo",
    "ShardWriter",
    "StoreAppender",
    "StoreLock",
    "StoreMismatch",
    "build_store",
    "compare_identity",
    "corpus_digest",
    "estimate_bytes",
    "flatten_identity",
    "merge_store",
    "token_digest",
]

log = logging.getLogger(__name__)

FORMAT = "dflash-flow-feature-store"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.bin"
SHARDS = "shards"
RANKS = "ranks"
LOCK = ".lock"
SUFFIX = ".dfs"
SHARD_MAGIC = b"DFFEAT01"
_TRAILER = struct.Struct("<8sQQII")  # magic, index offset, rows, meta length, crc32(index + meta)
ALIGN = 64
#: One row of a shard's index (and of the merged index, with the shard's number in ``shard``).
INDEX_DTYPE = np.dtype([("sid", "<i8"), ("offset", "<u8"), ("length", "<u4"), ("crc", "<u4"), ("tokens", "<u8")])
MERGED_DTYPE = np.dtype([("sid", "<i8"), ("shard", "<u4"), ("length", "<u4"), ("offset", "<u8"), ("crc", "<u4"),
                         ("pad", "<u4"), ("tokens", "<u8")])
_BUILT_NAME = re.compile(r"^g(\d+)-r(\d+)-(\d+)\.dfs$")
FP8_MAX = 448.0  # the largest finite e4m3fn value
_REOPEN = "run `dflash-flow features build PIPELINE` again: it computes only the missing samples"


class FeatureStoreError(DflashFlowError):
    """A store that cannot be used as asked: missing or damaged files, another identity, no space, locked."""


class StoreMismatch(FeatureStoreError):
    """The store was built for another target, tokenizer, template, layer set or data: ``fields`` names them."""

    def __init__(self, path: Path, fields: list[tuple[str, Any, Any]]):
        self.path = path
        self.fields = fields
        shown = "; ".join(f"{name}: store {_short(a)} vs this pipeline {_short(b)}" for name, a, b in fields)
        super().__init__(
            f"feature store {path} was built for another {', '.join(n for n, _, _ in fields)} ({shown}): build one for "
            "this pipeline into another path (`dflash-flow features build PIPELINE`), or point model.features.path "
            "at the store built for it")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 48 else text[:45] + "..."


# --------------------------------------------------------------------------------------------------
# dtypes


@attrs.frozen
class Codec:
    """How a row ``[L, F]`` is stored: ``itemsize`` bytes per value, plus a fp32 scale per token (fp8)."""

    name: str
    torch_dtype: torch.dtype
    itemsize: int
    scaled: bool = False

    def bytes_per_token(self, width: int) -> int:
        return width * self.itemsize + (4 if self.scaled else 0)

    def row_bytes(self, length: int, width: int) -> int:
        return length * self.bytes_per_token(width)

    def encode(self, row: torch.Tensor) -> np.ndarray:
        """The row's bytes (uint8, contiguous) as stored."""
        x = row.detach().to("cpu")
        if not self.scaled:
            x = x.to(self.torch_dtype).contiguous()
            if self.itemsize == 2:
                x = x.view(torch.int16)
            return x.numpy().reshape(-1).view(np.uint8)
        x = x.to(torch.float32)
        amax = x.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
        return np.concatenate([q.view(torch.uint8).numpy().reshape(-1), scale.numpy().view(np.uint8)])

    def decode(self, payload: np.ndarray, length: int, width: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """A stored row back as a tensor ``[L, F]`` (``out_dtype``: default the storage dtype; fp8: float32)."""
        n = length * width
        if not self.scaled:
            raw = torch.from_numpy(np.array(payload[: n * self.itemsize]))
            x = raw.view(self.torch_dtype).reshape(length, width)
            return x if out_dtype in (None, self.torch_dtype) else x.to(out_dtype)
        q = torch.from_numpy(np.array(payload[:n])).view(torch.float8_e4m3fn).reshape(length, width)
        scale = torch.from_numpy(np.array(payload[n : n + 4 * length]).view(np.float32))
        x = q.to(torch.float32) * scale[:, None]
        return x if out_dtype in (None, torch.float32) else x.to(out_dtype)

    def decode_into(self, payload: np.ndarray, out: torch.Tensor) -> None:
        """Decode into ``out [L, F]`` (a CPU tensor): one copy from the page cache when ``out`` has the
        storage dtype."""
        length, width = out.shape
        if not self.scaled and out.dtype == self.torch_dtype and out.device.type == "cpu" and out.is_contiguous():
            n = length * width * self.itemsize
            if self.itemsize == 2:
                np.copyto(out.view(torch.int16).numpy(), payload[:n].view(np.int16).reshape(length, width))
            else:
                np.copyto(out.numpy(), payload[:n].view(np.float32).reshape(length, width))
            return
        out.copy_(self.decode(payload, length, width, out.dtype))

    def roundtrip(self, row: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """What a read of ``row`` gives back (hybrid training uses these values from the first epoch on, so
        that a row computed now and one read later are the same)."""
        length, width = row.shape
        return self.decode(self.encode(row), length, width, out_dtype)

    def default_out_dtype(self) -> torch.dtype:
        return torch.float32 if self.scaled else self.torch_dtype


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", torch.float32, 4),
    "bf16": Codec("bf16", torch.bfloat16, 2),
    "fp16": Codec("fp16", torch.float16, 2),
    "fp8": Codec("fp8", torch.float8_e4m3fn, 1, scaled=True),
}
_BY_TORCH = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def codec(name: str, compute_dtype: torch.dtype | None = None) -> Codec:
    """The codec of a dtype name; ``auto``: the target's compute dtype (lossless)."""
    if name == "auto":
        name = _BY_TORCH.get(compute_dtype or torch.float32, "fp32")
    try:
        return CODECS[name]
    except KeyError:
        raise FeatureStoreError(f"unknown feature store dtype {name!r}; known: {sorted(CODECS)}") from None


def token_digest(ids: Any) -> int:
    """A 64-bit digest of a sample's token ids (checked against the batch's on every read)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().to("cpu").numpy()
    data = np.ascontiguousarray(np.asarray(ids).astype("<i4", copy=False))
    return int.from_bytes(hashlib.blake2b(memoryview(data).cast("B"), digest_size=8).digest(), "little")


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def estimate_bytes(tokens: int, samples: int, width: int, dtype: str) -> int:
    """Disk bytes of ``samples`` rows of ``tokens`` tokens in all: rows, their alignment, the index entries
    (in the shard and in the merged index)."""
    c = CODECS[dtype]
    return tokens * c.bytes_per_token(width) + samples * (ALIGN // 2 + 2 * INDEX_DTYPE.itemsize)


def _ranges(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as ``[start, end)`` ranges."""
    out: list[list[int]] = []
    for i in sorted(int(x) for x in ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        elif not out or out[-1][1] < i:
            out.append([i, i + 1])
    return out


# --------------------------------------------------------------------------------------------------
# identity


def flatten_identity(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """An identity as dotted fields (``target.weights``); ``template_kwargs`` stays one field."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and k != "template_kwargs":
            out.update(flatten_identity(v, name + "."))
        else:
            out[name] = v
    return out


def compare_identity(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, stored, expected) for every field (dotted: ``target.weights``) known on both sides (not None)
    whose values differ. A field the store did not record (a hybrid store knows no corpus digest) is not
    compared here: every row's token digest is (``FeatureStore.read_into``)."""
    s, e = flatten_identity(stored), flatten_identity(expected)
    return [(k, s.get(k), v) for k, v in sorted(e.items())
            if v is not None and s.get(k) is not None and _norm(s.get(k)) != _norm(v)]


def _fill_unknown(stored: dict[str, Any], expected: Mapping[str, Any]) -> bool:
    """Record in ``stored`` the fields of ``expected`` it did not know; whether any was added."""
    added = False
    for k, v in expected.items():
        if isinstance(v, Mapping) and k != "template_kwargs" and isinstance(stored.get(k), dict):
            added |= _fill_unknown(stored[k], v)
        elif stored.get(k) is None and v is not None:
            stored[k] = _norm(v)
            added = True
    return added


def _norm(v: Any) -> Any:
    return json.loads(json.dumps(v, sort_keys=True, default=str))


def identity_digest(identity: Mapping[str, Any]) -> str:
    return config_hash(_norm(identity))


def corpus_digest(sample_ids: Sequence[int], lengths: Sequence[int], digests: Sequence[int]) -> str:
    """The samples' identity: every (id, length, token digest), in id order."""
    order = np.argsort(np.asarray(sample_ids, dtype=np.int64), kind="stable")
    table = np.stack([np.asarray(sample_ids, dtype=np.int64)[order].astype("<u8"),
                      np.asarray(lengths, dtype=np.int64)[order].astype("<u8"),
                      np.asarray(digests, dtype=np.uint64)[order].astype("<u8")], axis=1)
    return hashlib.blake2b(np.ascontiguousarray(table).tobytes(), digest_size=16).hexdigest()


# --------------------------------------------------------------------------------------------------
# one shard


@attrs.define
class ShardInfo:
    """A finished shard, as the manifest records it."""

    file: str  # relative to the store
    bytes: int
    samples: int
    tokens: int
    ids: list[list[int]]
    blake2b: str | None = None

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> ShardInfo:
        return cls(**{f.name: d.get(f.name) for f in attrs.fields(cls)})


Write = Callable[[Any, memoryview], None]


def _plain_write(f: Any, data: memoryview) -> None:
    f.write(data)


class ShardWriter:
    """Writes one shard: rows appended one at a time into a temporary file, which ``close`` completes (index,
    meta, trailer), fsyncs and renames into place (``util.atomic_path``); ``abort`` (or an error inside a
    ``with`` block) removes it. ``write(f, bytes)``: the one call that writes (tests inject a full disk)."""

    def __init__(self, path: Path, *, codec: Codec, width: int, meta: Mapping[str, Any], write: Write | None = None):
        self.path = Path(path)
        self.codec = codec
        self.width = int(width)
        self.meta = {**meta, "dtype": codec.name, "width": self.width}
        self._write = write or _plain_write
        self._cm = atomic_path(self.path)
        tmp = self._cm.__enter__()
        self._f = open(tmp, "wb")  # noqa: SIM115 - closed in close/abort
        self._pos = 0
        self._hash = hashlib.blake2b(digest_size=20)
        self._rows: list[tuple[int, int, int, int, int]] = []
        self.tokens = 0

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is not None:
            self.abort(exc)

    def _emit(self, data: memoryview | bytes) -> None:
        data = memoryview(data).cast("B")
        self._write(self._f, data)
        self._hash.update(data)
        self._pos += len(data)

    def add(self, sid: int, tokens: int, payload: np.ndarray) -> None:
        """Append one row (``payload``: the codec's bytes of ``[L, F]``)."""
        nbytes = int(payload.nbytes)
        length, rem = divmod(nbytes, self.codec.bytes_per_token(self.width))
        if rem or length <= 0:
            raise ValueError(f"sample {sid}: {nbytes} bytes are not whole tokens of width {self.width}")
        pad = _padded(self._pos) - self._pos
        if pad:
            self._emit(bytes(pad))
        offset = self._pos
        buf = memoryview(np.ascontiguousarray(payload)).cast("B")
        self._emit(buf)
        self._rows.append((int(sid), offset, length, zlib.crc32(buf), int(tokens)))
        self.tokens += length

    @property
    def bytes(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._rows)

    def close(self) -> ShardInfo:
        """Complete the shard (index, meta, trailer), fsync and rename it into place; on any error (a full
        disk) the temporary file is removed and the error raised."""
        index = np.array(self._rows, dtype=INDEX_DTYPE)
        meta = json.dumps(self.meta, sort_keys=True).encode()
        try:
            pad = _padded(self._pos) - self._pos
            if pad:
                self._emit(bytes(pad))
            index_offset = self._pos
            body = index.tobytes() + meta
            self._emit(body)
            self._emit(_TRAILER.pack(SHARD_MAGIC, index_offset, len(index), len(meta), zlib.crc32(body)))
            self._f.flush()
            self._f.close()
        except BaseException as exc:
            self.abort(exc)
            raise
        self._cm.__exit__(None, None, None)  # fsync, rename onto the final name (or remove it, and raise)
        return ShardInfo(file=f"{SHARDS}/{self.path.name}", bytes=self._pos, samples=len(index), tokens=self.tokens,
                         ids=_ranges(index["sid"].tolist()), blake2b=self._hash.hexdigest())

    def abort(self, exc: BaseException | None = None) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        err = exc or RuntimeError("aborted")
        self._cm.__exit__(type(err), err, err.__traceback__)  # removes the temporary file


class Shard:
    """One shard file, opened read-only; its trailer, index and meta checked. Rows are read with ``pread``
    straight into the caller's buffer (one copy from the page cache and one call per row, where ``mmap``
    faults the row in page by page; bench/feature_store_bench.py measures both), announced beforehand with
    ``posix_fadvise(WILLNEED)`` so that a batch's rows are read side by side."""

    def __init__(self, path: Path, *, expect_bytes: int | None = None):
        self.path = Path(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise FeatureStoreError(f"shard {self.path} is missing: {_REOPEN}") from None
        try:
            self._check(expect_bytes)
        except BaseException:
            self.close()
            raise

    def _check(self, expect_bytes: int | None) -> None:
        size = os.fstat(self._fd).st_size
        if expect_bytes is not None and size != expect_bytes:
            raise FeatureStoreError(f"shard {self.path} has {size} bytes, the manifest says {expect_bytes} (truncated "
                                    f"or replaced): delete it and {_REOPEN}")
        if size < _TRAILER.size:
            raise FeatureStoreError(f"shard {self.path} is truncated ({size} bytes): delete it and {_REOPEN}")
        self.size = size
        magic, index_offset, rows, meta_len, crc = _TRAILER.unpack(self._pread(_TRAILER.size, size - _TRAILER.size))
        end = index_offset + rows * INDEX_DTYPE.itemsize + meta_len
        if magic != SHARD_MAGIC or end != size - _TRAILER.size:
            raise FeatureStoreError(f"shard {self.path} is truncated or not a shard (no valid trailer): delete it and "
                                    f"{_REOPEN}")
        body = self._pread(end - index_offset, index_offset)
        if zlib.crc32(body) != crc:
            raise FeatureStoreError(f"shard {self.path}: its index does not match its checksum: delete it and {_REOPEN}")
        self.index = np.frombuffer(body, dtype=INDEX_DTYPE, count=rows).copy()
        self.meta = json.loads(body[rows * INDEX_DTYPE.itemsize :])
        self.codec = CODECS[self.meta["dtype"]]
        self.width = int(self.meta["width"])
        last = self.index["offset"] + self.index["length"].astype(np.uint64) * self.codec.bytes_per_token(self.width)
        if rows and int(last.max()) > index_offset:
            raise FeatureStoreError(f"shard {self.path}: a row reaches past its data: delete it and {_REOPEN}")

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise FeatureStoreError(f"shard {self.path}: {len(data)} of {n} bytes at {offset} (truncated): delete it and "
                                    f"{_REOPEN}")
        return data

    def row_bytes(self, length: int) -> int:
        return length * self.codec.bytes_per_token(self.width)

    def advise(self, offset: int, length: int) -> None:
        """Start reading the row at ``offset`` now (asynchronous readahead of the whole row)."""
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(self._fd, offset, self.row_bytes(length), os.POSIX_FADV_WILLNEED)

    def read(self, offset: int, length: int, into: np.ndarray | None = None) -> np.ndarray:
        """The stored bytes of the row at ``offset``, read into ``into`` (a writable uint8 view of the right
        size, e.g. the caller's tensor) or a new array."""
        n = self.row_bytes(length)
        buf = np.empty(n, np.uint8) if into is None else into
        view, done = memoryview(buf).cast("B"), 0
        while done < n:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise FeatureStoreError(f"shard {self.path}: the row at {offset} ends past the file (truncated): delete "
                                        f"it and {_REOPEN}")
            done += got
        return buf

    def payload(self, offset: int, length: int) -> np.ndarray:
        return self.read(offset, length)

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


# --------------------------------------------------------------------------------------------------
# the lock


class StoreLock:
    """The store's ``flock``: exclusive for a build (one at a time), shared for hybrid writers (any number, and
    never beside a build). The kernel drops it when its process dies (no stale locks); who holds it is in
    ``.lock.owner``. Needs a filesystem with working flock (local disks; NFS v4)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fd: int | None = None

    @property
    def owner_path(self) -> Path:
        return self.root / (LOCK + ".owner")

    def owner(self) -> str:
        try:
            o = json.loads(self.owner_path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["time"]))
            return f"{o.get('what', 'a builder')} (pid {o['pid']} on {o['host']}, since {since})"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def acquire(self, *, exclusive: bool, wait_s: float = 0.0, what: str = "a build",
                on_wait: Callable[[str, float], None] | None = None, poll_s: float = 0.5) -> None:
        """Take the lock, waiting up to ``wait_s`` seconds (0: refuse at once; inf: wait for ever); raises
        FeatureStoreError naming the holder."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    os.close(fd)
                    held = self.owner()
                    raise FeatureStoreError(
                        f"feature store {self.root} is locked by {held}: one build at a time (wait for it, "
                        "pass --wait to wait, or build into another path)") from None
                if on_wait is not None:
                    on_wait(self.owner(), waited)
                time.sleep(min(poll_s, max(wait_s - waited, 0.01)))
        self._fd = fd
        if exclusive:
            note = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "what": what}
            with contextlib.suppress(OSError):
                atomic_write_text(self.owner_path, json.dumps(note), durable=False)

    def try_exclusive(self) -> bool:
        """Turn a held shared lock exclusive if nobody else holds it (without waiting)."""
        assert self._fd is not None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


# --------------------------------------------------------------------------------------------------
# reading


def _read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        text = (root / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FeatureStoreError(f"feature store {root}: cannot read {MANIFEST}: {exc.strerror or exc}") from exc
    try:
        m = json.loads(text)
    except ValueError as exc:
        raise FeatureStoreError(f"feature store {root}: {MANIFEST} is not valid JSON ({exc}): {_REOPEN}") from exc
    if m.get("format") != FORMAT:
        raise FeatureStoreError(f"{root} is not a feature store ({MANIFEST} has format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise FeatureStoreError(f"feature store {root} has version {m.get('version')!r}; this dflash-flow reads {VERSION}")
    return m


def _shard_names(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in (root / SHARDS).iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))
    except FileNotFoundError:
        return []


class FeatureStore:
    """A store opened for reading: ``row(sid)``, ``read_into(out, sid)``, ``in``, ``len``. Thread-safe.

    ``complete=True`` (offline training) wants a finished build: the manifest's shard list and merged index.
    ``complete=False`` also opens a store being built or filled by hybrid training: its shards are found by
    listing ``shards/`` (``refresh()`` looks again). Shards are opened when first read (at most
    ``max_open`` at a time). Never writes: works on a read-only filesystem."""

    def __init__(self, root: str | os.PathLike, *, complete: bool = True, max_open: int = 256):
        self.root = Path(root)
        m = _read_manifest(self.root)
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
                    f"{_REOPEN}")
            self._load_merged()
        else:
            self.refresh()

    # -- index --------------------------------------------------------------------------------------
    def _load_merged(self) -> None:
        m = self.manifest
        self._files = [s["file"] for s in m["shards"]]
        self._expect = [int(s["bytes"]) for s in m["shards"]]
        try:
            data = (self.root / INDEX).read_bytes()
        except FileNotFoundError:
            raise FeatureStoreError(f"feature store {self.root}: {INDEX} is missing: {_REOPEN}") from None
        if hashlib.blake2b(data, digest_size=20).hexdigest() != m.get("index_blake2b"):
            raise FeatureStoreError(f"feature store {self.root}: {INDEX} does not match the manifest's digest: {_REOPEN}")
        loc = np.frombuffer(data, dtype=MERGED_DTYPE).copy()
        if loc.size != int(m["samples"]):
            raise FeatureStoreError(f"feature store {self.root}: {INDEX} has {loc.size} rows, the manifest {m['samples']}")
        missing = [f for f in self._files if not (self.root / f).is_file()]
        if missing:
            raise FeatureStoreError(f"feature store {self.root}: shard(s) {', '.join(missing[:5])} missing"
                                    f"{' (and more)' if len(missing) > 5 else ''}: {_REOPEN}")
        self._sids, self._loc = loc["sid"].copy(), loc

    def refresh(self) -> int:
        """Look for shards written since (hybrid training, a build going on); returns how many were added."""
        known = set(self._files)
        new = [n for n in _shard_names(self.root) if f"{SHARDS}/{n}" not in known]
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
            part = np.zeros(len(shard.index), MERGED_DTYPE)
            for f in ("sid", "length", "offset", "crc", "tokens"):
                part[f] = shard.index[f]
            part["shard"] = k
            rows.append(part)
            added += 1
        loc = np.concatenate(rows)
        order = np.argsort(loc["sid"], kind="stable")
        loc = loc[order]
        keep = np.ones(loc.size, bool)
        keep[1:] = loc["sid"][1:] != loc["sid"][:-1]
        self.duplicates += int((~keep).sum())
        with self._lock:
            self._loc = loc[keep]
            self._sids = self._loc["sid"].copy()
        return added

    def add_shard(self, info: ShardInfo) -> None:
        """A shard this process just wrote (hybrid): readable at once."""
        self.refresh()

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

    # -- rows ---------------------------------------------------------------------------------------
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
        return shard.payload(offset, length), length, crc, tokens

    def row(self, sid: int, out_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Sample ``sid``'s features ``[L, F]`` (None when the store does not hold it)."""
        p = self.payload(sid)
        if p is None:
            return None
        payload, length, _, _ = p
        return self.codec.decode(payload, length, self.width, out_dtype or self.codec.default_out_dtype())

    def prefetch(self, sids: Iterable[int]) -> None:
        """Ask the kernel to start reading these samples' rows now (``posix_fadvise(WILLNEED)``: asynchronous),
        so a batch's rows are read side by side instead of one after another."""
        for sid in sids:
            loc = self.locate(int(sid))
            if loc is not None:
                shard, offset, length, _, _ = loc
                shard.advise(offset, length)

    def read_into(self, out: torch.Tensor, sid: int, *, tokens: int | None = None) -> bool:
        """Decode sample ``sid`` into ``out [L, F]`` (CPU); False when the store does not hold it. ``tokens``:
        the row's token digest as the batch has it; a different one raises (other data, tokenizer or
        template than the store was built from)."""
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
        c = self.codec
        if not c.scaled and out.dtype == c.torch_dtype and out.device.type == "cpu" and out.is_contiguous():
            raw = out.view(torch.int16) if c.itemsize == 2 else out
            shard.read(offset, length, into=raw.numpy().reshape(-1).view(np.uint8))  # one copy, into the batch
        else:
            c.decode_into(shard.read(offset, length), out)
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


# --------------------------------------------------------------------------------------------------
# building


class Comm(Protocol):
    """What the builder needs of a job's ranks (``app.distributed.Distributed`` is one)."""

    rank: int
    world_size: int

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def barrier(self) -> None: ...


class LocalComm:
    """One process is the whole job."""

    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


@attrs.define
class SampleIndex:
    """The samples a build covers: ids, lengths and each one's tokens (``fetch(position) -> 1-D ids``)."""

    sample_ids: np.ndarray
    lengths: np.ndarray
    fetch: Callable[[int], Any]

    def __len__(self) -> int:
        return int(len(self.sample_ids))


@attrs.define
class BuildProgress:
    """A rank's progress over its share (what the console shows: rate and ETA)."""

    samples: int
    total_samples: int
    tokens: int
    total_tokens: int
    bytes: int
    elapsed_s: float
    shards: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.tokens_per_s
        return (self.total_tokens - self.tokens) / rate if rate > 0 else None


@attrs.define
class BuildResult:
    path: Path
    samples: int  # in the store
    tokens: int
    bytes: int
    computed: int  # samples this build computed (all ranks)
    reused: int  # samples already there
    complete: bool
    estimate_bytes: int  # what the missing samples were estimated to take
    free_bytes: int
    seconds: float
    removed: list[str] = attrs.field(factory=list)  # damaged shards set aside


Compute = Callable[[list[tuple[int, Any]]], list[torch.Tensor]]


def _scan(root: Path, digest: str | None, *, remove_damaged: bool) -> tuple[list[Shard], list[str]]:
    """Every valid shard on disk (opened) and the damaged ones (removed when asked: their samples are then
    computed again)."""
    shards, damaged = [], []
    for name in _shard_names(root):
        try:
            s = Shard(root / SHARDS / name)
        except FeatureStoreError as exc:
            damaged.append(f"{SHARDS}/{name}")
            log.warning("%s", exc)
            if remove_damaged:
                (root / SHARDS / name).unlink(missing_ok=True)
            continue
        if digest and s.meta.get("identity") != digest:
            s.close()
            raise FeatureStoreError(f"shard {s.path} was written for another identity than {root}/{MANIFEST} (a "
                                    "manifest replaced by hand?): delete the store and build it again")
        shards.append(s)
    return shards, damaged


def _recorded_digests(root: Path, manifest: Mapping[str, Any] | None) -> dict[str, str]:
    """Shard digests recorded by the builders (``ranks/*.json``) and by an earlier manifest."""
    out = {}
    for s in (manifest or {}).get("shards", []):
        if s.get("blake2b"):
            out[s["file"]] = s["blake2b"]
    with contextlib.suppress(FileNotFoundError):
        for p in sorted((root / RANKS).glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                for s in json.loads(p.read_text())["shards"]:
                    if s.get("blake2b"):
                        out[s["file"]] = s["blake2b"]
    return out


def _file_blake2b(path: Path) -> str:
    h = hashlib.blake2b(digest_size=20)
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def _new_manifest(identity: Mapping[str, Any], codec: Codec, width: int, *, expected_samples: int | None,
                  expected_tokens: int | None, compute_dtype: str | None, vocab_size: int | None) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION, "identity": dict(identity), "identity_digest": identity_digest(identity),
        "dtype": codec.name, "width": int(width), "bytes_per_token": codec.bytes_per_token(width),
        "compute_dtype": compute_dtype, "vocab_size": vocab_size, "expected_samples": expected_samples,
        "expected_tokens": expected_tokens,
        "complete": False, "samples": 0, "tokens": 0, "bytes": 0, "shards": [],
        "created": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
    }


def _write_json(path: Path, obj: Any, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", durable=durable)


def open_for_writing(root: Path, *, identity: Mapping[str, Any], codec: Codec, width: int,
                     expected_samples: int | None = None, expected_tokens: int | None = None,
                     compute_dtype: str | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """The manifest of a store about to be written: created when there is none; else it must be the same
    identity, dtype and width (refused naming the fields)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / SHARDS).mkdir(exist_ok=True)
    (root / RANKS).mkdir(exist_ok=True)
    m = _read_manifest(root)
    if m is None:
        if _shard_names(root):
            raise FeatureStoreError(f"{root}/{SHARDS} holds shards but {root} has no {MANIFEST}: delete the directory "
                                    "and build again")
        m = _new_manifest(identity, codec, width, expected_samples=expected_samples, expected_tokens=expected_tokens,
                          compute_dtype=compute_dtype, vocab_size=vocab_size)
        _write_json(root / MANIFEST, m)
        fsync_dir(root)
        return m
    fields = compare_identity(m["identity"], identity)
    if m["dtype"] != codec.name:
        fields.append(("dtype", m["dtype"], codec.name))
    if int(m["width"]) != int(width):
        fields.append(("width", m["width"], width))
    if fields:
        raise StoreMismatch(root, fields)
    # Fields it did not record are recorded now (identity_digest, the shards' tie to the store, stays).
    _fill_unknown(m["identity"], identity)
    if expected_samples is not None:
        m["expected_samples"], m["expected_tokens"] = expected_samples, expected_tokens
    for key, value in (("vocab_size", vocab_size), ("compute_dtype", compute_dtype)):
        if m.get(key) is None and value is not None:
            m[key] = value
    return m


def merge_store(root: str | os.PathLike, *, expected: Iterable[int] | None = None) -> dict[str, Any]:
    """Rank 0 at the end of a build (or anyone holding the lock): every valid shard on disk into the merged
    index and the manifest, complete when every ``expected`` sample id is there (None: the manifest's
    ``expected_samples`` count). Returns the manifest."""
    root = Path(root)
    m = _read_manifest(root)
    if m is None:
        raise FeatureStoreError(f"{root} is not a feature store (no {MANIFEST})")
    shards, _ = _scan(root, m.get("identity_digest"), remove_damaged=False)
    digests = _recorded_digests(root, m)
    parts, infos = [], []
    for k, s in enumerate(shards):
        rel = f"{SHARDS}/{s.path.name}"
        part = np.zeros(len(s.index), MERGED_DTYPE)
        for f in ("sid", "length", "offset", "crc", "tokens"):
            part[f] = s.index[f]
        part["shard"] = k
        parts.append(part)
        infos.append(ShardInfo(file=rel, bytes=s.size, samples=len(s.index), tokens=int(s.index["length"].sum()),
                               ids=_ranges(s.index["sid"].tolist()), blake2b=digests.get(rel) or _file_blake2b(s.path)))
        s.close()
    loc = np.concatenate(parts) if parts else np.zeros(0, MERGED_DTYPE)
    loc = loc[np.argsort(loc["sid"], kind="stable")]
    keep = np.ones(loc.size, bool)
    keep[1:] = loc["sid"][1:] != loc["sid"][:-1]
    duplicates = int((~keep).sum())
    loc = loc[keep]
    data = loc.tobytes()
    atomic_write_bytes(root / INDEX, data)
    have = set(loc["sid"].tolist())
    if expected is not None:
        want = {int(i) for i in expected}
        complete = want <= have
        m["expected_samples"] = len(want)
    else:
        complete = m.get("expected_samples") is not None and len(have) >= int(m["expected_samples"])
    m.update({
        "shards": [i.to_json() for i in infos], "samples": int(loc.size), "tokens": int(loc["length"].sum()),
        "bytes": int(sum(i.bytes for i in infos)), "index_blake2b": hashlib.blake2b(data, digest_size=20).hexdigest(),
        "complete": bool(complete), "duplicates": duplicates,
        "merged": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
    })
    _write_json(root / MANIFEST, m)
    fsync_dir(root)
    return m


def _remove_leftovers(root: Path) -> int:
    """Temporary files of writers that died (call with the exclusive lock held)."""
    n = 0
    for d in (root / SHARDS, root / RANKS, root):
        with contextlib.suppress(FileNotFoundError):
            for p in d.iterdir():
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
                    n += 1
    return n


def _split_by_tokens(lengths: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) slices of about equal token sums."""
    if parts <= 1:
        return [(0, int(lengths.size))]
    cum = np.concatenate([[0], np.cumsum(lengths)])
    cuts = [0] + [int(np.searchsorted(cum, cum[-1] * k / parts, side="left")) for k in range(1, parts)] + [int(lengths.size)]
    cuts = np.maximum.accumulate(np.asarray(cuts))
    return [(int(cuts[k]), int(cuts[k + 1])) for k in range(parts)]


def _cut_shards(lengths: np.ndarray, bytes_per_token: int, shard_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) runs of rows of about ``shard_bytes`` each (at least one row)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        acc += int(n) * bytes_per_token
        if acc >= shard_bytes:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < lengths.size:
        out.append((start, int(lengths.size)))
    return out


def _gen_of(name: str) -> int:
    m = _BUILT_NAME.match(name)
    return int(m.group(1)) if m else -1


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists():
        p = p.parent
    return int(shutil.disk_usage(p).free)


def build_store(
    root: str | os.PathLike,
    *,
    identity: Mapping[str, Any],
    dtype: str,
    width: int,
    samples: SampleIndex,
    compute: Compute,
    comm: Comm | None = None,
    shard_bytes: int = 2**30,
    margin_bytes: int = 2**30,
    rows_per_call: int = 1,
    wait_s: float = 0.0,
    compute_dtype: str | None = None,
    vocab_size: int | None = None,
    on_estimate: Callable[[int, int, int, int], None] | None = None,
    on_wait: Callable[[str, float], None] | None = None,
    progress: Callable[[BuildProgress], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    write: Write | None = None,
) -> BuildResult:
    """Compute and write the features of every sample the store lacks; resumable, several ranks at once.

    ``identity``: what the features depend on (``compare_identity``'s fields; ``tokens`` is filled in here
    from the samples). ``compute(batch)``: ``[(sid, token ids)] -> [features [L, F]]`` (the target, through
    its backend). Every rank calls this with the same arguments and its ``comm``; rank 0 takes the lock
    (``wait_s``), checks the manifest (another identity is refused naming the field), removes damaged shards
    and dead writers' temporary files, plans what is missing over the ranks (contiguous id ranges of equal
    tokens), checks the size estimate against the free space (``on_estimate(need, free, tokens, samples)``
    first; refused when it does not fit with ``margin_bytes`` to spare) and, at the end, merges the shards
    into the manifest. An error on any rank ends the build on all of them, the finished shards kept.
    """
    comm = comm or LocalComm()
    root = Path(root)
    c = CODECS[dtype]
    t0 = time.monotonic()
    lock = StoreLock(root)
    ids = np.asarray(samples.sample_ids, dtype=np.int64)
    lengths = np.asarray(samples.lengths, dtype=np.int64)
    if np.unique(ids).size != ids.size:
        raise FeatureStoreError("the samples to store have duplicate ids")
    plan: dict[str, Any] | str
    digests: np.ndarray | None = None
    if comm.rank == 0:
        try:
            lock.acquire(exclusive=True, wait_s=wait_s, what="dflash-flow features build", on_wait=on_wait)
            digests = np.fromiter((token_digest(samples.fetch(i)) for i in range(len(ids))), dtype=np.uint64,
                                  count=len(ids))
            full_identity = {**identity, "tokens": corpus_digest(ids, lengths, digests)}
            m = open_for_writing(root, identity=full_identity, codec=c, width=width, expected_samples=int(ids.size),
                                 expected_tokens=int(lengths.sum()), compute_dtype=compute_dtype,
                                 vocab_size=vocab_size)
            _write_json(root / MANIFEST, m)
            _remove_leftovers(root)
            shards, removed = _scan(root, m["identity_digest"], remove_damaged=True)
            listed = {s["file"] for s in m.get("shards", [])}
            on_disk = {f"{SHARDS}/{s.path.name}" for s in shards} | set(removed)
            gone = sorted(listed - on_disk)
            for name in gone:
                log.warning("shard %s of %s is missing: its samples are computed again", name, root)
            pos = {int(s): i for i, s in enumerate(ids.tolist())}
            done: set[int] = set()
            for s in shards:
                for sid, toks in zip(s.index["sid"].tolist(), s.index["tokens"].tolist(), strict=True):
                    if sid not in pos or int(digests[pos[sid]]) != toks:
                        name = s.path
                        s.close()
                        raise StoreMismatch(root, [("tokens", f"sample {sid} in {name.name}", "not this pipeline's")])
                    done.add(sid)
                s.close()
            todo = np.asarray(sorted(set(pos) - done), dtype=np.int64)
            todo_len = lengths[[pos[int(s)] for s in todo]] if todo.size else np.zeros(0, np.int64)
            need = estimate_bytes(int(todo_len.sum()), int(todo.size), width, dtype)
            free = free_bytes(root)
            if on_estimate is not None:
                on_estimate(need, free, int(todo_len.sum()), int(todo.size))
            if todo.size and need + margin_bytes > free:
                raise FeatureStoreError(
                    f"feature store {root} needs {_gb(need)} for {todo.size:,} samples ({int(todo_len.sum()):,} tokens x "
                    f"{c.bytes_per_token(width):,} bytes per token, {dtype}) but its filesystem has {_gb(free)} free "
                    f"({_gb(margin_bytes)} kept free): free space, use fp8/bf16, or build elsewhere")
            gens = [_gen_of(n) for n in _shard_names(root)]
            plan = {"gen": max(gens, default=-1) + 1, "todo": todo.tolist(), "need": need, "free": free,
                    "removed": removed + gone, "identity_digest": m["identity_digest"]}
        except BaseException as exc:
            lock.release()
            plan = f"{exc}" if isinstance(exc, FeatureStoreError | OSError) else f"{type(exc).__name__}: {exc}"
            comm.all_gather_object(plan)
            raise
    plan = comm.all_gather_object(None if comm.rank else plan)[0]
    if isinstance(plan, str):
        if comm.rank == 0:
            raise FeatureStoreError(plan)
        raise FeatureStoreError(f"rank 0 refused the build: {plan}")
    try:
        return _build_share(root, plan, c, width, ids, lengths, samples, compute, comm, shard_bytes, rows_per_call,
                            progress, should_stop, write, t0)
    finally:
        lock.release()


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _build_share(root, plan, c, width, ids, lengths, samples, compute, comm, shard_bytes, rows_per_call, progress,
                 should_stop, write, t0) -> BuildResult:
    todo = np.asarray(plan["todo"], dtype=np.int64)
    pos = {int(s): i for i, s in enumerate(ids.tolist())}
    todo_pos = np.asarray([pos[int(s)] for s in todo], dtype=np.int64)
    todo_len = lengths[todo_pos] if todo.size else np.zeros(0, np.int64)
    start, end = _split_by_tokens(todo_len, comm.world_size)[comm.rank]
    mine, mine_len = todo_pos[start:end], todo_len[start:end]
    gen, rank = int(plan["gen"]), comm.rank
    record_path = root / RANKS / f"g{gen:04d}-r{rank:05d}.json"
    record: dict[str, Any] = {"gen": gen, "rank": rank, "world_size": comm.world_size, "shards": []}
    state = BuildProgress(0, int(mine.size), 0, int(mine_len.sum()), 0, 0.0, 0)
    meta = {"identity": plan["identity_digest"], "gen": gen, "rank": rank}
    error: str | None = None
    failure: BaseException | None = None
    try:
        for k, (a, b) in enumerate(_cut_shards(mine_len, c.bytes_per_token(width), shard_bytes)):
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt("stop requested")
            name = f"g{gen:04d}-r{rank:05d}-{k:06d}{SUFFIX}"
            with ShardWriter(root / SHARDS / name, codec=c, width=width, meta=meta, write=write) as w:
                for lo in range(a, b, rows_per_call):
                    batch = [(int(ids[p]), samples.fetch(int(p))) for p in mine[lo : min(lo + rows_per_call, b)]]
                    rows = compute(batch)
                    for (sid, toks), row in zip(batch, rows, strict=True):
                        if tuple(row.shape) != (len(toks), width):
                            raise FeatureStoreError(f"sample {sid}: features of shape {tuple(row.shape)}, expected "
                                                    f"({len(toks)}, {width})")
                        w.add(sid, token_digest(toks), c.encode(row))
                    state.samples += len(batch)
                    state.tokens += sum(len(t) for _, t in batch)
                    state.elapsed_s = time.monotonic() - t0
                    if progress is not None:
                        progress(state)
                info = w.close()
            record["shards"].append(info.to_json())
            _write_json(record_path, record, durable=False)
            state.bytes += info.bytes
            state.shards += 1
            if progress is not None:
                progress(state)
    except BaseException as exc:  # every rank still meets the others below: none waits in vain
        error, failure = _describe(exc, root, state), exc
    errors = comm.all_gather_object(error)
    failed = [(f"rank {r}: {e}" if comm.world_size > 1 else e) for r, e in enumerate(errors) if e]
    m = None
    if rank == 0:
        m = _merge_quietly(root, ids.tolist()) if failed else merge_store(root, expected=ids.tolist())
    comm.barrier()
    if failure is not None and not isinstance(failure, OSError | FeatureStoreError | KeyboardInterrupt):
        raise failure  # a bug: its own traceback
    if isinstance(failure, KeyboardInterrupt):
        raise KeyboardInterrupt(error)
    if failed:
        raise FeatureStoreError("; ".join(failed)) from failure
    m = m or _read_manifest(root) or {}
    computed = sum(comm.all_gather_object(state.samples))
    return BuildResult(path=root, samples=int(m.get("samples", 0)), tokens=int(m.get("tokens", 0)),
                       bytes=int(m.get("bytes", 0)), computed=computed, reused=len(ids) - len(todo),
                       complete=bool(m.get("complete")), estimate_bytes=int(plan["need"]), free_bytes=int(plan["free"]),
                       seconds=time.monotonic() - t0, removed=list(plan["removed"]))


def _describe(exc: BaseException, root: Path, state: BuildProgress) -> str:
    kept = f"{state.shards} shard(s) of this rank ({state.bytes / 1e6:,.1f} MB) finished and kept"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk of feature store {root} is full ({exc.strerror}): {kept}; free space and run `dflash-flow "
                "features build PIPELINE` again to resume")
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted: {kept}; run `dflash-flow features build PIPELINE` again to resume"
    return f"{type(exc).__name__}: {exc} ({kept})"


def _merge_quietly(root: Path, expected: list[int] | None = None) -> dict[str, Any] | None:
    try:
        return merge_store(root, expected=expected)
    except Exception as exc:  # noqa: BLE001 - the build's own error is the one to report
        log.warning("could not record the finished shards of %s in its manifest (%s); the next build finds them", root, exc)
        return None


# --------------------------------------------------------------------------------------------------
# appending (hybrid training)


class StoreAppender:
    """Rows appended as they are computed (hybrid training's first epoch), written as shards of about
    ``shard_bytes``; the rows of the shard being written stay readable (``pending``) until it is on disk.
    Shard names carry host, pid and a random token: any number of processes append to one store without
    coordinating (each holds the shared lock; a build's exclusive lock keeps builds out). Thread-safe."""

    def __init__(self, root: Path, *, codec: Codec, width: int, identity_digest: str, shard_bytes: int,
                 write: Write | None = None, on_shard: Callable[[ShardInfo], None] | None = None):
        self.root = Path(root)
        self.codec = codec
        self.width = width
        self.shard_bytes = int(shard_bytes)
        self._meta = {"identity": identity_digest, "writer": "hybrid"}
        self._write = write
        self._on_shard = on_shard
        host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"
        self._stem = f"h-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._k = 0
        self._writer: ShardWriter | None = None
        self.pending: dict[int, tuple[np.ndarray, int]] = {}
        self._lock = threading.Lock()
        self.shards: list[ShardInfo] = []
        self.rows = 0

    def append(self, sid: int, tokens: int, payload: np.ndarray) -> None:
        with self._lock:
            if sid in self.pending:
                return
            if self._writer is None:
                self._writer = ShardWriter(self.root / SHARDS / f"{self._stem}-{self._k:06d}{SUFFIX}", codec=self.codec,
                                           width=self.width, meta=self._meta, write=self._write)
                self._k += 1
            try:
                self._writer.add(sid, tokens, payload)
            except BaseException as exc:
                self._writer.abort(exc)
                self._writer = None
                self.pending.clear()
                raise
            self.pending[sid] = (payload, tokens)
            self.rows += 1
            if self._writer.bytes >= self.shard_bytes:
                self._flush_locked()

    def flush(self) -> ShardInfo | None:
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> ShardInfo | None:
        w, self._writer = self._writer, None
        if w is None:
            return None
        try:
            info = w.close()
        finally:
            self.pending.clear()
        self.shards.append(info)
        if self._on_shard is not None:
            self._on_shard(info)
        return info

    def close(self) -> None:
        self.flush()
