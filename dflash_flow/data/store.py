"""The token store: tokenized files as memory-mapped arrays in a shared cache, one entry per `cache_key`,
built in a private directory and published by one ``rename`` by the holder of ``.<name>.lock`` (the others
wait); opening checks its digests (unless stamped checked); a damaged entry is moved aside and rebuilt."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from dflash_flow.util import atomic_write_text, blake2b_file, cache_root, fsync_dir, sha256_file

from .formats import data_files_of
from .reports import ReadOptions

__all__ = ["ARRAYS", "CACHE_VERSION", "EntryWriter", "StoreError", "cache_key", "entry_lock", "file_sha256",
           "open_entry", "read_progress", "tokenizer_fingerprint", "write_progress"]

log = logging.getLogger(__name__)

STORE_VERSION = 1
#: name -> dtype of the arrays of an entry (little-endian on disk).
ARRAYS: dict[str, np.dtype] = {"ids": np.dtype("<i4"), "mask": np.dtype("u1"), "offsets": np.dtype("<i8"),
                               "lines": np.dtype("<i8")}
_FILES = {name: f"{name}.{dt.kind}{dt.itemsize * 8}" for name, dt in ARRAYS.items()}
_REPORT = "report.json"
MANIFEST = "manifest.json"
_STAMP = "verified.json"


class StoreError(RuntimeError):
    """A cache entry that cannot be used (the caller rebuilds it)."""


def _digest(data: bytes | memoryview = b"") -> Any:
    return hashlib.blake2b(data, digest_size=20)


def _stat_sig(path: Path) -> list[int]:
    st = os.stat(path)
    return [st.st_size, st.st_ino, st.st_dev, st.st_mtime_ns, st.st_ctime_ns]


class EntryWriter:
    """Writes one entry into a temporary directory chunk by chunk, then publishes it with a rename."""

    def __init__(self, final: Path):
        self.final = final
        self.tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.tmp.mkdir(parents=True)
        self._ids = open(self.tmp / _FILES["ids"], "wb")  # noqa: SIM115 - closed in finish/abort
        self._mask = open(self.tmp / _FILES["mask"], "wb")  # noqa: SIM115
        self._h = {"ids": _digest(), "mask": _digest()}
        self._lengths: list[np.ndarray] = []
        self._lines: list[np.ndarray] = []

    def append(self, ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, lines: np.ndarray) -> None:
        ids = np.ascontiguousarray(ids, dtype=ARRAYS["ids"])
        mask = np.ascontiguousarray(mask, dtype=ARRAYS["mask"])
        if ids.size != mask.size or int(np.asarray(lengths).sum()) != ids.size or len(lengths) != len(lines):
            raise ValueError("inconsistent chunk: ids, mask, lengths and lines disagree")
        for f, name, arr in ((self._ids, "ids", ids), (self._mask, "mask", mask)):
            buf = memoryview(arr).cast("B")
            f.write(buf)
            self._h[name].update(buf)
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._lines.append(np.asarray(lines, dtype=np.int64))

    def finish(self, report: dict[str, Any], meta: dict[str, Any]) -> Path:
        """Write the small arrays, report and manifest, fsynced, and rename into place; the published directory
        (another process's, when it published first)."""
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int64)
        offsets = np.zeros(lengths.size + 1, dtype=ARRAYS["offsets"])
        np.cumsum(lengths, out=offsets[1:])
        lines = (np.concatenate(self._lines) if self._lines else np.zeros(0, np.int64)).astype(ARRAYS["lines"])
        digests = {}
        for name, f in (("ids", self._ids), ("mask", self._mask)):
            f.flush()
            os.fsync(f.fileno())
            f.close()
            digests[name] = self._h[name].hexdigest()
        for name, arr in (("offsets", offsets), ("lines", lines)):
            data = memoryview(np.ascontiguousarray(arr)).cast("B")
            _write_synced(self.tmp / _FILES[name], data)
            digests[name] = _digest(data).hexdigest()
        report_bytes = json.dumps(report, sort_keys=True).encode()
        _write_synced(self.tmp / _REPORT, report_bytes)
        files = {name: {"file": _FILES[name], "bytes": (self.tmp / _FILES[name]).stat().st_size,
                        "blake2b": digests[name]} for name in ARRAYS}
        manifest = {"version": STORE_VERSION, "samples": int(lines.size), "tokens": int(offsets[-1]), "files": files,
                    "report_blake2b": _digest(report_bytes).hexdigest(), "meta": meta,
                    "built": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}}
        _write_synced(self.tmp / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
        _write_stamp(self.tmp)
        fsync_dir(self.tmp)
        try:
            os.rename(self.tmp, self.final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Someone published this entry first (no working lock): theirs is as good as ours.
            shutil.rmtree(self.tmp, ignore_errors=True)
        fsync_dir(self.final.parent)
        return self.final

    def abort(self) -> None:
        for f in (self._ids, self._mask):
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def _write_synced(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_stamp(entry: Path) -> None:
    """Record the files' identity after a check or build: while it holds, opening skips hashing the arrays."""
    stamp = {name: _stat_sig(entry / _FILES[name]) for name in ARRAYS}
    with contextlib.suppress(OSError):  # a read-only cache still works; it is checked in full each time
        atomic_write_text(entry / _STAMP, json.dumps(stamp), durable=False)


def _stamp_holds(entry: Path) -> bool:
    try:
        stamp = json.loads((entry / _STAMP).read_text())
        return all(stamp.get(name) == _stat_sig(entry / _FILES[name]) for name in ARRAYS)
    except (OSError, ValueError, AttributeError):
        return False


def open_entry(entry: Path) -> tuple[dict[str, np.ndarray], dict[str, Any], dict[str, Any]]:
    """(arrays, report, manifest meta) of a published entry; `StoreError` when it is damaged."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        if manifest.get("version") != STORE_VERSION:
            raise StoreError(f"store version {manifest.get('version')!r}, expected {STORE_VERSION}")
        files = manifest["files"]
        report_bytes = (entry / _REPORT).read_bytes()
        if _digest(report_bytes).hexdigest() != manifest["report_blake2b"]:
            raise StoreError("report does not match its digest")
        report = json.loads(report_bytes)
        n, tokens = int(manifest["samples"]), int(manifest["tokens"])
        counts = {"ids": tokens, "mask": tokens, "offsets": n + 1, "lines": n}
        for name, dt in ARRAYS.items():
            size = (entry / files[name]["file"]).stat().st_size
            if size != files[name]["bytes"] or size != counts[name] * dt.itemsize:
                raise StoreError(f"{files[name]['file']} has {size} bytes, expected {counts[name] * dt.itemsize}")
        if not _stamp_holds(entry):
            for name in ARRAYS:
                if blake2b_file(entry / files[name]["file"]) != files[name]["blake2b"]:
                    raise StoreError(f"{files[name]['file']} does not match its digest")
            _write_stamp(entry)
        arrays = {name: np.memmap(entry / files[name]["file"], dtype=dt, mode="r", shape=(counts[name],))
                  if counts[name] else np.zeros(0, dtype=dt) for name, dt in ARRAYS.items()}
        off = arrays["offsets"]
        if off[0] != 0 or off[-1] != tokens or (n and bool((np.diff(off) < 0).any())):
            raise StoreError("offsets are not a valid index of the ids")
        return arrays, report, manifest.get("meta", {})
    except StoreError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise StoreError(f"{type(exc).__name__}: {exc}") from exc


def discard_entry(entry: Path, why: str) -> None:
    """Move a damaged entry out of the way (atomically) and delete it."""
    log.warning("cache entry %s is damaged (%s): rebuilding it", entry, why)
    trash = entry.parent / f".{entry.name}.trash-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _progress_path(cache_dir: Path, name: str) -> Path:
    return cache_dir / f".{name}.progress"


def write_progress(cache_dir: Path, name: str, progress: dict[str, Any]) -> None:
    note = {**progress, "pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    with contextlib.suppress(OSError):  # a progress note lost in a crash costs nothing: not fsynced
        atomic_write_text(_progress_path(cache_dir, name), json.dumps(note), durable=False)


def read_progress(cache_dir: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads(_progress_path(cache_dir, name).read_text())
    except (OSError, ValueError):
        return None


@contextlib.contextmanager
def entry_lock(cache_dir: Path, name: str, *, ready: Callable[[], bool],
               on_wait: Callable[[dict[str, Any] | None, float], None] | None = None,
               poll_s: float = 0.2) -> Iterator[bool]:
    """Yields True with entry ``name``'s build lock held (the caller checks again for the entry), or False
    once ``ready()`` holds; ``on_wait(progress, waited_s)`` runs at every poll (it may raise to give up)."""
    if ready():
        yield False
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(cache_dir / f".{name}.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if ready():
                    yield False
                    return
                if on_wait is not None:
                    on_wait(read_progress(cache_dir, name), time.monotonic() - start)
                time.sleep(poll_s)
        try:
            for p in cache_dir.glob(f".{name}.*"):  # temporary and trash directories of dead builders
                if p.is_dir() and (".tmp-" in p.name or ".trash-" in p.name):
                    shutil.rmtree(p, ignore_errors=True)
            yield True
        finally:
            with contextlib.suppress(OSError):
                _progress_path(cache_dir, name).unlink()
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)

#: Bump when what an entry holds changes for the same inputs (3: the memory-mapped store).
CACHE_VERSION = 3

_LOCK = threading.Lock()
_MEMO: dict[tuple, str] = {}


def _file_digest(path: str) -> str:
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    with _LOCK:
        hit = _MEMO.get(key)
    if hit is not None:
        return hit
    memo = cache_root() / "digests" / (hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest() + ".sha256")
    try:
        hit = memo.read_text().strip()
    except (OSError, ValueError):
        hit = ""
    if len(hit) != 64:
        hit = sha256_file(real)
        with contextlib.suppress(OSError):  # a read-only cache: hash again next time
            memo.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(memo, hit)
    with _LOCK:
        _MEMO[key] = hit
    return hit


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a data file's content (a datasets directory: of its Arrow files, in order), computed
    once per version of the file: the cache key and the resume check of the application share it."""
    p = Path(path)
    if not p.is_dir():
        return _file_digest(str(p))
    h = hashlib.sha256()
    for f in data_files_of(p):
        h.update(f"{f.name}\0{_file_digest(str(f))}\n".encode())
    return h.hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """Identity of a tokenizer's behaviour (vocab, merges, normalizers, specials), not of its name."""
    h = hashlib.blake2b(digest_size=16)
    h.update(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    h.update(str(bool(getattr(tokenizer, "split_special_tokens", False))).encode())
    return h.hexdigest()


def cache_key(path: Path, kind: str, options: ReadOptions, tokenizer: Any, template: str | None) -> str:
    parts = {"version": CACHE_VERSION, "kind": kind, "file": file_sha256(path), "max_length": options.max_length,
             "overflow": options.overflow, "on_bad_record": options.on_bad_record,
             "min_loss_tokens": options.min_loss_tokens, "max_record_bytes": options.max_record_bytes,
             "vocab_size": options.vocab_size, "template": template, "template_kwargs": options.template_kwargs,
             "tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None}
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()
