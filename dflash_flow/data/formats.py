"""The formats training records are held in, read as `parse` chunks: JSONL (plain or
``.gz``/``.bz2``/``.xz``/``.zst``, at most ``max_record_bytes`` of a line in memory), Parquet by record batch,
and Arrow IPC files or ``datasets`` directories, memory-mapped."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import attrs

from .parse import read_lines
from .reports import DEFAULT_MAX_RECORD_BYTES, DataError

__all__ = ["InputFormat", "check_input", "data_files_of", "detect", "iter_chunks", "iter_rows", "sniff_kind"]

COMPRESSED = {".gz": "gzip", ".bz2": "bz2", ".xz": "lzma", ".zst": "zstd", ".zstd": "zstd"}
ARROW = (".arrow", ".feather", ".ipc")
PARQUET = (".parquet", ".pq")
CHUNK_RECORDS = 256
CHUNK_BYTES = 4 * 2**20
CHUNK_ROWS = 256


@attrs.define(frozen=True)
class InputFormat:
    kind: Literal["jsonl", "parquet", "arrow", "hf"]
    compression: str | None = None


def check_input(path: Path) -> None:
    if not path.exists():
        raise DataError(f"{path}: no such file")
    if path.is_dir():
        detect(path)  # a datasets directory, or a clear error
        return
    if not path.is_file():
        raise DataError(f"{path}: not a regular file")
    if path.stat().st_size == 0:
        with open(path, "rb") as f:
            if f.read(1):  # /proc and the like: a size of 0, content that changes as it is read
                raise DataError(f"{path}: says its size is 0 but is not empty (a /proc or other special file?); "
                                "copy it into a regular file and read that")
        raise DataError(f"{path}: file is empty")


def detect(path: Path) -> InputFormat:
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            try:
                splits = json.loads((path / "dataset_dict.json").read_text()).get("splits")
            except (OSError, ValueError, AttributeError):
                splits = None
            raise DataError(f"{path}: a datasets DatasetDict (splits {splits}); give one split's directory, e.g. "
                            f"{path / (splits[0] if splits else 'train')}")
        if not (path / "state.json").is_file():
            raise DataError(f"{path}: a directory, but not one written by datasets' save_to_disk (no state.json)")
        return InputFormat("hf")
    suffix = path.suffix.lower()
    if suffix in ARROW:
        return InputFormat("arrow")
    if suffix in PARQUET:
        return InputFormat("parquet")
    if suffix in COMPRESSED:
        return InputFormat("jsonl", COMPRESSED[suffix])
    return InputFormat("jsonl")


def data_files_of(path: Path) -> list[Path]:
    """The files whose content is the input's: the file itself, or a datasets directory's Arrow files."""
    if not path.is_dir():
        return [path]
    try:
        state = json.loads((path / "state.json").read_text())
        names = [d["filename"] for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}/state.json: not a datasets state file ({type(exc).__name__}: {exc})") from None
    files = []
    for name in names:
        f = (path / name).resolve()
        if f.parent != path.resolve() or not f.is_file():
            raise DataError(f"{path}/state.json names {name!r}, which is not a file of this directory")
        files.append(f)
    return files


def _open_stream(path: Path, fmt: InputFormat):
    if fmt.compression is None:
        return open(path, "rb")  # noqa: SIM115 - the caller closes it
    if fmt.compression in ("gzip", "bz2", "lzma"):
        return importlib.import_module(fmt.compression).open(path, "rb")
    try:
        import zstandard
    except ImportError:
        raise DataError(f"{path}: reading .zst files needs the zstandard package (pip install zstandard)") from None
    return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True)  # noqa: SIM115


def _stream_errors() -> tuple[type[BaseException], ...]:
    """What a damaged or truncated compressed stream raises (per codec)."""
    import lzma
    import zlib

    errors: tuple[type[BaseException], ...] = (OSError, EOFError, ValueError, lzma.LZMAError, zlib.error)
    try:
        import zstandard
    except ImportError:
        return errors
    return (*errors, zstandard.ZstdError)


def _tables(path: Path, fmt: InputFormat) -> Iterator[Any]:
    """pyarrow tables (memory-mapped) of an Arrow file or a datasets directory, in row order."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    for f in data_files_of(path) if fmt.kind == "hf" else [path]:
        errors = []
        for opener in (ipc.open_file, ipc.open_stream):
            try:
                with pa.memory_map(str(f)) as source:
                    table = opener(source).read_all()
                break
            except (pa.ArrowInvalid, OSError) as exc:
                errors.append(f"{opener.__name__}: {exc}")
        else:
            raise DataError(f"{f}: not a readable Arrow IPC file or stream (truncated or another format?): "
                            f"{'; '.join(errors)}")
        yield table


def _parquet_file(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(str(path))
        pf.schema_arrow  # noqa: B018 - an unconvertible schema fails here, inside our clear error
        return pf
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file: {exc}") from None


def _damaged(path: Path, no: int, exc: BaseException, fmt: InputFormat) -> DataError:
    return DataError(f"{path}: cannot read past line {no}: {type(exc).__name__}: {exc} (truncated or corrupt "
                     f"{fmt.compression or 'file'}?)")


def sniff_kind(path: Path, fmt: InputFormat, limit: int = DEFAULT_MAX_RECORD_BYTES) -> Literal["chat", "tokens"]:
    """Chat or pre-tokenized records: the columns, or the first JSONL record that tells."""
    if fmt.kind != "jsonl":
        names = (list(_parquet_file(path).schema_arrow.names) if fmt.kind == "parquet"
                 else next((list(t.column_names) for t in _tables(path, fmt)), []))
        if "input_ids" in names:
            return "tokens"
        if "conversations" in names or "messages" in names:
            return "chat"
        raise DataError(f"{path}: cannot tell the format: no column 'conversations', 'messages' or 'input_ids' "
                        f"(columns are {names})")
    no = 0
    try:
        with _open_stream(path, fmt) as f:
            for line_no, raw, _size in read_lines(f, limit):
                no = line_no  # for the message, should the stream break
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
    except DataError:
        raise
    except _stream_errors() as exc:  # a damaged compressed stream: the same DataError reading it gives
        raise _damaged(path, no, exc, fmt) from None
    raise DataError(f"{path}: cannot tell the format: no record has 'conversations', 'messages' or 'input_ids'")


def _needed_columns(path: Path, names: list[str], kind: str) -> list[str]:
    if kind == "tokens":
        missing = [c for c in ("input_ids", "loss_mask") if c not in names]
        if missing:
            raise DataError(f"{path}: missing column(s) {missing}; columns are {names}")
        return ["input_ids", "loss_mask"]
    for c in ("conversations", "messages"):
        if c in names:
            return [c]
    raise DataError(f"{path}: no 'conversations' or 'messages' column (a chat source reads chat records); "
                    f"columns are {names}")


@attrs.define
class Position:
    """How far the reading has come: bytes of the input (files) or rows (columnar), of a known total."""

    done: int = 0
    total: int = 0
    unit: str = "bytes"


def total_size(path: Path, fmt: InputFormat) -> Position:
    if fmt.kind == "parquet":
        import pyarrow.parquet as pq

        return Position(0, int(pq.ParquetFile(str(path)).metadata.num_rows), "rows")
    if fmt.kind in ("arrow", "hf"):
        return Position(0, sum(t.num_rows for t in _tables(path, fmt)), "rows")
    return Position(0, path.stat().st_size, "bytes")


def iter_chunks(path: Path, fmt: InputFormat, kind: str, *, max_record_bytes: int, position: Position) -> Iterator[tuple]:
    """The input's records as `parse` chunks, in order; ``position.done`` advances as they are read."""
    if fmt.kind == "jsonl":
        yield from _jsonl_chunks(path, fmt, max_record_bytes, position)
        return
    row = 1
    for batch in _batches(path, fmt, kind):
        yield ("rows", row, _compact(batch))
        row += batch.num_rows
        position.done = row - 1


def _batches(path: Path, fmt: InputFormat, kind: str | None = None) -> Iterator[Any]:
    """The record batches of a columnar input (with ``kind``: only the columns it needs)."""
    if fmt.kind == "parquet":
        pf = _parquet_file(path)
        columns = _needed_columns(path, list(pf.schema_arrow.names), kind) if kind else None
        return pf.iter_batches(batch_size=CHUNK_ROWS, columns=columns)
    return (b for t in _tables(path, fmt) for b in
            (t.select(_needed_columns(path, list(t.column_names), kind)) if kind else t).to_batches(max_chunksize=CHUNK_ROWS))


def _compact(batch):
    """A batch that owns only its rows' data: a slice of a memory-mapped table would otherwise be sent to a
    worker process with the whole table's buffers (pickling keeps a slice's parent buffers)."""
    import pyarrow as pa

    return pa.RecordBatch.from_arrays([pa.concat_arrays([c]) for c in batch.columns], schema=batch.schema)


def _jsonl_chunks(path: Path, fmt: InputFormat, limit: int, position: Position) -> Iterator[tuple]:
    seen_content = False
    try:
        f = _open_stream(path, fmt)
    except OSError as exc:
        raise DataError(f"{path}: cannot read: {exc}") from None
    with f:
        raw_file = getattr(f, "fileobj", None) or getattr(f, "_fp", None) or f
        lines: list[tuple[int, bytes | None, int]] = []
        size = 0
        no = 0
        try:
            for no, raw, n in read_lines(f, limit):
                if raw is None or raw.strip():
                    seen_content = True
                lines.append((no, raw, n))
                size += n if raw is not None else 0
                if len(lines) >= CHUNK_RECORDS or size >= CHUNK_BYTES:
                    _advance(position, raw_file)
                    yield ("lines", lines)
                    lines, size = [], 0
        except _stream_errors() as exc:  # a damaged compressed stream
            raise _damaged(path, no, exc, fmt) from None
        if lines:
            _advance(position, raw_file)
            yield ("lines", lines)
    position.done = position.total
    if not seen_content:
        raise DataError(f"{path}: file is empty")


def _advance(position: Position, f) -> None:
    with contextlib.suppress(OSError, ValueError, AttributeError):
        position.done = min(int(f.tell()), position.total)


def input_bytes(path: Path) -> int:
    return sum(os.path.getsize(f) for f in data_files_of(path))


def iter_rows(path: Path, *, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Iterator[tuple[str, Any]]:
    """Every record of any format as ``(location, record)`` in order (``"line N"``, ``"row N"``, ``"item N"``
    of a ``.json`` array); bad JSON or an over-long line raises ``DataError`` (``path:line``)."""
    path = Path(path)
    check_input(path)
    fmt = detect(path)
    if fmt.kind == "jsonl" and fmt.compression is None and path.suffix.lower() == ".json":
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
        if head.startswith(b"["):
            try:
                items = json.loads(path.read_bytes())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise DataError(f"{path}: not valid JSON ({exc})") from None
            for i, item in enumerate(items, 1):
                yield f"item {i}", item
            return
    if fmt.kind == "jsonl":
        with _open_stream(path, fmt) as f:
            for no, raw, _size in read_lines(f, max_record_bytes):
                if raw is None:
                    raise DataError(f"{path}:{no}: line longer than {max_record_bytes} bytes")
                if not raw.strip():
                    continue
                try:
                    yield f"line {no}", json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DataError(f"{path}:{no}: invalid JSON ({exc})") from None
        return
    row = 1
    for batch in _batches(path, fmt):
        for record in batch.to_pylist():
            yield f"row {row}", record
            row += 1
