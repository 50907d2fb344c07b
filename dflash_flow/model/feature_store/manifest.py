"""The store directory: its lock, its manifest (created, checked against an identity, merged from the shards
on disk), the shards found there, and the identity (what the features depend on: target, layers, tokenizer,
template, the samples' tokens), compared field by field and digested."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dflash_flow.model.feature_store.format import (
    FORMAT,
    INDEX,
    LOCK,
    MANIFEST,
    MERGED_DTYPE,
    RANKS,
    REOPEN,
    SHARDS,
    SUFFIX,
    VERSION,
    Codec,
    FeatureStoreError,
    Shard,
    ShardInfo,
    StoreMismatch,
    id_ranges,
)
from dflash_flow.util import atomic_write_bytes, atomic_write_text, blake2b_file, config_hash, fsync_dir

log = logging.getLogger(__name__)


class StoreLock:
    """The store's ``flock``: exclusive for a build, shared for hybrid writers; the kernel drops it when its
    process dies. Who holds it is in ``.lock.owner``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._fd: int | None = None

    @property
    def owner_path(self) -> Path:
        return self.root / (LOCK + ".owner")

    def owner(self) -> str:
        try:
            o = json.loads(self.owner_path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(o["time"]))
            return f"{o.get('what', 'a builder')} (pid {o['pid']} on {o['host']}, since {since})"
        except (OSError, ValueError, KeyError, TypeError):
            return "another process"

    def acquire(self, *, exclusive: bool, wait_s: float = 0.0, what: str = "a build",
                on_wait: Callable[[str, float], None] | None = None, poll_s: float = 0.5) -> None:
        """Take the lock, waiting up to ``wait_s`` seconds; else FeatureStoreError naming the holder."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        start = time.monotonic()
        mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                waited = time.monotonic() - start
                if waited >= wait_s:
                    os.close(fd)
                    held = self.owner()
                    raise FeatureStoreError(
                        f"feature store {self.root} is locked by {held}: one build at a time (wait for it, "
                        "pass --wait to wait, or build into another path)") from None
                if on_wait is not None:
                    on_wait(self.owner(), waited)
                time.sleep(min(poll_s, max(wait_s - waited, 0.01)))
        self._fd = fd
        if exclusive:
            note = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(), "what": what}
            with contextlib.suppress(OSError):
                atomic_write_text(self.owner_path, json.dumps(note), durable=False)

    def try_exclusive(self) -> bool:
        """Turn a held shared lock exclusive if nobody else holds it (without waiting)."""
        assert self._fd is not None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            return False

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> StoreLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        text = (root / MANIFEST).read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FeatureStoreError(f"feature store {root}: cannot read {MANIFEST}: {exc.strerror or exc}") from exc
    try:
        m = json.loads(text)
    except ValueError as exc:
        raise FeatureStoreError(f"feature store {root}: {MANIFEST} is not valid JSON ({exc}): {REOPEN}") from exc
    if m.get("format") != FORMAT:
        raise FeatureStoreError(f"{root} is not a feature store ({MANIFEST} has format {m.get('format')!r})")
    if m.get("version") != VERSION:
        raise FeatureStoreError(f"feature store {root} has version {m.get('version')!r}; this dflash-flow reads {VERSION}")
    return m


def shard_names(root: Path) -> list[str]:
    try:
        return sorted(p.name for p in (root / SHARDS).iterdir() if p.name.endswith(SUFFIX) and not p.name.startswith("."))
    except FileNotFoundError:
        return []


def scan_shards(root: Path, digest: str | None, *, remove_damaged: bool) -> tuple[list[Shard], list[str]]:
    """Every valid shard on disk (opened) and the damaged ones (removed when asked)."""
    shards, damaged = [], []
    for name in shard_names(root):
        try:
            s = Shard(root / SHARDS / name)
        except FeatureStoreError as exc:
            damaged.append(f"{SHARDS}/{name}")
            log.warning("%s", exc)
            if remove_damaged:
                (root / SHARDS / name).unlink(missing_ok=True)
            continue
        if digest and s.meta.get("identity") != digest:
            s.close()
            raise FeatureStoreError(f"shard {s.path} was written for another identity than {root}/{MANIFEST} (a "
                                    "manifest replaced by hand?): delete the store and build it again")
        shards.append(s)
    return shards, damaged


def _recorded_digests(root: Path, manifest: Mapping[str, Any] | None) -> dict[str, str]:
    """Shard digests recorded by the builders (``ranks/*.json``) and by an earlier manifest."""
    out = {}
    for s in (manifest or {}).get("shards", []):
        if s.get("blake2b"):
            out[s["file"]] = s["blake2b"]
    with contextlib.suppress(FileNotFoundError):
        for p in sorted((root / RANKS).glob("*.json")):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                for s in json.loads(p.read_text())["shards"]:
                    if s.get("blake2b"):
                        out[s["file"]] = s["blake2b"]
    return out


def write_json(path: Path, obj: Any, durable: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=True) + "\n", durable=durable)


def open_for_writing(root: Path, *, identity: Mapping[str, Any], codec: Codec, width: int,
                     expected_samples: int | None = None, expected_tokens: int | None = None,
                     compute_dtype: str | None = None, vocab_size: int | None = None) -> dict[str, Any]:
    """The manifest of a store about to be written: created, or checked for the same identity, dtype and width."""
    root.mkdir(parents=True, exist_ok=True)
    (root / SHARDS).mkdir(exist_ok=True)
    (root / RANKS).mkdir(exist_ok=True)
    m = read_manifest(root)
    if m is None:
        if shard_names(root):
            raise FeatureStoreError(f"{root}/{SHARDS} holds shards but {root} has no {MANIFEST}: delete the directory "
                                    "and build again")
        m = {"format": FORMAT, "version": VERSION, "identity": dict(identity), "identity_digest": identity_digest(identity),
             "dtype": codec.name, "width": int(width), "bytes_per_token": codec.bytes_per_token(width),
             "compute_dtype": compute_dtype, "vocab_size": vocab_size, "expected_samples": expected_samples,
             "expected_tokens": expected_tokens, "complete": False, "samples": 0, "tokens": 0, "bytes": 0, "shards": [],
             "created": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}}
        write_json(root / MANIFEST, m)
        fsync_dir(root)
        return m
    fields = compare_identity(m["identity"], identity)
    if m["dtype"] != codec.name:
        fields.append(("dtype", m["dtype"], codec.name))
    if int(m["width"]) != int(width):
        fields.append(("width", m["width"], width))
    if fields:
        raise StoreMismatch(root, fields)
    fill_unknown(m["identity"], identity)
    if expected_samples is not None:
        m["expected_samples"], m["expected_tokens"] = expected_samples, expected_tokens
    for key, value in (("vocab_size", vocab_size), ("compute_dtype", compute_dtype)):
        if m.get(key) is None and value is not None:
            m[key] = value
    return m


def merged_rows(index: np.ndarray, k: int) -> np.ndarray:
    """A shard's index rows as rows of the merged index (the shard's number ``k`` in ``shard``)."""
    part = np.zeros(len(index), MERGED_DTYPE)
    for f in ("sid", "length", "offset", "crc", "tokens"):
        part[f] = index[f]
    part["shard"] = k
    return part


def first_of_each(parts: list[np.ndarray]) -> tuple[np.ndarray, int]:
    """Merged index rows sorted by sample id, the first copy of a sample kept; and how many copies were dropped."""
    loc = np.concatenate(parts) if parts else np.zeros(0, MERGED_DTYPE)
    loc = loc[np.argsort(loc["sid"], kind="stable")]
    keep = np.ones(loc.size, bool)
    keep[1:] = loc["sid"][1:] != loc["sid"][:-1]
    return loc[keep], int((~keep).sum())


def merge_store(root: str | os.PathLike, *, expected: Iterable[int] | None = None) -> dict[str, Any]:
    """Every valid shard on disk into the merged index and the manifest (complete when every ``expected`` id,
    or else ``expected_samples`` many, are there); returns the manifest. Needs the lock."""
    root = Path(root)
    m = read_manifest(root)
    if m is None:
        raise FeatureStoreError(f"{root} is not a feature store (no {MANIFEST})")
    shards, _ = scan_shards(root, m.get("identity_digest"), remove_damaged=False)
    digests = _recorded_digests(root, m)
    parts, infos = [], []
    for k, s in enumerate(shards):
        rel = f"{SHARDS}/{s.path.name}"
        parts.append(merged_rows(s.index, k))
        infos.append(ShardInfo(file=rel, bytes=s.size, samples=len(s.index), tokens=int(s.index["length"].sum()),
                               ids=id_ranges(s.index["sid"].tolist()), blake2b=digests.get(rel) or blake2b_file(s.path)))
        s.close()
    loc, duplicates = first_of_each(parts)
    data = loc.tobytes()
    atomic_write_bytes(root / INDEX, data)
    have = set(loc["sid"].tolist())
    if expected is not None:
        want = {int(i) for i in expected}
        complete = want <= have
        m["expected_samples"] = len(want)
    else:
        complete = m.get("expected_samples") is not None and len(have) >= int(m["expected_samples"])
    m.update({
        "shards": [i.to_json() for i in infos], "samples": int(loc.size), "tokens": int(loc["length"].sum()),
        "bytes": int(sum(i.bytes for i in infos)), "index_blake2b": hashlib.blake2b(data, digest_size=20).hexdigest(),
        "complete": bool(complete), "duplicates": duplicates,
        "merged": {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()},
    })
    write_json(root / MANIFEST, m)
    fsync_dir(root)
    return m


def remove_leftovers(root: Path) -> int:
    """Temporary files of writers that died (call with the exclusive lock held)."""
    n = 0
    for d in (root / SHARDS, root / RANKS, root):
        with contextlib.suppress(FileNotFoundError):
            for p in d.iterdir():
                if p.name.startswith(".") and p.name.endswith(".tmp"):
                    p.unlink(missing_ok=True)
                    n += 1
    return n


def flatten_identity(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """An identity as dotted fields (``target.weights``); ``template_kwargs`` stays one field."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and k != "template_kwargs":
            out.update(flatten_identity(v, name + "."))
        else:
            out[name] = v
    return out


def compare_identity(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, stored, expected) for every dotted field known on both sides (not None) whose values differ."""
    s, e = flatten_identity(stored), flatten_identity(expected)
    return [(k, s.get(k), v) for k, v in sorted(e.items())
            if v is not None and s.get(k) is not None and _norm(s.get(k)) != _norm(v)]


def fill_unknown(stored: dict[str, Any], expected: Mapping[str, Any]) -> bool:
    """Record in ``stored`` the fields of ``expected`` it did not know; whether any was added."""
    added = False
    for k, v in expected.items():
        if isinstance(v, Mapping) and k != "template_kwargs" and isinstance(stored.get(k), dict):
            added |= fill_unknown(stored[k], v)
        elif stored.get(k) is None and v is not None:
            stored[k] = _norm(v)
            added = True
    return added


def _norm(v: Any) -> Any:
    return json.loads(json.dumps(v, sort_keys=True, default=str))


def identity_digest(identity: Mapping[str, Any]) -> str:
    return config_hash(_norm(identity))


def corpus_digest(sample_ids: Sequence[int], lengths: Sequence[int], digests: Sequence[int]) -> str:
    """The samples' identity: every (id, length, token digest), in id order."""
    order = np.argsort(np.asarray(sample_ids, dtype=np.int64), kind="stable")
    table = np.stack([np.asarray(sample_ids, dtype=np.int64)[order].astype("<u8"),
                      np.asarray(lengths, dtype=np.int64)[order].astype("<u8"),
                      np.asarray(digests, dtype=np.uint64)[order].astype("<u8")], axis=1)
    return hashlib.blake2b(np.ascontiguousarray(table).tobytes(), digest_size=16).hexdigest()
