"""One shard file: written (``ShardWriter``; ``StoreAppender`` for hybrid training's rows as they come) and
read (``Shard``: trailer, index and meta checked, rows read with ``pread``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import threading
import uuid
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from dflash_flow.model.feature_store.format import (
    CODECS,
    INDEX_DTYPE,
    REOPEN,
    SHARD_MAGIC,
    SHARDS,
    SUFFIX,
    TRAILER,
    Codec,
    FeatureStoreError,
    id_ranges,
    padded,
)
from dflash_flow.util import atomic_path


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
        pad = padded(self._pos) - self._pos
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

    def close(self) -> ShardInfo:
        """Complete the shard (index, meta, trailer), fsync and rename it into place; on any error (a full
        disk) the temporary file is removed and the error raised."""
        index = np.array(self._rows, dtype=INDEX_DTYPE)
        meta = json.dumps(self.meta, sort_keys=True).encode()
        try:
            pad = padded(self._pos) - self._pos
            if pad:
                self._emit(bytes(pad))
            index_offset = self._pos
            body = index.tobytes() + meta
            self._emit(body)
            self._emit(TRAILER.pack(SHARD_MAGIC, index_offset, len(index), len(meta), zlib.crc32(body)))
            self._f.flush()
            self._f.close()
        except BaseException as exc:
            self.abort(exc)
            raise
        self._cm.__exit__(None, None, None)  # fsync, rename onto the final name (or remove it, and raise)
        return ShardInfo(file=f"{SHARDS}/{self.path.name}", bytes=self._pos, samples=len(index), tokens=self.tokens,
                         ids=id_ranges(index["sid"].tolist()), blake2b=self._hash.hexdigest())

    def abort(self, exc: BaseException | None = None) -> None:
        with contextlib.suppress(OSError):
            self._f.close()
        err = exc or RuntimeError("aborted")
        self._cm.__exit__(type(err), err, err.__traceback__)  # removes the temporary file


class Shard:
    """One shard file, opened read-only; its trailer, index and meta checked. Rows are read with ``pread``
    straight into the caller's buffer, announced with ``posix_fadvise(WILLNEED)`` (:meth:`advise`)."""

    def __init__(self, path: Path, *, expect_bytes: int | None = None):
        self.path = Path(path)
        try:
            self._fd: int | None = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise FeatureStoreError(f"shard {self.path} is missing: {REOPEN}") from None
        try:
            self._check(expect_bytes)
        except BaseException:
            self.close()
            raise

    def _check(self, expect_bytes: int | None) -> None:
        size = os.fstat(self._fd).st_size
        if expect_bytes is not None and size != expect_bytes:
            raise FeatureStoreError(f"shard {self.path} has {size} bytes, the manifest says {expect_bytes} (truncated "
                                    f"or replaced): delete it and {REOPEN}")
        if size < TRAILER.size:
            raise FeatureStoreError(f"shard {self.path} is truncated ({size} bytes): delete it and {REOPEN}")
        self.size = size
        magic, index_offset, rows, meta_len, crc = TRAILER.unpack(self._pread(TRAILER.size, size - TRAILER.size))
        end = index_offset + rows * INDEX_DTYPE.itemsize + meta_len
        if magic != SHARD_MAGIC or end != size - TRAILER.size:
            raise FeatureStoreError(f"shard {self.path} is truncated or not a shard (no valid trailer): delete it and "
                                    f"{REOPEN}")
        body = self._pread(end - index_offset, index_offset)
        if zlib.crc32(body) != crc:
            raise FeatureStoreError(f"shard {self.path}: its index does not match its checksum: delete it and {REOPEN}")
        self.index = np.frombuffer(body, dtype=INDEX_DTYPE, count=rows).copy()
        self.meta = json.loads(body[rows * INDEX_DTYPE.itemsize :])
        self.codec = CODECS[self.meta["dtype"]]
        self.width = int(self.meta["width"])
        last = self.index["offset"] + self.index["length"].astype(np.uint64) * self.codec.bytes_per_token(self.width)
        if rows and int(last.max()) > index_offset:
            raise FeatureStoreError(f"shard {self.path}: a row reaches past its data: delete it and {REOPEN}")

    def _pread(self, n: int, offset: int) -> bytes:
        data = os.pread(self._fd, n, offset)
        if len(data) != n:
            raise FeatureStoreError(f"shard {self.path}: {len(data)} of {n} bytes at {offset} (truncated): delete it and "
                                    f"{REOPEN}")
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
                                        f"it and {REOPEN}")
            done += got
        return buf

    def close(self) -> None:
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class StoreAppender:
    """Rows appended as they are computed (hybrid training's first epoch), written as shards of about
    ``shard_bytes``; the rows of the shard being written stay readable (``pending``) until it is on disk.
    Shard names carry host, pid and a random token: any number of processes append to one store without
    coordinating (each holds the shared lock; a build's exclusive lock keeps builds out). Thread-safe."""

    def __init__(self, root: Path, *, codec: Codec, width: int, identity_digest: str, shard_bytes: int,
                 on_shard: Callable[[ShardInfo], None] | None = None):
        self.root = Path(root)
        self.codec = codec
        self.width = width
        self.shard_bytes = int(shard_bytes)
        self._meta = {"identity": identity_digest, "writer": "hybrid"}
        self._on_shard = on_shard
        host = re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:24] or "host"
        self._stem = f"h-{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._k = 0
        self._writer: ShardWriter | None = None
        self.pending: dict[int, tuple[np.ndarray, int]] = {}
        self._lock = threading.Lock()

    def append(self, sid: int, tokens: int, payload: np.ndarray) -> None:
        with self._lock:
            if sid in self.pending:
                return
            if self._writer is None:
                self._writer = ShardWriter(self.root / SHARDS / f"{self._stem}-{self._k:06d}{SUFFIX}", codec=self.codec,
                                           width=self.width, meta=self._meta)
                self._k += 1
            try:
                self._writer.add(sid, tokens, payload)
            except BaseException as exc:
                self._writer.abort(exc)
                self._writer = None
                self.pending.clear()
                raise
            self.pending[sid] = (payload, tokens)
            if self._writer.bytes >= self.shard_bytes:
                self._flush_locked()

    def _flush_locked(self) -> None:
        w, self._writer = self._writer, None
        if w is None:
            return
        try:
            info = w.close()
        finally:
            self.pending.clear()
        if self._on_shard is not None:
            self._on_shard(info)

    def close(self) -> None:
        with self._lock:
            self._flush_locked()
