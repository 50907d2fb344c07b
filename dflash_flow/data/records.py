"""Read training records (chat or pre-tokenized) in any supported format (`formats`), checked by `parse`'s
rules; with ``cache_dir``, through the token store (`store`), tokenized by spawned workers."""

from __future__ import annotations

import contextlib
import itertools
import logging
import pickle
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from dflash_flow.util import usable_cores

from .formats import (
    InputFormat,
    Position,
    check_input,
    detect,
    input_bytes,
    iter_chunks,
    sniff_kind,
    total_size,
)
from .parse import ChatEncoder, init_worker, process_chunk, work
from .reports import BadRecord, DataError, LoadReport, ReadOptions, TokenizedFile
from .store import (
    MANIFEST,
    EntryWriter,
    StoreError,
    cache_key,
    discard_entry,
    entry_lock,
    file_sha256,
    open_entry,
    write_progress,
)

__all__ = ["BadRecord", "DataError", "LoadReport", "ReadOptions", "ReadProgress", "TokenizedFile", "file_sha256",
           "read_records"]

log = logging.getLogger(__name__)

#: Inputs smaller than this are read in-process: starting workers would cost more than it saves.
PARALLEL_MIN_BYTES = 8 * 2**20
_PROGRESS_EVERY_S = 1.0


class ReadCancelled(Exception):
    """Reading stopped because ``should_stop()`` said so (a stop request)."""


@attrs.define
class ReadProgress:
    """Where reading one input stands (``state``: reading, waiting for another process, cached, done)."""

    path: str
    state: Literal["reading", "waiting", "cached", "done"]
    unit: str = "bytes"
    done: int = 0
    total: int = 0
    records: int = 0
    samples: int = 0
    tokens: int = 0
    elapsed_s: float = 0.0
    holder: str = ""  # who builds the entry, while waiting

    @property
    def fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def records_per_s(self) -> float:
        return self.records / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        f = self.fraction
        if self.state in ("cached", "done"):
            return 0.0
        return self.elapsed_s * (1 - f) / f if f > 0 and self.elapsed_s > 0 else None


class _MemoryWriter:
    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {"ids": [], "mask": [], "lengths": [], "lines": []}

    def append(self, ids, mask, lengths, lines) -> None:
        for k, v in (("ids", ids), ("mask", mask), ("lengths", lengths), ("lines", lines)):
            self.parts[k].append(v)

    def arrays(self) -> dict[str, np.ndarray]:
        dt = {"ids": np.int32, "mask": np.uint8, "lengths": np.int64, "lines": np.int64}
        out = {k: np.concatenate(v).astype(dt[k], copy=False) if v else np.zeros(0, dt[k]) for k, v in self.parts.items()}
        offsets = np.zeros(out["lengths"].size + 1, dtype=np.int64)
        np.cumsum(out.pop("lengths"), out=offsets[1:])
        out["offsets"] = offsets
        return out


def _results(chunks: Iterator[tuple], workers: int, payload: Callable[[], bytes], local: dict) -> Iterator[dict]:
    """Each chunk's `process_chunk` result, in order: in this process, or on ``workers`` processes with at
    most two chunks per worker in flight (memory stays bounded by chunks, not by the input)."""
    head = list(itertools.islice(chunks, 2))
    if workers <= 1 or len(head) < 2:  # one chunk (a small input, or one giant bad line): no workers
        for ch in itertools.chain(head, chunks):
            yield process_chunk(ch, **local)
        return
    chunks = itertools.chain(head, chunks)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    ex = ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
                             initializer=init_worker, initargs=(payload(),))
    pending: deque = deque()  # (future, chunk), in order
    try:
        try:
            for ch in chunks:
                pending.append((ex.submit(work, ch), ch))
                while len(pending) >= 2 * workers:
                    yield pending[0][0].result()
                    pending.popleft()
            while pending:
                yield pending[0][0].result()
                pending.popleft()
        except BrokenProcessPool as exc:
            # A worker that cannot start (a parent run from stdin: spawn re-imports the main script) or
            # that died (out of memory): carry on in this process, in order, from the first unfinished chunk.
            log.warning("tokenizing worker processes failed (%s); reading the rest in this process", exc)
            rest = [ch for _f, ch in pending]
            pending.clear()
            for ch in itertools.chain(rest, chunks):
                yield process_chunk(ch, **local)
    finally:
        for f, _ch in pending:
            f.cancel()
        ex.shutdown(wait=True, cancel_futures=True)


def _build(writer, path: Path, fmt: InputFormat, kind: str, options: ReadOptions, encoder: ChatEncoder | None,
           tokenizer: Any, on_chunk: Callable[[LoadReport, Position], None]) -> LoadReport:
    """Read every chunk of ``path`` into ``writer``; returns the merged report."""
    report = LoadReport()
    position = total_size(path, fmt)
    chunks = iter_chunks(path, fmt, kind, max_record_bytes=options.max_record_bytes, position=position)
    workers = options.num_workers
    if workers is None:
        cores = usable_cores() if input_bytes(path) >= PARALLEL_MIN_BYTES else 0
        workers = cores if cores > 1 else 0

    blob = b""  # the workers' payload
    if workers > 1:
        try:
            blob = pickle.dumps({"tokenizer": tokenizer if kind == "chat" else None, "options": options, "kind": kind,
                                 "path": str(path)})
        except Exception as exc:  # noqa: BLE001 - a tokenizer that cannot travel: read in this process
            log.warning("%s: the tokenizer cannot be sent to worker processes (%s); reading in this process", path, exc)
            workers = 0

    local = {"path": str(path), "kind": kind, "options": options, "encoder": encoder}
    with contextlib.closing(_results(chunks, workers, lambda: blob, local)) as results:
        for res in results:
            if res.get("failure"):
                raise DataError(res["failure"])
            writer.append(res["ids"], res["mask"], res["lengths"], res["lines"])
            report.merge(res["report"])
            on_chunk(report, position)
    report.files = [str(path)]
    report.from_cache = False
    if not report.records:  # a file with a schema and no rows (Arrow, Parquet) is as empty as a 0-byte one
        raise DataError(f"{path}: no records (0 rows): an empty data file trains nothing")
    if not report.samples:
        raise DataError(f"{path}: no usable records ({report.summary()})")
    return report


def _as_file(path: Path, arrays: dict[str, np.ndarray], report: LoadReport, from_cache: bool, progress,
             t0: float) -> TokenizedFile:
    report.from_cache = from_cache
    # The key hashes content, not location: a moved or copied file hits, so point the report at it.
    report.files = [str(path)]
    report.bad_records = [BadRecord(str(path), r.line, r.reason) for r in report.bad_records]
    if progress is not None:
        size = input_bytes(path)
        progress(ReadProgress(str(path), "cached" if from_cache else "done", "bytes", size, size, report.records,
                              report.samples, report.tokens, time.monotonic() - t0))
    return TokenizedFile(str(path), arrays["ids"], arrays["mask"], arrays["offsets"], arrays["lines"], report)


def read_records(path: str | Path, *, tokenizer: Any = None, options: ReadOptions | None = None,
                 kind: Literal["auto", "chat", "tokens"] = "auto", progress: Callable[[ReadProgress], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> TokenizedFile:
    """The kept samples of one input (any format; ``kind="auto"`` looks at it), from the store when it has them."""
    options = options or ReadOptions()
    path = Path(path)
    check_input(path)
    fmt = detect(path)
    if kind == "auto":
        kind = sniff_kind(path, fmt, options.max_record_bytes)
    if kind == "chat" and tokenizer is None:
        raise DataError(f"{path}: chat records need a tokenizer")
    encoder = ChatEncoder(tokenizer, options, str(path)) if kind == "chat" else None
    t0 = time.monotonic()
    last = [0.0]

    def on_chunk(report: LoadReport, position: Position) -> None:
        if should_stop is not None and should_stop():
            raise ReadCancelled(str(path))
        now = time.monotonic()
        p = ReadProgress(str(path), "reading", position.unit, position.done, position.total, report.records,
                         report.samples, report.tokens, now - t0)
        if cache_dir is not None and now - last[0] >= _PROGRESS_EVERY_S:
            last[0] = now
            write_progress(cache_dir, name, attrs.asdict(p))
        if progress is not None:
            progress(p)

    cache_dir = options.cache_dir
    if cache_dir is None:
        name = ""
        mem = _MemoryWriter()
        report = _build(mem, path, fmt, kind, options, encoder, tokenizer, on_chunk)
        return _as_file(path, mem.arrays(), report, False, progress, t0)

    key = cache_key(path, kind, options, tokenizer if kind == "chat" else None, encoder.template if encoder else None)
    name = f"{path.name}-{key}"
    entry = cache_dir / name

    def on_wait(other: dict | None, waited: float) -> None:  # another process builds it: report its progress
        if should_stop is not None and should_stop():
            raise ReadCancelled(str(path))
        if progress is not None:
            o = other or {}
            holder = f"pid {o.get('pid', '?')} on {o.get('host', '?')}"
            progress(ReadProgress(str(path), "waiting", o.get("unit", "bytes"), int(o.get("done", 0)),
                                  int(o.get("total", 0)), int(o.get("records", 0)), int(o.get("samples", 0)),
                                  int(o.get("tokens", 0)), float(o.get("elapsed_s", waited)), holder))

    damaged = False
    for _attempt in range(3):
        if not damaged and (entry / MANIFEST).exists():
            try:
                return _open_cached(entry, path, progress, t0, cached=True)
            except StoreError:
                damaged = True  # rebuild it, under the lock
        with entry_lock(cache_dir, name, ready=lambda d=damaged: not d and (entry / MANIFEST).exists(),
                        on_wait=on_wait) as locked:
            if not locked:
                continue  # another process published it while we waited: map it
            if entry.exists():
                try:
                    return _open_cached(entry, path, progress, t0, cached=True)
                except StoreError as exc:
                    discard_entry(entry, str(exc))
            writer = EntryWriter(entry)
            try:
                report = _build(writer, path, fmt, kind, options, encoder, tokenizer, on_chunk)
                writer.finish(report.to_json(), {"input": str(path), "kind": kind, "format": attrs.asdict(fmt)})
            except BaseException:
                writer.abort()
                raise
            return _open_cached(entry, path, progress, t0, cached=False)
        damaged = False
    raise DataError(f"{path}: the cache entry {entry} keeps disappearing or failing its check; "
                    "is another process deleting it? (set cache_dir elsewhere)")


def _open_cached(entry: Path, path: Path, progress, t0: float, *, cached: bool) -> TokenizedFile:
    """The store's entry for ``path`` mapped (StoreError when it fails its check); ``cached``: not built now."""
    arrays, rep, _meta = open_entry(entry)
    return _as_file(path, arrays, LoadReport.from_json(rep), cached, progress, t0)
