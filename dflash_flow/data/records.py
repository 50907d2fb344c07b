"""Read training records: chat JSONL (rendered and masked), pre-tokenized JSONL and Arrow.

* Chat JSONL: one ``{"conversations": [{"role", "content"}, ...]}`` per line (``"messages"`` and
  ShareGPT's ``{"from", "value"}`` are accepted too), rendered with the tokenizer's chat template.
* Pre-tokenized JSONL: ``{"input_ids": [...], "loss_mask": [...]}`` per line.
* Arrow IPC (file or stream format, e.g. ``.arrow``, ``.feather``, HF datasets cache files) with
  ``input_ids`` and ``loss_mask`` list columns.

Every record that cannot be used is counted by reason and reported as ``file:line: reason`` (rows of
Arrow files count from 1); with ``on_bad_record="fail"`` the first one raises `DataError`. Over-long
samples are truncated on the right or dropped (``overflow``); samples with fewer than
``min_loss_tokens`` supervised tokens (after truncation) are dropped and counted; a record with no
supervised token at all is a bad record.

Tokenized files are cached in ``cache_dir`` under a key that hashes the file's content, the tokenizer,
the chat template and every option that changes the result, so a second run reads arrays instead of
tokenizing again, and any change invalidates the entry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from dflash_flow.items import Sample
from dflash_flow.util import atomic_write, sha256_file

from .chat import (
    ChatTemplateError,
    TemplateInfo,
    parse_conversation,
    probe_template,
    render_chat,
    supervised_spans,
    token_mask,
)

__all__ = [
    "BadRecord",
    "DataError",
    "LoadReport",
    "ReadOptions",
    "TokenizedFile",
    "load_samples",
    "read_chat_jsonl",
    "read_pretokenized_arrow",
    "read_pretokenized_jsonl",
    "read_records",
    "file_sha256",
    "tokenizer_fingerprint",
]

log = logging.getLogger(__name__)

CACHE_VERSION = 2
_MAX_LISTED_BAD = 100
_TOKENIZE_CHUNK = 512
#: Longest JSONL record (one line) read by default. A line is read at most this far into memory; a longer
#: one is a bad record (file:line), skipped to its end in small chunks, never loaded whole.
DEFAULT_MAX_RECORD_BYTES = 64 * 2**20
_SKIP_CHUNK = 2**20
#: Token ids are stored as int32: an id that does not fit is refused, never wrapped by the cast.
_ID_LIMIT = int(np.iinfo(np.int32).max) + 1


class DataError(ValueError):
    """Unusable input data; the message names the file (and line) at fault."""


@attrs.define(frozen=True)
class BadRecord:
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@attrs.define(frozen=True, kw_only=True)
class ReadOptions:
    """Options shared by all readers (all of them are part of the cache key)."""

    max_length: int = attrs.field(default=3072, validator=attrs.validators.ge(2))
    overflow: Literal["truncate", "drop"] = attrs.field(
        default="truncate", validator=attrs.validators.in_(("truncate", "drop"))
    )
    on_bad_record: Literal["skip", "fail"] = attrs.field(
        default="skip", validator=attrs.validators.in_(("skip", "fail"))
    )
    # DFlash anchors need two consecutive supervised tokens; 2 * block_size is what TorchSpec requires.
    min_loss_tokens: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_record_bytes: int = attrs.field(default=DEFAULT_MAX_RECORD_BYTES, validator=attrs.validators.ge(1))
    vocab_size: int | None = None  # pre-tokenized ids must be < vocab_size (chat: taken from the tokenizer)
    chat_template: str | None = None  # overrides the tokenizer's own template
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    cache_dir: Path | None = attrs.field(default=None, converter=lambda v: None if v is None else Path(v))


@attrs.define(eq=False)
class LoadReport:
    """What happened to the records of one or more files."""

    files: list[str] = attrs.field(factory=list)
    records: int = 0  # non-blank lines / rows seen
    samples: int = 0  # samples kept
    tokens: int = 0  # tokens kept (after truncation)
    supervised_tokens: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    too_few_supervised: int = 0  # some, but fewer than min_loss_tokens, supervised tokens (a filter, not bad)
    bad: int = 0
    bad_by_reason: dict[str, int] = attrs.field(factory=dict)
    bad_records: list[BadRecord] = attrs.field(factory=list)  # the first _MAX_LISTED_BAD
    from_cache: bool = False

    def add_bad(self, rec: BadRecord, kind: str) -> None:
        self.bad += 1
        self.bad_by_reason[kind] = self.bad_by_reason.get(kind, 0) + 1
        if len(self.bad_records) < _MAX_LISTED_BAD:
            self.bad_records.append(rec)

    def merge(self, other: LoadReport) -> None:
        self.files += other.files
        for f in (
            "records",
            "samples",
            "tokens",
            "supervised_tokens",
            "truncated",
            "dropped_overlong",
            "too_few_supervised",
            "bad",
        ):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.bad_by_reason.items():
            self.bad_by_reason[k] = self.bad_by_reason.get(k, 0) + v
        room = _MAX_LISTED_BAD - len(self.bad_records)
        self.bad_records += other.bad_records[: max(room, 0)]
        self.from_cache = self.from_cache and other.from_cache

    def counters(self) -> dict[str, int]:
        out = {
            "records": self.records,
            "samples": self.samples,
            "tokens": self.tokens,
            "supervised_tokens": self.supervised_tokens,
            "truncated": self.truncated,
            "dropped_overlong": self.dropped_overlong,
            "too_few_supervised": self.too_few_supervised,
            "bad": self.bad,
        }
        out.update({f"bad_{k}": v for k, v in sorted(self.bad_by_reason.items())})
        return out

    def summary(self) -> str:
        parts = [f"{self.samples} samples from {self.records} records in {len(self.files)} file(s)"]
        for name in ("truncated", "dropped_overlong", "too_few_supervised", "bad"):
            if getattr(self, name):
                parts.append(f"{name}={getattr(self, name)}")
        text = ", ".join(parts)
        if self.bad_records:
            shown = "\n  ".join(str(r) for r in self.bad_records[:10])
            more = f"\n  ... and {self.bad - 10} more" if self.bad > 10 else ""
            text += f"\nbad records:\n  {shown}{more}"
        return text

    def to_json(self) -> dict:
        d = attrs.asdict(self, recurse=False)
        d["bad_records"] = [attrs.asdict(r) for r in self.bad_records]
        return d

    @classmethod
    def from_json(cls, d: dict) -> LoadReport:
        d = dict(d)
        d["bad_records"] = [BadRecord(**r) for r in d.get("bad_records", [])]
        return cls(**d)


@attrs.define(eq=False)
class TokenizedFile:
    """The kept samples of one file as flat arrays (cheap to cache and to slice)."""

    path: str
    ids: np.ndarray  # int32, all samples concatenated
    mask: np.ndarray  # uint8
    offsets: np.ndarray  # int64 [n + 1]
    lines: np.ndarray  # int64 [n], 1-based line (JSONL) or row (Arrow) of each sample
    report: LoadReport

    def __len__(self) -> int:
        return int(self.lines.size)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def sample(self, i: int, sample_id: int) -> Sample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(
            sample_id=sample_id,
            input_ids=self.ids[a:b],
            loss_mask=self.mask[a:b],
            source=f"{self.path}:{int(self.lines[i])}",
        )

    def samples(self, first_id: int = 0) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.sample(i, first_id + i)


# --------------------------------------------------------------------------------------------------
# shared record handling


class _Collector:
    """Applies the options to candidate samples and accumulates the kept ones."""

    def __init__(self, path: str, options: ReadOptions):
        self.path = path
        self.opt = options
        self.report = LoadReport(files=[path])
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.lines: list[int] = []

    def bad(self, line: int, kind: str, reason: str) -> None:
        rec = BadRecord(self.path, line, reason)
        if self.opt.on_bad_record == "fail":
            raise DataError(
                f"{rec} (on_bad_record=fail; use on_bad_record=skip to count and skip such records)"
            )
        self.report.add_bad(rec, kind)

    def offer(self, line: int, ids: np.ndarray, mask: np.ndarray) -> None:
        n = ids.size
        truncated = False
        if n > self.opt.max_length:
            if self.opt.overflow == "drop":
                self.report.dropped_overlong += 1
                return
            self.report.truncated += 1
            truncated = True
            ids, mask = ids[: self.opt.max_length], mask[: self.opt.max_length]
        supervised = int(mask.sum())
        if supervised == 0:
            why = f" left after truncation to max_length={self.opt.max_length}" if truncated else ""
            self.bad(line, "no_supervised", f"no supervised (assistant) tokens{why}")
            return
        if supervised < self.opt.min_loss_tokens:
            self.report.too_few_supervised += 1
            return
        self.ids.append(ids.astype(np.int32, copy=False))
        self.masks.append(mask.astype(np.uint8, copy=False))
        self.lines.append(line)
        self.report.samples += 1
        self.report.tokens += int(ids.size)
        self.report.supervised_tokens += supervised

    def result(self) -> TokenizedFile:
        sizes = np.fromiter((a.size for a in self.ids), dtype=np.int64, count=len(self.ids))
        offsets = np.zeros(sizes.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        tf = TokenizedFile(
            path=self.path,
            ids=np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32),
            mask=np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8),
            offsets=offsets,
            lines=np.asarray(self.lines, dtype=np.int64),
            report=self.report,
        )
        if self.report.records and not len(tf):
            raise DataError(f"{self.path}: no usable records ({self.report.summary()})")
        return tf


def _check_token_values(ids: np.ndarray, mask: np.ndarray, vocab_size: int | None) -> tuple[str, str] | None:
    """Checks the ids in their own integer type (any width, signed or not: min and max are exact), so
    that the int32 cast that follows can never wrap a value."""
    if ids.size != mask.size:
        return "length_mismatch", f"input_ids has {ids.size} tokens but loss_mask has {mask.size}"
    if ids.size == 0:
        return "empty", "input_ids is empty"
    lo, hi = int(ids.min()), int(ids.max())
    limit = min(vocab_size, _ID_LIMIT) if vocab_size is not None else _ID_LIMIT
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        pos = int(np.flatnonzero(ids == bad)[0])
        if vocab_size is not None:
            return "out_of_vocab", f"input_ids[{pos}] = {bad} is outside the vocabulary [0, {vocab_size})"
        return "out_of_vocab", (
            f"input_ids[{pos}] = {bad} is not a token id (ids must be in [0, 2**31); set vocab_size to check "
            "them against the vocabulary)"
        )
    if mask.size and (int(mask.min()) < 0 or int(mask.max()) > 1):
        return "bad_mask", "loss_mask values must be 0 or 1"
    return None


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _int_list(value: Any, *, bools: bool) -> bool:
    """A flat JSON list of integers (``true``/``false`` only where ``bools``: a loss mask)."""
    if not isinstance(value, list):
        return False
    return all(type(x) is int or (bools and type(x) is bool) for x in value)


def _mib(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def _read_lines(f, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
    """(line number, raw line, its size) of a binary file, reading at most ``limit + 1`` bytes of a line
    into memory: a longer line comes back as ``None`` (its size counted while it is skipped in chunks)."""
    no = 0
    while True:
        raw = f.readline(limit + 1)
        if not raw:
            return
        no += 1
        if len(raw) > limit and not raw.endswith(b"\n"):
            size = len(raw)
            while True:
                chunk = f.readline(_SKIP_CHUNK)
                size += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield no, None, size - (1 if chunk.endswith(b"\n") else 0)  # the record's bytes, not its newline
            continue
        yield no, raw, len(raw)


def _iter_jsonl(path: Path, collector: _Collector) -> Iterator[tuple[int, Any]]:
    """Yields (line, parsed object); reports over-long, undecodable and unparsable lines. The file is
    streamed line by line with a bounded line length (``max_record_bytes``), never read whole."""
    limit = collector.opt.max_record_bytes
    seen_content = False
    with path.open("rb") as f:
        for no, raw, size in _read_lines(f, limit):
            if raw is None:
                seen_content = True
                collector.report.records += 1
                collector.bad(
                    no, "too_long",
                    f"record of {size} bytes is longer than max_record_bytes={limit} ({_mib(limit)}); "
                    "raise max_record_bytes or split the record",
                )
                continue
            if not raw.strip():
                continue
            seen_content = True
            yield from _parse_line(no, raw, collector)
    if not seen_content:
        raise DataError(f"{path}: file is empty")


def _parse_line(no: int, raw: bytes, collector: _Collector) -> Iterator[tuple[int, Any]]:
    """Yields the line's object (at most one); reports a line that is not UTF-8 or not a JSON object."""
    collector.report.records += 1
    try:
        text = raw.decode("utf-8-sig" if no == 1 else "utf-8")  # tolerate a byte-order mark
    except UnicodeDecodeError as exc:
        collector.bad(no, "not_utf8", f"not valid UTF-8 (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})")
        return
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if not raw.endswith(b"\n"):  # only the last line of a file can lack its newline
            collector.bad(
                no, "truncated", f"file ends inside this record (truncated file?): {exc.msg} at column {exc.colno}"
            )
        else:
            collector.bad(no, "invalid_json", f"invalid JSON: {exc.msg} at column {exc.colno}")
        return
    except (ValueError, RecursionError) as exc:  # e.g. a 5000-digit number, arrays nested 100000 deep
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        collector.bad(no, "invalid_json", f"invalid JSON: {first}")
        return
    if not isinstance(obj, dict):
        collector.bad(no, "not_object", f"expected a JSON object, got {type(obj).__name__}")
        return
    yield no, obj


# --------------------------------------------------------------------------------------------------
# cache


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
    return h.hexdigest()


_SHA_LOCK = threading.Lock()
_SHA_MEMO: dict[tuple, str] = {}


def file_sha256(path: str | os.PathLike) -> str:
    """sha256 of a data file's content, computed once per process for one version of the file (keyed by
    its resolved path, device, inode, size and mtime): the cache key and the resume check of the
    application share one pass over large files."""
    real = os.path.realpath(path)
    st = os.stat(real)
    key = (real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    with _SHA_LOCK:
        hit = _SHA_MEMO.get(key)
    if hit is None:
        hit = sha256_file(real)
        with _SHA_LOCK:
            _SHA_MEMO[key] = hit
    return hit


def _cache_key(path: Path, kind: str, options: ReadOptions, tokenizer: Any, template: str | None) -> str:
    if options.cache_dir is None:
        return ""  # no cache: no key (hashing a large file would be wasted)
    parts = {
        "version": CACHE_VERSION,
        "kind": kind,
        "file": file_sha256(path),
        "max_length": options.max_length,
        "overflow": options.overflow,
        "on_bad_record": options.on_bad_record,
        "min_loss_tokens": options.min_loss_tokens,
        "max_record_bytes": options.max_record_bytes,
        "vocab_size": options.vocab_size,
        "template": template,
        "template_kwargs": options.template_kwargs,
        "tokenizer": tokenizer_fingerprint(tokenizer) if tokenizer is not None else None,
    }
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _cache_paths(cache_dir: Path, path: Path, key: str) -> tuple[Path, Path]:
    stem = f"{path.stem}-{key}"
    return cache_dir / f"{stem}.npz", cache_dir / f"{stem}.json"


def _cache_load(cache_dir: Path | None, path: Path, key: str) -> TokenizedFile | None:
    if cache_dir is None:
        return None
    arrays, meta = _cache_paths(cache_dir, path, key)
    if not (arrays.exists() and meta.exists()):
        return None
    try:
        with np.load(arrays) as z:
            ids, mask, offsets, lines = z["ids"], z["mask"], z["offsets"], z["lines"]
        report = LoadReport.from_json(json.loads(meta.read_text()))
    except Exception as exc:  # a damaged entry is a miss, not a failure
        log.warning("ignoring unreadable cache entry %s: %s", arrays, exc)
        return None
    report.from_cache = True
    # The key hashes content, not location: a moved or copied file hits, so point the report at it.
    report.files = [str(path)]
    report.bad_records = [BadRecord(str(path), r.line, r.reason) for r in report.bad_records]
    return TokenizedFile(str(path), ids, mask, offsets, lines, report)


def _cache_store(cache_dir: Path | None, path: Path, key: str, tf: TokenizedFile) -> None:
    if cache_dir is None:
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    arrays, meta = _cache_paths(cache_dir, path, key)
    # Arrays first, report last: a reader only trusts an entry whose report exists.
    atomic_write(arrays, lambda f: np.savez(f, ids=tf.ids, mask=tf.mask, offsets=tf.offsets, lines=tf.lines))
    atomic_write(meta, lambda f: f.write(json.dumps(tf.report.to_json()).encode()))


# --------------------------------------------------------------------------------------------------
# readers


def _check_file(path: Path) -> None:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        raise DataError(f"{path}: file is empty")


def read_chat_jsonl(path: str | Path, tokenizer: Any, options: ReadOptions | None = None) -> TokenizedFile:
    """Render, tokenize and mask a chat JSONL file (cached when ``options.cache_dir`` is set)."""
    options = options or ReadOptions()
    path = Path(path)
    _check_file(path)
    if not getattr(tokenizer, "is_fast", False):
        raise DataError("chat loss masks need a fast tokenizer (offset mapping); got a slow tokenizer")
    template = options.chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise DataError(
            f"{path}: the tokenizer has no chat template and ReadOptions.chat_template is not set"
        )
    key = _cache_key(path, "chat", options, tokenizer, template)
    cached = _cache_load(options.cache_dir, path, key)
    if cached is not None:
        return cached
    try:
        info: TemplateInfo = probe_template(
            tokenizer, chat_template=template, template_kwargs=options.template_kwargs
        )
    except ChatTemplateError as exc:
        raise DataError(f"chat template unusable for loss masks: {exc}") from exc
    vocab = options.vocab_size or len(tokenizer)
    col = _Collector(str(path), options)

    pending: list[tuple[int, str, list[tuple[int, int]]]] = []

    def flush() -> None:
        if not pending:
            return
        enc = tokenizer([p[1] for p in pending], add_special_tokens=False, return_offsets_mapping=True)
        for (line, _text, spans), ids, offs in zip(
            pending, enc["input_ids"], enc["offset_mapping"], strict=False
        ):
            ids_arr = np.asarray(ids, dtype=np.int64)
            mask = token_mask(np.asarray(offs, dtype=np.int64), spans)
            if ids_arr.size and int(ids_arr.max()) >= vocab:
                col.bad(line, "out_of_vocab", f"token id {int(ids_arr.max())} >= vocab size {vocab}")
                continue
            col.offer(line, ids_arr, mask)
        pending.clear()

    for line, obj in _iter_jsonl(path, col):
        msgs, kind, reason = parse_conversation(obj)
        if msgs is None:
            col.bad(line, kind, reason)
            continue
        try:
            text = render_chat(
                tokenizer, msgs, chat_template=template, template_kwargs=options.template_kwargs
            )
            spans = supervised_spans(text, msgs, info)
        except ChatTemplateError as exc:
            col.bad(line, "template", str(exc))
            continue
        if not spans:
            col.bad(line, "no_supervised", "no assistant turn with content: nothing to supervise")
            continue
        pending.append((line, text, spans))
        if len(pending) >= _TOKENIZE_CHUNK:
            flush()
    flush()
    tf = col.result()
    _cache_store(options.cache_dir, path, key, tf)
    return tf


def read_pretokenized_jsonl(path: str | Path, options: ReadOptions | None = None) -> TokenizedFile:
    """``{"input_ids": [...], "loss_mask": [...]}`` per line."""
    options = options or ReadOptions()
    path = Path(path)
    _check_file(path)
    key = _cache_key(path, "tokens-jsonl", options, None, None)
    cached = _cache_load(options.cache_dir, path, key)
    if cached is not None:
        return cached
    col = _Collector(str(path), options)
    for line, obj in _iter_jsonl(path, col):
        missing = [k for k in ("input_ids", "loss_mask") if k not in obj]
        if missing:
            col.bad(line, "missing_field", f"missing field {missing[0]!r}")
            continue
        raw_ids, raw_mask = obj["input_ids"], obj["loss_mask"]
        if not _int_list(raw_ids, bools=False) or not _int_list(raw_mask, bools=True):
            col.bad(line, "bad_type", "input_ids/loss_mask must be flat lists of integers")
            continue
        # JSON integers have no width: one past int64 would turn the whole array into floats or objects.
        wide = next((i for i, x in enumerate(raw_ids) if not _INT64_MIN <= x <= _INT64_MAX), None)
        if wide is not None:
            col.bad(line, "out_of_vocab", f"input_ids[{wide}] = {raw_ids[wide]} is not a token id (ids must be in [0, 2**31))")
            continue
        ids = np.asarray(raw_ids, dtype=np.int64)
        mask = np.asarray([int(m) if 0 <= m <= 1 else 2 for m in raw_mask], dtype=np.int64)
        problem = _check_token_values(ids, mask, options.vocab_size)
        if problem:
            col.bad(line, *problem)
            continue
        col.offer(line, ids.astype(np.int64), mask.astype(np.uint8))
    tf = col.result()
    _cache_store(options.cache_dir, path, key, tf)
    return tf


def _open_arrow(path: Path):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    errors = []
    for opener in (ipc.open_file, ipc.open_stream):
        try:
            with pa.memory_map(str(path)) as source:
                return opener(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            errors.append(f"{opener.__name__}: {exc}")
    raise DataError(
        f"{path}: not a readable Arrow IPC file or stream (truncated or another format?): {'; '.join(errors)}"
    )


def read_pretokenized_arrow(path: str | Path, options: ReadOptions | None = None) -> TokenizedFile:
    """Arrow IPC table with list columns ``input_ids`` and ``loss_mask``; rows are reported 1-based."""
    options = options or ReadOptions()
    path = Path(path)
    _check_file(path)
    key = _cache_key(path, "tokens-arrow", options, None, None)
    cached = _cache_load(options.cache_dir, path, key)
    if cached is not None:
        return cached
    table = _open_arrow(path)
    missing = [c for c in ("input_ids", "loss_mask") if c not in table.column_names]
    if missing:
        raise DataError(f"{path}: missing column(s) {missing}; columns are {table.column_names}")
    col = _Collector(str(path), options)
    ids_col = table.column("input_ids")
    mask_col = table.column("loss_mask")
    for row in range(table.num_rows):
        col.report.records += 1
        ids_v, mask_v = ids_col[row], mask_col[row]
        if not ids_v.is_valid or not mask_v.is_valid:
            col.bad(row + 1, "missing_field", "null input_ids or loss_mask")
            continue
        try:
            ids = np.asarray(ids_v.values.to_numpy(zero_copy_only=False))
            mask = np.asarray(mask_v.values.to_numpy(zero_copy_only=False))
        except AttributeError:
            col.bad(row + 1, "bad_type", "input_ids/loss_mask must be list columns")
            continue
        if ids.size and ids.dtype.kind not in "iu":
            col.bad(row + 1, "bad_type", f"input_ids must be integers, got {ids.dtype}")
            continue
        if mask.size and mask.dtype.kind not in "iub":
            col.bad(row + 1, "bad_type", f"loss_mask must be integers, got {mask.dtype}")
            continue
        problem = _check_token_values(ids, mask, options.vocab_size)
        if problem:
            col.bad(row + 1, *problem)
            continue
        col.offer(row + 1, ids.astype(np.int64), mask.astype(np.uint8))
    tf = col.result()
    _cache_store(options.cache_dir, path, key, tf)
    return tf


def _sniff_jsonl(path: Path, limit: int = DEFAULT_MAX_RECORD_BYTES) -> Literal["chat", "tokens"]:
    with path.open("rb") as f:
        for _no, raw, _size in _read_lines(f, limit):
            if raw is None or not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(obj, dict):
                if "input_ids" in obj:
                    return "tokens"
                if "conversations" in obj or "messages" in obj:
                    return "chat"
    raise DataError(
        f"{path}: cannot tell the format: no record has 'conversations', 'messages' or 'input_ids'"
    )


def read_records(
    path: str | Path,
    *,
    tokenizer: Any = None,
    options: ReadOptions | None = None,
    kind: Literal["auto", "chat", "tokens"] = "auto",
) -> TokenizedFile:
    """Read one file of any supported format (``kind="auto"`` looks at the extension and first record)."""
    path = Path(path)
    _check_file(path)
    if path.suffix in (".arrow", ".feather", ".ipc"):
        return read_pretokenized_arrow(path, options)
    if kind == "auto":
        kind = _sniff_jsonl(path, (options or ReadOptions()).max_record_bytes)
    if kind == "tokens":
        return read_pretokenized_jsonl(path, options)
    if tokenizer is None:
        raise DataError(f"{path}: chat records need a tokenizer")
    return read_chat_jsonl(path, tokenizer, options)


def load_samples(
    paths: Sequence[str | Path],
    *,
    tokenizer: Any = None,
    options: ReadOptions | None = None,
    kind: Literal["auto", "chat", "tokens"] = "auto",
) -> tuple[list[Sample], LoadReport]:
    """Read several files; sample ids run 0..n-1 in file order, then line order."""
    report = LoadReport(from_cache=True)
    samples: list[Sample] = []
    for p in paths:
        tf = read_records(p, tokenizer=tokenizer, options=options, kind=kind)
        samples.extend(tf.samples(first_id=len(samples)))
        report.merge(tf.report)
    if not paths:
        report.from_cache = False
    return samples, report
