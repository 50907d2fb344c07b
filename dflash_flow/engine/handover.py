"""The feature files between a vLLM server and the trainer: one safetensors file per request in the layout
vLLM's ``load_hidden_states`` reads (``token_ids [S]`` int64, ``hidden_states [S, n_layers, H]``). On tmpfs
(the default) they are shared memory: the reader maps the writer's pages and copies them once, into the batch.
A file is written under a temporary name and renamed (a failed write leaves ``<file>.error``). Torch and
safetensors are imported inside the functions: vLLM's processes import this module.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from dflash_flow.util import atomic_path

__all__ = ["FeatureFile", "FeatureWriter", "HandoverError", "feature_file_name", "open_features", "wait_for_file"]

SUFFIX = ".safetensors"
ERROR_SUFFIX = ".error"
# safetensors dtype names -> torch dtype attribute names
DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "I64": "int64",
          "I32": "int32", "F8_E4M3": "float8_e4m3fn"}
ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "F8_E4M3": 1}
MAX_HEADER = 1 << 20  # a header of ours is ~200 bytes; refuse a huge one instead of parsing it
_SAFE = re.compile(r"[^A-Za-z0-9._-]")


class HandoverError(Exception):
    """A feature file that is missing, unreadable or not what the connector writes."""


def feature_file_name(req_id: str) -> str:
    """The file name of a request's features (its id made safe: it never picks a directory)."""
    name = _SAFE.sub("_", req_id).lstrip(".") or "request"
    return name[:200] + SUFFIX


def gather_rows(cache: Any, block_ids: list[int], block_size: int, n_tokens: int) -> Any:
    """A request's first ``n_tokens`` rows out of a cache ``[num_blocks, n_layers, block_size, H]``."""
    import torch

    blocks = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    slots = (blocks[:, None] * block_size + torch.arange(block_size, device=cache.device)[None, :]).reshape(-1)
    slots = slots[:n_tokens]
    return cache[slots // block_size, :, slots % block_size]


class FeatureWriter:
    """Writes one file per request under ``directory``; ``threads``: 0 writes in the caller, more: a pool writes
    (the caller only queues the device-to-host copy). Uncollected files are swept after ``orphan_age_s``."""

    def __init__(self, directory: str | os.PathLike, *, threads: int = 0, orphan_age_s: float = 900.0,
                 log: Any = None):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.threads = threads
        self.orphan_age_s = orphan_age_s
        self.log = log
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="dflash-features") if threads else None
        self._swept = time.monotonic()
        self._lock = threading.Lock()

    def submit(self, path: str, hidden: Any, token_ids: list[int]) -> None:
        """Write ``hidden [S, n, H]`` (on any device) and ``token_ids`` to ``path``."""
        import torch

        event = None
        if hidden.device.type == "cuda":
            host = torch.empty(hidden.shape, dtype=hidden.dtype, pin_memory=True)
            host.copy_(hidden, non_blocking=True)  # on the current stream: after the cache writes, before reuse
            event = torch.cuda.Event()
            event.record()
        else:
            host = hidden if hidden.is_contiguous() else hidden.contiguous()
        ids = torch.tensor(token_ids, dtype=torch.int64)
        if self._pool is None:
            self._write(path, host, ids, event)
        else:
            self._pool.submit(self._write, path, host, ids, event)
        self._maybe_sweep()

    def _write(self, path: str, host: Any, ids: Any, event: Any) -> None:
        try:
            from safetensors.torch import save_file

            if event is not None:
                event.synchronize()
            with atomic_path(path, durable=False) as tmp:  # tmpfs or a shared FS: a crash loses nothing of value
                save_file({"hidden_states": host, "token_ids": ids}, str(tmp))
        except BaseException as e:  # the client must hear of it, not wait out its timeout
            with contextlib.suppress(OSError):
                Path(path + ERROR_SUFFIX).write_text(f"{type(e).__name__}: {e}"[:2000])
            if self.log is not None:
                self.log(f"writing {path} failed: {type(e).__name__}: {e}")
            if not isinstance(e, Exception):
                raise

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._swept < min(60.0, self.orphan_age_s):
                return
            self._swept = now
        sweep_orphans(self.directory, self.orphan_age_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def sweep_orphans(directory: str | os.PathLike, age_s: float) -> int:
    """Remove feature files (and temporaries, error notes) older than ``age_s``: on tmpfs they are memory."""
    cutoff = time.time() - age_s
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return 0
    for e in entries:
        if not (e.name.endswith(SUFFIX) or e.name.endswith(ERROR_SUFFIX) or e.name.endswith(".tmp")):
            continue
        with contextlib.suppress(OSError):
            if e.is_file(follow_symlinks=False) and e.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(e.path)
                removed += 1
    return removed


def wait_for_file(path: str, timeout_s: float, stop: threading.Event | None = None) -> None:
    """Return once ``path`` exists; HandoverError when the writer left ``<path>.error`` or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    delay = 0.0005
    while True:
        if os.path.exists(path):
            return
        err = path + ERROR_SUFFIX
        if os.path.exists(err):
            try:
                why = Path(err).read_text()[:500]
                os.unlink(err)
            except OSError:
                why = "(unreadable)"
            raise HandoverError(f"the server failed to write {path}: {why}")
        if time.monotonic() >= deadline:
            raise HandoverError(f"{path} did not appear within {timeout_s:g} s (is the client's features_dir the "
                                "server's shared_storage_path, on a file system both see?)")
        if stop is None:
            time.sleep(delay)
        elif stop.wait(delay):
            raise HandoverError("stopped")
        delay = min(delay * 2, 0.02)


class FeatureFile:
    """One mapped feature file: ``hidden_states`` and ``token_ids`` as tensors over the mapping (no copy)."""

    def __init__(self, path: str, mm: mmap.mmap, header: dict, base: int):
        self.path = path
        self._mm = mm
        self.header = header
        self._base = base
        self.hidden_states = self._tensor("hidden_states")
        self.token_ids = self._tensor("token_ids")

    def _tensor(self, name: str):
        import torch

        entry = self.header[name]
        begin, end = entry["data_offsets"]
        dtype = getattr(torch, DTYPES[entry["dtype"]])
        shape = entry["shape"]
        count = (end - begin) // ITEMSIZE[entry["dtype"]]
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._mm, dtype=dtype, count=count, offset=self._base + begin).view(shape)

    def close(self) -> None:
        self.hidden_states = self.token_ids = None
        with contextlib.suppress(BufferError):  # a view is still held somewhere: the mapping goes with it
            self._mm.close()


def open_features(path: str) -> FeatureFile:
    """Map a feature file and check its header (tensors, dtypes, shapes, byte ranges); raises HandoverError."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        raise HandoverError(f"cannot open {path}: {e.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise HandoverError(f"{path}: {size} bytes, not a safetensors file")
        # ACCESS_COPY: a private mapping (torch wants a writable buffer); nothing is copied unless written.
        mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise HandoverError(f"cannot map {path}: {e}") from None
    finally:
        os.close(fd)
    try:
        (n,) = struct.unpack("<Q", mm[:8])
        if n > MAX_HEADER or 8 + n > size:
            raise HandoverError(f"{path}: a header of {n} bytes in a file of {size}: not a feature file")
        header = json.loads(bytes(mm[8:8 + n]))
        _check_header(path, header, size - 8 - n)
    except HandoverError:
        mm.close()
        raise
    except (ValueError, struct.error) as e:
        mm.close()
        raise HandoverError(f"{path}: unreadable header ({e})") from None
    return FeatureFile(path, mm, header, 8 + n)


def _check_header(path: str, header: Any, data_size: int) -> None:
    if not isinstance(header, dict):
        raise HandoverError(f"{path}: the header is not a mapping")
    for name, rank in (("hidden_states", 3), ("token_ids", 1)):
        entry = header.get(name)
        if not isinstance(entry, dict):
            raise HandoverError(f"{path}: no {name!r} tensor (holds {sorted(k for k in header if k != '__metadata__')})")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise HandoverError(f"{path}: {name} has dtype {dtype!r}, not one of {sorted(DTYPES)}")
        if (not isinstance(shape, list) or len(shape) != rank
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise HandoverError(f"{path}: {name} has shape {shape!r}, expected {rank} dimensions")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise HandoverError(f"{path}: {name}'s byte range {offsets!r} lies outside the file")
        if offsets[1] - offsets[0] != math.prod(shape) * ITEMSIZE[dtype]:
            raise HandoverError(f"{path}: {name} holds {offsets[1] - offsets[0]} bytes for shape {shape} {dtype}")
    if header["token_ids"]["dtype"] not in ("I64", "I32"):
        raise HandoverError(f"{path}: token_ids are {header['token_ids']['dtype']}, not integers")
    if header["hidden_states"]["shape"][0] != header["token_ids"]["shape"][0]:
        raise HandoverError(f"{path}: {header['hidden_states']['shape'][0]} rows of hidden states for "
                            f"{header['token_ids']['shape'][0]} token ids")
