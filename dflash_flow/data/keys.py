"""What a tokenized entry is keyed by: the input's content, the tokenizer's behaviour, every option.

Hashing a multi-GB corpus on every start would cost more than a warm start may, so a content digest is
remembered per version of the file -- its resolved path, device, inode, size, mtime and ctime, the last
of which every write changes and no user tool can set back -- in memory and on disk (``CACHE/digests``).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

from dflash_flow.util import atomic_write_text, cache_root, sha256_file

from .formats import data_files_of
from .reports import ReadOptions

__all__ = ["CACHE_VERSION", "cache_key", "file_sha256", "tokenizer_fingerprint"]

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
        if len(hit) != 64:
            hit = None
    except (OSError, ValueError):
        hit = None
    if hit is None:
        hit = sha256_file(real)
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(memo, hit)
        except OSError:
            pass  # a read-only cache: hash again next time
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
