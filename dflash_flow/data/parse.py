"""From raw records to kept samples, one chunk (JSONL lines or an Arrow record batch) at a time: the work a
tokenizing process does. `process_chunk` gives flat arrays and its share of the load report; bad records are
listed in line order whatever the chunking."""

from __future__ import annotations

import itertools
import json
import os
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np

from . import chat
from .reports import MAX_LISTED_BAD, BadRecord, DataError, LoadReport, ReadOptions

__all__ = ["ChatEncoder", "ChunkCollector", "init_worker", "process_chunk", "read_lines", "work"]

#: Token ids are stored as int32: an id that does not fit is refused, never wrapped by the cast.
ID_LIMIT = int(np.iinfo(np.int32).max) + 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
SKIP_CHUNK = 2**20
_TOKENIZE_BATCH = 512


def read_lines(f, limit: int) -> Iterator[tuple[int, bytes | None, int]]:
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
                chunk = f.readline(SKIP_CHUNK)
                size += len(chunk)
                if not chunk or chunk.endswith(b"\n"):
                    break
            yield no, None, size - (1 if chunk.endswith(b"\n") else 0)  # the record's bytes, not its newline
            continue
        yield no, raw, len(raw)


class ChunkCollector:
    """Applies the options to candidate samples of one chunk and accumulates the kept ones."""

    def __init__(self, path: str, options: ReadOptions):
        self.path = path
        self.opt = options
        self.report = LoadReport()
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.lines: list[int] = []
        self._bad: list[tuple[int, str, str]] = []

    def bad(self, line: int, kind: str, reason: str) -> None:
        self._bad.append((line, kind, reason))

    @property
    def failed(self) -> bool:
        return self.opt.on_bad_record == "fail" and bool(self._bad)

    def failure(self) -> str:
        line, _kind, reason = min(self._bad, key=lambda b: b[0])
        return f"{BadRecord(self.path, line, reason)} (on_bad_record=fail; use on_bad_record=skip to count and skip such records)"

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

    def result(self) -> dict[str, Any]:
        for line, kind, reason in sorted(self._bad, key=lambda b: b[0]):
            self.report.bad += 1
            self.report.bad_by_reason[kind] = self.report.bad_by_reason.get(kind, 0) + 1
            if len(self.report.bad_records) < MAX_LISTED_BAD:
                self.report.bad_records.append(BadRecord(self.path, line, reason))
        sizes = np.fromiter((a.size for a in self.ids), dtype=np.int64, count=len(self.ids))
        return {
            "ids": np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32),
            "mask": np.concatenate(self.masks) if self.masks else np.zeros(0, np.uint8),
            "lengths": sizes,
            "lines": np.asarray(self.lines, dtype=np.int64),
            "report": self.report,
            "failure": None,
        }


class ChatEncoder:
    """Renders, masks and tokenizes conversations in batches; the tokenizer's Rust backend is called directly
    when it gives the transformers call's ids and offsets (checked on the first texts)."""

    def __init__(self, tokenizer: Any, options: ReadOptions, path: str = "input"):
        if not getattr(tokenizer, "is_fast", False):
            raise DataError("chat loss masks need a fast tokenizer (offset mapping); got a slow tokenizer")
        self.tokenizer = tokenizer
        self.template = options.chat_template or getattr(tokenizer, "chat_template", None)
        if not self.template:
            raise DataError(f"{path}: the tokenizer has no chat template and ReadOptions.chat_template is not set")
        self.kwargs = dict(options.template_kwargs)
        try:
            self.info = chat.probe_template(tokenizer, chat_template=self.template, template_kwargs=self.kwargs)
        except chat.ChatTemplateError as exc:
            raise DataError(f"chat template unusable for loss masks: {exc}") from exc
        self.vocab = options.vocab_size or len(tokenizer)
        self._backend: Any = None
        self._checked = False

    def _fast_backend(self):
        from tokenizers import Tokenizer

        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        try:
            copy = Tokenizer.from_str(backend.to_str())  # never change the caller's tokenizer
            copy.no_truncation()
            copy.no_padding()
            copy.encode_special_tokens = bool(getattr(self.tokenizer, "split_special_tokens", False))
        except Exception:  # noqa: BLE001 - an older or unusual backend: the transformers call it is
            return None
        return copy

    def _slow(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        enc = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [(np.asarray(i, dtype=np.int64), np.asarray(o, dtype=np.int64)) for i, o in
                zip(enc["input_ids"], enc["offset_mapping"], strict=True)]

    @staticmethod
    def _fast(backend, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        chain = itertools.chain.from_iterable
        return [(np.array(e.ids, dtype=np.int64),
                 np.fromiter(chain(e.offsets), dtype=np.int64, count=2 * len(e.ids)).reshape(len(e.ids), 2))
                for e in backend.encode_batch(texts, add_special_tokens=False)]

    def encode(self, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """(ids int64 [n], offsets int64 [n, 2]) per text."""
        if not self._checked:
            self._checked = True
            backend = self._fast_backend()
            if backend is not None:
                probe = texts[:4]
                same = all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1].reshape(-1, 2))
                           for a, b in zip(self._fast(backend, probe), self._slow(probe), strict=True))
                self._backend = backend if same else None
        return self._slow(texts) if self._backend is None else self._fast(self._backend, texts)

    def process(self, records: Iterator[tuple[int, dict]], col: ChunkCollector) -> None:
        pending: list[tuple[int, str, list[tuple[int, int]]]] = []

        def flush() -> None:
            if not pending:
                return
            for (line, _text, spans), (ids, offs) in zip(pending, self.encode([p[1] for p in pending]), strict=True):
                mask = chat.token_mask(offs, spans)
                if ids.size and int(ids.max()) >= self.vocab:
                    col.bad(line, "out_of_vocab", f"token id {int(ids.max())} >= vocab size {self.vocab}")
                    continue
                col.offer(line, ids, mask)
            pending.clear()

        for line, obj in records:
            if isinstance(obj, dict) and obj.get("finish_reason") == "error":  # `regenerate` wrote no reply
                col.bad(line, "regenerate_error", f"a row regenerate could not answer ({obj.get('error', 'no reply')}); "
                        "`dflash-flow regenerate --retry-errors` tries it again")
                continue
            msgs, kind, reason = chat.parse_conversation(obj)
            if msgs is None:
                col.bad(line, kind, reason)
                continue
            try:
                text = chat.render_chat(self.tokenizer, msgs, chat_template=self.template, template_kwargs=self.kwargs)
                spans = chat.supervised_spans(text, msgs, self.info)
            except chat.ChatTemplateError as exc:
                col.bad(line, "template", str(exc))
                continue
            if not spans:
                col.bad(line, "no_supervised", "no assistant turn with content: nothing to supervise")
                continue
            pending.append((line, text, spans))
            if len(pending) >= _TOKENIZE_BATCH:
                flush()
        flush()


def _offer_checked(col: ChunkCollector, line: int, ids: np.ndarray, mask: np.ndarray) -> None:
    """Offer a pre-tokenized sample, or report why not: ids checked in their own integer type (any width, signed
    or not), so that the int32 cast that follows can never wrap a value."""
    vocab_size = col.opt.vocab_size
    if ids.size != mask.size:
        return col.bad(line, "length_mismatch", f"input_ids has {ids.size} tokens but loss_mask has {mask.size}")
    if ids.size == 0:
        return col.bad(line, "empty", "input_ids is empty")
    lo, hi = int(ids.min()), int(ids.max())
    limit = min(vocab_size, ID_LIMIT) if vocab_size is not None else ID_LIMIT
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        pos = int(np.flatnonzero(ids == bad)[0])
        if vocab_size is not None:
            return col.bad(line, "out_of_vocab", f"input_ids[{pos}] = {bad} is outside the vocabulary [0, {vocab_size})")
        return col.bad(line, "out_of_vocab", f"input_ids[{pos}] = {bad} is not a token id (ids must be in [0, 2**31); "
                       "set vocab_size to check them against the vocabulary)")
    if mask.size and (int(mask.min()) < 0 or int(mask.max()) > 1):
        return col.bad(line, "bad_mask", "loss_mask values must be 0 or 1")
    col.offer(line, ids.astype(np.int64), mask.astype(np.uint8))


def _int_list(value: Any, *, bools: bool) -> bool:
    """A flat JSON list of integers (``true``/``false`` only where ``bools``: a loss mask)."""
    return isinstance(value, list) and all(type(x) is int or (bools and type(x) is bool) for x in value)


def _parse_line(no: int, raw: bytes, col: ChunkCollector) -> dict | None:
    """The line's object, or None after reporting a line that is not UTF-8 or not a JSON object."""
    col.report.records += 1
    try:
        text = raw.decode("utf-8-sig" if no == 1 else "utf-8")  # tolerate a byte-order mark
    except UnicodeDecodeError as exc:
        col.bad(no, "not_utf8", f"not valid UTF-8 (byte {exc.start}: {raw[exc.start : exc.start + 1]!r})")
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        if not raw.endswith(b"\n"):  # only the last line of a file can lack its newline
            col.bad(no, "truncated", f"file ends inside this record (truncated file?): {exc.msg} at column {exc.colno}")
        else:
            col.bad(no, "invalid_json", f"invalid JSON: {exc.msg} at column {exc.colno}")
        return None
    except (ValueError, RecursionError) as exc:  # e.g. a 5000-digit number, arrays nested 100000 deep
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        col.bad(no, "invalid_json", f"invalid JSON: {first}")
        return None
    if not isinstance(obj, dict):
        col.bad(no, "not_object", f"expected a JSON object, got {type(obj).__name__}")
        return None
    return obj


def _json_records(lines, col: ChunkCollector) -> Iterator[tuple[int, dict]]:
    limit = col.opt.max_record_bytes
    size_text = f"{limit / 2**20:.0f} MiB" if limit >= 2**20 else f"{limit} bytes"
    for no, raw, size in lines:
        if col.failed:
            return
        if raw is None:
            col.report.records += 1
            col.bad(no, "too_long", f"record of {size} bytes is longer than max_record_bytes={limit} ({size_text}); "
                    "raise max_record_bytes or split the record")
            continue
        if not raw.strip():
            continue
        obj = _parse_line(no, raw, col)
        if obj is not None:
            yield no, obj


def _drop_nulls(value: Any) -> Any:
    """Arrow structs hold every field of the unified schema, absent ones as null: drop those, so a record
    reads the same from Parquet or a `datasets` directory as from the JSONL it was made from."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _arrow_chat_records(first_row: int, batch, col: ChunkCollector) -> Iterator[tuple[int, dict]]:
    key = "conversations" if "conversations" in batch.schema.names else "messages"
    for i, turns in enumerate(batch.column(key).to_pylist()):
        if col.failed:
            return
        col.report.records += 1
        yield first_row + i, {key: _drop_nulls(turns) if turns is not None else None}


def _token_json(records: Iterator[tuple[int, dict]], col: ChunkCollector) -> None:
    for line, obj in records:
        missing = [k for k in ("input_ids", "loss_mask") if k not in obj]
        if missing:
            col.bad(line, "missing_field", f"missing field {missing[0]!r}")
            continue
        raw_ids, raw_mask = obj["input_ids"], obj["loss_mask"]
        if not _int_list(raw_ids, bools=False) or not _int_list(raw_mask, bools=True):
            col.bad(line, "bad_type", "input_ids/loss_mask must be flat lists of integers")
            continue
        # JSON integers have no width: one past int64 would turn the whole array into floats or objects.
        wide = next((i for i, x in enumerate(raw_ids) if not INT64_MIN <= x <= INT64_MAX), None)
        if wide is not None:
            col.bad(line, "out_of_vocab", f"input_ids[{wide}] = {raw_ids[wide]} is not a token id (ids must be in [0, 2**31))")
            continue
        ids = np.asarray(raw_ids, dtype=np.int64)
        mask = np.asarray([int(m) if 0 <= m <= 1 else 2 for m in raw_mask], dtype=np.int64)
        _offer_checked(col, line, ids, mask)


def _flat_lists(column) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(offsets, values, valid) of a list column of integers, as numpy (no object per row); None for any
    other column (read row by row, with the row's own error)."""
    import pyarrow as pa

    t = column.type
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not (
        pa.types.is_integer(t.value_type) or pa.types.is_boolean(t.value_type)
    ):
        return None
    if column.offset != 0:
        column = pa.concat_arrays([column])  # rebase a sliced array: offsets then start at its own values
    offsets = np.asarray(column.offsets.to_numpy(zero_copy_only=False), dtype=np.int64)
    values = column.values.to_numpy(zero_copy_only=False)
    valid = ~np.asarray(column.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    return offsets, np.asarray(values), valid


def _token_rows(first_row: int, batch, col: ChunkCollector) -> None:
    ids_col, mask_col = batch.column("input_ids"), batch.column("loss_mask")
    flat_ids, flat_mask = _flat_lists(ids_col), _flat_lists(mask_col)
    flat = flat_ids is not None and flat_mask is not None
    if flat:
        (io, iv, ivalid), (mo, mv, mvalid) = flat_ids, flat_mask
    for i in range(batch.num_rows):
        if col.failed:
            return
        row = first_row + i
        col.report.records += 1
        if not (ivalid[i] and mvalid[i] if flat else ids_col[i].is_valid and mask_col[i].is_valid):
            col.bad(row, "missing_field", "null input_ids or loss_mask")
            continue
        if flat:
            _offer_checked(col, row, iv[io[i] : io[i + 1]], mv[mo[i] : mo[i + 1]])
            continue
        ids_v, mask_v = ids_col[i], mask_col[i]
        try:
            ids = np.asarray(ids_v.values.to_numpy(zero_copy_only=False))
            mask = np.asarray(mask_v.values.to_numpy(zero_copy_only=False))
        except AttributeError:
            col.bad(row, "bad_type", "input_ids/loss_mask must be list columns")
            continue
        if ids.size and ids.dtype.kind not in "iu":
            col.bad(row, "bad_type", f"input_ids must be integers, got {ids.dtype}")
            continue
        if mask.size and mask.dtype.kind not in "iub":
            col.bad(row, "bad_type", f"loss_mask must be integers, got {mask.dtype}")
            continue
        _offer_checked(col, row, ids, mask)


def process_chunk(chunk: tuple, *, path: str, kind: str, options: ReadOptions, encoder: ChatEncoder | None) -> dict[str, Any]:
    """The kept samples and report of one chunk; in fail mode ``failure`` holds its first bad line's message."""
    col = ChunkCollector(path, options)
    if chunk[0] == "lines":
        records = _json_records(chunk[1], col)
    elif kind == "chat":
        records = _arrow_chat_records(chunk[1], chunk[2], col)
    else:
        records = None
        _token_rows(chunk[1], chunk[2], col)
    # The record generators stop at the first bad record in fail mode (the encoder then flushes what it
    # holds, so that an earlier line failing at tokenization is still the one reported).
    if kind == "chat":
        encoder.process(records, col)
    elif records is not None:
        _token_json(records, col)
    if col.failed:
        return {"failure": col.failure(), "report": col.report}
    return col.result()


_WORKER: dict[str, Any] = {}


def init_worker(payload: bytes) -> None:
    """Pool initializer: the tokenizer (pickled), options, kind and path of the input being read."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process per core already
    state = pickle.loads(payload)  # noqa: S301 - our own parent process wrote it
    tok = state.pop("tokenizer")
    state["encoder"] = ChatEncoder(tok, state["options"], state["path"]) if tok is not None else None
    _WORKER.clear()
    _WORKER.update(state)


def work(chunk: tuple) -> dict[str, Any]:
    return process_chunk(chunk, path=_WORKER["path"], kind=_WORKER["kind"], options=_WORKER["options"],
                         encoder=_WORKER["encoder"])
