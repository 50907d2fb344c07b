"""The store's format: file names, errors, codecs, the token digest, and one shard file written
(``ShardWriter``, ``StoreAppender``) and read (``Shard``: trailer, index and meta checked, rows read with
``pread``)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import struct
import threading
import uuid
import zlib
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from dflash_flow.core.errors import DflashFlowError
from dflash_flow.util import atomic_path

FORMAT = "dflash-flow-feature-store"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.bin"
SHARDS = "shards"
RANKS = "ranks"
LOCK = ".lock"
SUFFIX = ".dfs"
SHARD_MAGIC = b"DFFEAT01"
TRAILER = struct.Struct("<8sQQII")  # magic, index offset, rows, meta length, crc32(index + meta)
ALIGN = 64
#: One row of a shard's index (and of the merged index, with the shard's number in ``shard``).
INDEX_DTYPE = np.dtype([("sid", "<i8"), ("offset", "<u8"), ("length", "<u4"), ("crc", "<u4"), ("tokens", "<u8")])
MERGED_DTYPE = np.dtype([("sid", "<i8"), ("shard", "<u4"), ("length", "<u4"), ("offset", "<u8"), ("crc", "<u4"),
                         ("pad", "<u4"), ("tokens", "<u8")])


FP8_MAX = 448.0  # the largest finite e4m3fn value
REOPEN = "run `dflash-flow features build PIPELINE` again: it computes only the missing samples"


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

    def direct(self, out: torch.Tensor) -> np.ndarray | None:
        """``out``'s bytes (writable uint8) when a stored row can be copied straight into it; else None."""
        if self.scaled or out.dtype != self.torch_dtype or out.device.type != "cpu" or not out.is_contiguous():
            return None
        return (out.view(torch.int16) if self.itemsize == 2 else out).numpy().reshape(-1).view(np.uint8)

    def decode_into(self, payload: np.ndarray, out: torch.Tensor) -> None:
        """Decode into ``out [L, F]`` (a CPU tensor): one copy when ``out`` has the storage dtype."""
        raw = self.direct(out)
        if raw is not None:
            np.copyto(raw, payload[: raw.size])
        else:
            out.copy_(self.decode(payload, out.shape[0], out.shape[1], out.dtype))

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


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def estimate_bytes(tokens: int, samples: int, width: int, dtype: str) -> int:
    """Disk bytes of ``samples`` rows of ``tokens`` tokens in all (rows, alignment, index entries)."""
    c = CODECS[dtype]
    return tokens * c.bytes_per_token(width) + samples * (ALIGN // 2 + 2 * INDEX_DTYPE.itemsize)


def id_ranges(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as ``[start, end)`` ranges."""
    out: list[list[int]] = []
    for i in sorted(int(x) for x in ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        elif not out or out[-1][1] < i:
            out.append([i, i + 1])
    return out


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


class ShardWriter:
    """Writes one shard: rows into a temporary file that ``close`` completes and renames into place, ``abort``
    removes. ``write(f, bytes)``: the one call that writes (tests inject a full disk)."""

    def __init__(self, path: Path, *, codec: Codec, width: int, meta: Mapping[str, Any], write: Write | None = None):
        self.path = Path(path)
        self.codec = codec
        self.width = int(width)
        self.meta = {**meta, "dtype": codec.name, "width": self.width}
        self._write = write or (lambda f, data: f.write(data))
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
        """Complete the shard (index, meta, trailer) and rename it into place; on an error, remove it."""
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
    """One shard file, opened read-only, its trailer, index and meta checked; rows read with ``pread``."""

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
        """The stored bytes of the row at ``offset``, read into ``into`` (writable uint8) or a new array."""
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
    """Rows appended as they are computed (hybrid training), as shards of about ``shard_bytes``, readable
    (``pending``) until on disk. Names carry host, pid and a random token: many processes may append."""

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
