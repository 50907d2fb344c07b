"""What reading records produces and reports: options, bad records, load reports, tokenized files (the types
every reader module shares; ``records`` is the public entry point and re-exports them)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import attrs
import numpy as np

from dflash_flow.items import Sample

__all__ = ["BadRecord", "DataError", "LoadReport", "ReadOptions", "TokenizedFile", "MAX_LISTED_BAD",
           "DEFAULT_MAX_RECORD_BYTES"]

MAX_LISTED_BAD = 100
#: Longest JSONL record (one line) read by default. A line is read at most this far into memory; a longer
#: one is a bad record (file:line), skipped to its end in small chunks, never loaded whole.
DEFAULT_MAX_RECORD_BYTES = 64 * 2**20


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
    """Options shared by all readers. All but ``cache_dir`` and ``num_workers`` (which change where and how
    fast, never what) are part of the cache key."""

    max_length: int = attrs.field(default=3072, validator=attrs.validators.ge(2))
    overflow: Literal["truncate", "drop"] = attrs.field(default="truncate", validator=attrs.validators.in_(("truncate", "drop")))
    on_bad_record: Literal["skip", "fail"] = attrs.field(default="skip", validator=attrs.validators.in_(("skip", "fail")))
    # DFlash anchors need two consecutive supervised tokens; 2 * block_size is what TorchSpec requires.
    min_loss_tokens: int = attrs.field(default=1, validator=attrs.validators.ge(1))
    max_record_bytes: int = attrs.field(default=DEFAULT_MAX_RECORD_BYTES, validator=attrs.validators.ge(1))
    vocab_size: int | None = None  # pre-tokenized ids must be < vocab_size (chat: taken from the tokenizer)
    chat_template: str | None = None  # overrides the tokenizer's own template
    template_kwargs: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    cache_dir: Path | None = attrs.field(default=None, converter=lambda v: None if v is None else Path(v))
    # Tokenizing processes: None = every core this process may use, for inputs large enough to be worth
    # starting them (a few MiB); 0 or 1 = in this process.
    num_workers: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.ge(0)))


_COUNTS = ("records", "samples", "tokens", "supervised_tokens", "truncated", "dropped_overlong", "too_few_supervised",
           "bad")


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
    bad_records: list[BadRecord] = attrs.field(factory=list)  # the first MAX_LISTED_BAD
    from_cache: bool = False

    def merge(self, other: LoadReport) -> None:
        self.files += other.files
        for f in _COUNTS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.bad_by_reason.items():
            self.bad_by_reason[k] = self.bad_by_reason.get(k, 0) + v
        room = MAX_LISTED_BAD - len(self.bad_records)
        self.bad_records += other.bad_records[: max(room, 0)]
        self.from_cache = self.from_cache and other.from_cache

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
        return Sample(sample_id=sample_id, input_ids=self.ids[a:b], loss_mask=self.mask[a:b],
                      source=f"{self.path}:{int(self.lines[i])}")
