"""Read training records: chat records (rendered and masked) and pre-tokenized ones, in any supported
format (`formats`: JSONL plain or compressed, Parquet, Arrow, a `datasets` directory).

* Chat records: ``{"conversations": [{"role", "content"}, ...]}`` (``"messages"`` and ShareGPT's
  ``{"from", "value"}`` are accepted too), rendered with the tokenizer's chat template; the loss mask is 1
  on the assistant tokens (`chat`).
* Pre-tokenized records: ``{"input_ids": [...], "loss_mask": [...]}``.

Every record that cannot be used is counted by reason and reported as ``file:line: reason`` (rows of
columnar inputs count from 1), in line order; with ``on_bad_record="fail"`` the first bad line raises
`DataError`. Over-long samples are truncated on the right or dropped (``overflow``); samples with fewer
than ``min_loss_tokens`` supervised tokens (after truncation) are dropped and counted; a record with no
supervised token at all is a bad record.

With ``cache_dir`` set, results live in the memory-mapped token store (`store`, built by `ingest`: on
every core, once per node) under a key that hashes the input's content, the tokenizer, the chat template
and every option that changes the result: a second run maps arrays instead of tokenizing again, and any
change invalidates the entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from dflash_flow.items import Sample

from .ingest import ReadProgress, read_input
from .keys import file_sha256, tokenizer_fingerprint
from .reports import DEFAULT_MAX_RECORD_BYTES, BadRecord, DataError, LoadReport, ReadOptions, TokenizedFile

__all__ = [
    "DEFAULT_MAX_RECORD_BYTES",
    "BadRecord",
    "DataError",
    "LoadReport",
    "ReadOptions",
    "ReadProgress",
    "TokenizedFile",
    "file_sha256",
    "load_samples",
    "read_chat_jsonl",
    "read_pretokenized_arrow",
    "read_pretokenized_jsonl",
    "read_records",
    "tokenizer_fingerprint",
]


def read_chat_jsonl(path: str | Path, tokenizer: Any, options: ReadOptions | None = None) -> TokenizedFile:
    """Render, tokenize and mask chat records (cached when ``options.cache_dir`` is set). Despite the
    name, any format of `formats` holding chat records reads."""
    return read_input(path, kind="chat", tokenizer=tokenizer, options=options)


def read_pretokenized_jsonl(path: str | Path, options: ReadOptions | None = None) -> TokenizedFile:
    """``{"input_ids": [...], "loss_mask": [...]}`` per line."""
    return read_input(path, kind="tokens", options=options)


def read_pretokenized_arrow(path: str | Path, options: ReadOptions | None = None) -> TokenizedFile:
    """Arrow IPC table (file or stream format) with list columns ``input_ids`` and ``loss_mask``; rows are
    reported 1-based."""
    return read_input(path, kind="tokens", options=options)


def read_records(
    path: str | Path,
    *,
    tokenizer: Any = None,
    options: ReadOptions | None = None,
    kind: Literal["auto", "chat", "tokens"] = "auto",
    progress: Any = None,
    should_stop: Any = None,
) -> TokenizedFile:
    """Read one input of any supported format (``kind="auto"`` looks at its columns or first record)."""
    return read_input(path, kind=kind, tokenizer=tokenizer, options=options, progress=progress,
                      should_stop=should_stop)


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
