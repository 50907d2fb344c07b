"""Building a store: rank 0 plans what is missing, every rank computes and writes its share, rank 0 merges."""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from dflash_flow.model.feature_store.format import (
    CODECS,
    MANIFEST,
    RANKS,
    SHARDS,
    SUFFIX,
    Codec,
    FeatureStoreError,
    Shard,
    ShardWriter,
    StoreMismatch,
    Write,
    estimate_bytes,
    token_digest,
)
from dflash_flow.model.feature_store.manifest import (
    StoreLock,
    corpus_digest,
    merge_store,
    open_for_writing,
    read_manifest,
    remove_leftovers,
    scan_shards,
    shard_names,
    write_json,
)

log = logging.getLogger(__name__)


_BUILT_NAME = re.compile(r"^g(\d+)-r(\d+)-(\d+)\.dfs$")


class LocalComm:
    """One process is the whole job: what the builder needs of a job's ranks (as ``app.distributed.Distributed``)."""

    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def barrier(self) -> None:
        return None


@attrs.define
class SampleIndex:
    """The samples a build covers: ids, lengths and each one's tokens (``fetch(position) -> 1-D ids``)."""

    sample_ids: np.ndarray
    lengths: np.ndarray
    fetch: Callable[[int], Any]

    def __len__(self) -> int:
        return int(len(self.sample_ids))


@attrs.define
class BuildProgress:
    """A rank's progress over its share (what the console shows: rate and ETA)."""

    samples: int
    total_samples: int
    tokens: int
    total_tokens: int
    bytes: int
    elapsed_s: float
    shards: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        rate = self.tokens_per_s
        return (self.total_tokens - self.tokens) / rate if rate > 0 else None


@attrs.define
class BuildResult:
    path: Path
    samples: int  # in the store
    tokens: int
    bytes: int
    computed: int  # samples this build computed (all ranks)
    reused: int  # samples already there
    complete: bool
    estimate_bytes: int  # what the missing samples were estimated to take
    free_bytes: int
    seconds: float
    removed: list[str] = attrs.field(factory=list)  # damaged shards set aside


Compute = Callable[[list[tuple[int, Any]]], list[torch.Tensor]]


def _split_by_tokens(lengths: np.ndarray, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous [start, end) slices of about equal token sums."""
    if parts <= 1:
        return [(0, int(lengths.size))]
    cum = np.concatenate([[0], np.cumsum(lengths)])
    cuts = [0] + [int(np.searchsorted(cum, cum[-1] * k / parts, side="left")) for k in range(1, parts)] + [int(lengths.size)]
    cuts = np.maximum.accumulate(np.asarray(cuts))
    return [(int(cuts[k]), int(cuts[k + 1])) for k in range(parts)]


def _cut_shards(lengths: np.ndarray, bytes_per_token: int, shard_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) runs of rows of about ``shard_bytes`` each (at least one row)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(lengths.tolist()):
        acc += int(n) * bytes_per_token
        if acc >= shard_bytes:
            out.append((start, i + 1))
            start, acc = i + 1, 0
    if start < lengths.size:
        out.append((start, int(lengths.size)))
    return out


def free_bytes(path: Path) -> int:
    p = Path(path)
    while not p.exists():
        p = p.parent
    return int(shutil.disk_usage(p).free)


def build_store(root: str | os.PathLike, *, identity: Mapping[str, Any], dtype: str, width: int, samples: SampleIndex,
                compute: Compute, comm: Any = None, shard_bytes: int = 2**30, margin_bytes: int = 2**30,
                rows_per_call: int = 1, wait_s: float = 0.0, compute_dtype: str | None = None,
                vocab_size: int | None = None, on_estimate: Callable[[int, int, int, int], None] | None = None,
                on_wait: Callable[[str, float], None] | None = None,
                progress: Callable[[BuildProgress], None] | None = None, should_stop: Callable[[], bool] | None = None,
                write: Write | None = None) -> BuildResult:
    """Compute and write the features of every sample the store lacks; resumable, every rank calls it alike.

    ``compute(batch)``: ``[(sid, token ids)] -> [features [L, F]]``. Rank 0 takes the lock, plans (:func:`_plan`)
    and at the end merges; an error on any rank ends the build on all of them, the finished shards kept.
    """
    comm = comm or LocalComm()
    root = Path(root)
    c = CODECS[dtype]
    t0 = time.monotonic()
    lock = StoreLock(root)
    ids = np.asarray(samples.sample_ids, dtype=np.int64)
    lengths = np.asarray(samples.lengths, dtype=np.int64)
    if np.unique(ids).size != ids.size:
        raise FeatureStoreError("the samples to store have duplicate ids")
    plan: dict[str, Any] | str
    if comm.rank == 0:
        try:
            lock.acquire(exclusive=True, wait_s=wait_s, what="dflash-flow features build", on_wait=on_wait)
            plan = _plan(root, identity, c, width, ids, lengths, samples, margin_bytes=margin_bytes,
                         compute_dtype=compute_dtype, vocab_size=vocab_size, on_estimate=on_estimate)
        except BaseException as exc:
            lock.release()
            plan = f"{exc}" if isinstance(exc, FeatureStoreError | OSError) else f"{type(exc).__name__}: {exc}"
            comm.all_gather_object(plan)
            raise
    plan = comm.all_gather_object(None if comm.rank else plan)[0]
    if isinstance(plan, str):
        if comm.rank == 0:
            raise FeatureStoreError(plan)
        raise FeatureStoreError(f"rank 0 refused the build: {plan}")
    try:
        return _build_share(root, plan, c, width, ids, lengths, samples, compute, comm, shard_bytes, rows_per_call,
                            progress, should_stop, write, t0)
    finally:
        lock.release()


def _plan(root: Path, identity: Mapping[str, Any], c: Codec, width: int, ids: np.ndarray, lengths: np.ndarray,
          samples: SampleIndex, *, margin_bytes: int, compute_dtype: str | None, vocab_size: int | None,
          on_estimate: Callable[[int, int, int, int], None] | None) -> dict[str, Any]:
    """Rank 0, the lock held: the manifest checked, leftovers and damaged shards removed, the samples still
    missing and the space they need (refused when it does not fit with ``margin_bytes`` to spare)."""
    digests = np.fromiter((token_digest(samples.fetch(i)) for i in range(len(ids))), dtype=np.uint64, count=len(ids))
    full_identity = {**identity, "tokens": corpus_digest(ids, lengths, digests)}
    m = open_for_writing(root, identity=full_identity, codec=c, width=width, expected_samples=int(ids.size),
                         expected_tokens=int(lengths.sum()), compute_dtype=compute_dtype, vocab_size=vocab_size)
    write_json(root / MANIFEST, m)
    remove_leftovers(root)
    shards, removed = scan_shards(root, m["identity_digest"], remove_damaged=True)
    listed = {s["file"] for s in m.get("shards", [])}
    on_disk = {f"{SHARDS}/{s.path.name}" for s in shards} | set(removed)
    gone = sorted(listed - on_disk)
    for name in gone:
        log.warning("shard %s of %s is missing: its samples are computed again", name, root)
    pos = {int(s): i for i, s in enumerate(ids.tolist())}
    done = _stored_samples(root, shards, pos, digests)
    todo = np.asarray(sorted(set(pos) - done), dtype=np.int64)
    todo_len = lengths[[pos[int(s)] for s in todo]] if todo.size else np.zeros(0, np.int64)
    need = estimate_bytes(int(todo_len.sum()), int(todo.size), width, c.name)
    free = free_bytes(root)
    if on_estimate is not None:
        on_estimate(need, free, int(todo_len.sum()), int(todo.size))
    if todo.size and need + margin_bytes > free:
        raise FeatureStoreError(
            f"feature store {root} needs {_gb(need)} for {todo.size:,} samples ({int(todo_len.sum()):,} tokens x "
            f"{c.bytes_per_token(width):,} bytes per token, {c.name}) but its filesystem has {_gb(free)} free "
            f"({_gb(margin_bytes)} kept free): free space, use fp8/bf16, or build elsewhere")
    gens = [int(g.group(1)) for n in shard_names(root) if (g := _BUILT_NAME.match(n))]
    return {"gen": max(gens, default=-1) + 1, "todo": todo.tolist(), "need": need, "free": free,
            "removed": removed + gone, "identity_digest": m["identity_digest"]}


def _stored_samples(root: Path, shards: list[Shard], pos: dict[int, int], digests: np.ndarray) -> set[int]:
    """The samples the shards on disk hold (closing them); a row of other tokens refuses the store."""
    done: set[int] = set()
    for s in shards:
        for sid, toks in zip(s.index["sid"].tolist(), s.index["tokens"].tolist(), strict=True):
            if sid not in pos or int(digests[pos[sid]]) != toks:
                name = s.path
                s.close()
                raise StoreMismatch(root, [("tokens", f"sample {sid} in {name.name}", "not this pipeline's")])
            done.add(sid)
        s.close()
    return done


def _gb(n: int) -> str:
    return f"{n / 1e9:,.2f} GB" if n >= 1e8 else f"{n / 1e6:,.1f} MB"


def _build_share(root, plan, c, width, ids, lengths, samples, compute, comm, shard_bytes, rows_per_call, progress,
                 should_stop, write, t0) -> BuildResult:
    todo = np.asarray(plan["todo"], dtype=np.int64)
    pos = {int(s): i for i, s in enumerate(ids.tolist())}
    todo_pos = np.asarray([pos[int(s)] for s in todo], dtype=np.int64)
    todo_len = lengths[todo_pos] if todo.size else np.zeros(0, np.int64)
    start, end = _split_by_tokens(todo_len, comm.world_size)[comm.rank]
    mine, mine_len = todo_pos[start:end], todo_len[start:end]
    gen, rank = int(plan["gen"]), comm.rank
    record_path = root / RANKS / f"g{gen:04d}-r{rank:05d}.json"
    record: dict[str, Any] = {"gen": gen, "rank": rank, "world_size": comm.world_size, "shards": []}
    state = BuildProgress(0, int(mine.size), 0, int(mine_len.sum()), 0, 0.0, 0)
    meta = {"identity": plan["identity_digest"], "gen": gen, "rank": rank}
    error: str | None = None
    failure: BaseException | None = None
    try:
        for k, (a, b) in enumerate(_cut_shards(mine_len, c.bytes_per_token(width), shard_bytes)):
            if should_stop is not None and should_stop():
                raise KeyboardInterrupt("stop requested")
            name = f"g{gen:04d}-r{rank:05d}-{k:06d}{SUFFIX}"
            with ShardWriter(root / SHARDS / name, codec=c, width=width, meta=meta, write=write) as w:
                for lo in range(a, b, rows_per_call):
                    batch = [(int(ids[p]), samples.fetch(int(p))) for p in mine[lo : min(lo + rows_per_call, b)]]
                    rows = compute(batch)
                    for (sid, toks), row in zip(batch, rows, strict=True):
                        if tuple(row.shape) != (len(toks), width):
                            raise FeatureStoreError(f"sample {sid}: features of shape {tuple(row.shape)}, expected "
                                                    f"({len(toks)}, {width})")
                        w.add(sid, token_digest(toks), c.encode(row))
                    state.samples += len(batch)
                    state.tokens += sum(len(t) for _, t in batch)
                    state.elapsed_s = time.monotonic() - t0
                    if progress is not None:
                        progress(state)
                info = w.close()
            record["shards"].append(info.to_json())
            write_json(record_path, record, durable=False)
            state.bytes += info.bytes
            state.shards += 1
            if progress is not None:
                progress(state)
    except BaseException as exc:  # every rank still meets the others below: none waits in vain
        error, failure = _describe(exc, root, state), exc
    errors = comm.all_gather_object(error)
    failed = [(f"rank {r}: {e}" if comm.world_size > 1 else e) for r, e in enumerate(errors) if e]
    m = None
    if rank == 0:
        m = _merge_quietly(root, ids.tolist()) if failed else merge_store(root, expected=ids.tolist())
    comm.barrier()
    if failure is not None and not isinstance(failure, OSError | FeatureStoreError | KeyboardInterrupt):
        raise failure  # a bug: its own traceback
    if isinstance(failure, KeyboardInterrupt):
        raise KeyboardInterrupt(error)
    if failed:
        raise FeatureStoreError("; ".join(failed)) from failure
    m = m or read_manifest(root) or {}
    computed = sum(comm.all_gather_object(state.samples))
    return BuildResult(path=root, samples=int(m.get("samples", 0)), tokens=int(m.get("tokens", 0)),
                       bytes=int(m.get("bytes", 0)), computed=computed, reused=len(ids) - len(todo),
                       complete=bool(m.get("complete")), estimate_bytes=int(plan["need"]), free_bytes=int(plan["free"]),
                       seconds=time.monotonic() - t0, removed=list(plan["removed"]))


def _describe(exc: BaseException, root: Path, state: BuildProgress) -> str:
    kept = f"{state.shards} shard(s) of this rank ({state.bytes / 1e6:,.1f} MB) finished and kept"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"the disk of feature store {root} is full ({exc.strerror}): {kept}; free space and run `dflash-flow "
                "features build PIPELINE` again to resume")
    if isinstance(exc, KeyboardInterrupt):
        return f"interrupted: {kept}; run `dflash-flow features build PIPELINE` again to resume"
    return f"{type(exc).__name__}: {exc} ({kept})"


def _merge_quietly(root: Path, expected: list[int] | None = None) -> dict[str, Any] | None:
    try:
        return merge_store(root, expected=expected)
    except Exception as exc:  # noqa: BLE001 - the build's own error is the one to report
        log.warning("could not record the finished shards of %s in its manifest (%s); the next build finds them", root, exc)
        return None
