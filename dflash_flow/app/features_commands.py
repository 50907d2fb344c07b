"""``dflash-flow features build PIPELINE`` (the pipeline's sources, then its target once over every sample
through the training run's backend, into a store) and ``features check STORE [--pipeline P]`` (files, rows,
and with a pipeline its identity and rows computed again)."""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.exits import EXIT_INTERRUPTED, EXIT_OK, is_user_input_error, report_user_error
from dflash_flow.app.features_pipeline import (
    PipelineFeatures,
    compute_fn,
    device_for,
    prepare,
    target_backend,
)

__all__ = ["check_store", "features_build_command", "features_check_command", "prepare", "target_backend"]


def _hms(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Progress:
    """One line every ``every_s`` seconds (and at the end): samples, tokens/s, MB/s, ETA."""

    def __init__(self, every_s: float = 2.0, out=None):
        self.every_s, self.out, self.last = every_s, out or sys.stderr, 0.0

    def __call__(self, p, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < self.every_s:
            return
        self.last = now
        share = p.samples / p.total_samples if p.total_samples else 1.0
        self.out.write(f"features: {p.samples:,}/{p.total_samples:,} samples ({share:.0%}), {p.tokens:,} tokens, "
                       f"{p.tokens_per_s:,.0f} tokens/s, {p.bytes / 1e6 / max(p.elapsed_s, 1e-9):,.1f} MB/s written, "
                       f"{p.shards} shard(s), ETA {_hms(p.eta_s)}\n")
        self.out.flush()


def features_build_command(file: Path, overrides: list[str] | None, *, store: str | None, dtype: str | None,
                           shard_mb: float | None, wait: bool, device: str | None, margin_mb: float | None) -> int:
    """``dflash-flow features build``: exit 0 when the store is complete."""
    from dflash_flow.app.distributed import init_distributed, shutdown_distributed
    from dflash_flow.app.runner import load
    from dflash_flow.core import ConfigError
    from dflash_flow.model.feature_store import CODECS, LocalComm, build_store, codec
    from dflash_flow.model.spec import FeaturesConfig
    from dflash_flow.model.target import resolve_dtype

    try:
        v = load(file, overrides=overrides)
    except ConfigError as exc:
        return report_user_error(f"{file}: {len(exc.problems)} problem(s)\n" + "\n".join(p.format() for p in exc.problems))
    dist = None
    failed = True
    try:
        dist = init_distributed(v.graph.sections["distributed"], use_cuda=device != "cpu")
        comm = dist or LocalComm()
        pf = prepare(v)
        conf = pf.spec.features if isinstance(pf.spec.features, FeaturesConfig) else FeaturesConfig()
        path = store or conf.path
        if not path:
            return report_user_error(f"{file}: no store to build: set model.features.path or pass --store DIR")
        dev = device_for(device, dist.local_rank if dist else 0)
        backend = target_backend(pf, dev)
        compute_dtype = resolve_dtype(getattr(v.configs[pf.target_stage], "dtype", "auto"), dev)
        c = codec(dtype or conf.dtype, compute_dtype)
        width = len(backend.layer_ids) * backend.hidden_size
        main = comm.rank == 0
        out = sys.stderr
        if main:
            n, t = len(pf.samples), int(pf.samples.lengths.sum())
            out.write(f"features: {file} -> {path}: {n:,} samples, {t:,} tokens; target layers {backend.layer_ids} "
                      f"({width:,} features per token), {c.name}: {c.bytes_per_token(width):,} bytes per token"
                      f"{f', {comm.world_size} ranks' if comm.world_size > 1 else ''}\n")

        def estimate(need, free, tokens, samples):
            if main:
                out.write(f"features: to write {samples:,} samples ({tokens:,} tokens): about {need / 1e9:,.3f} GB; "
                          f"{free / 1e9:,.1f} GB free on {path}\n")

        def waiting(owner, seconds):
            if main and int(seconds) % 30 == 0:
                out.write(f"features: {path} is locked by {owner}; waiting ({seconds:.0f} s)\n")

        progress = _Progress() if main else None
        result = build_store(
            path, identity=pf.identity, dtype=c.name, width=width, samples=pf.samples, compute=compute_fn(backend),
            comm=comm, shard_bytes=int((shard_mb or conf.shard_mb) * 2**20),
            margin_bytes=int((margin_mb if margin_mb is not None else conf.free_space_margin_mb) * 2**20),
            wait_s=math.inf if wait else 0.0, compute_dtype=str(compute_dtype).removeprefix("torch."),
            vocab_size=backend.vocab_size, on_estimate=estimate, on_wait=waiting, progress=progress)
        backend.close()
        if main:
            per_token = result.bytes / result.tokens if result.tokens else 0
            out.write(f"features: {result.path}: {'complete' if result.complete else 'INCOMPLETE'}, {result.samples:,} "
                      f"samples, {result.tokens:,} tokens, {result.bytes / 1e6:,.1f} MB ({per_token:,.1f} bytes per token "
                      f"on disk, {CODECS[c.name].bytes_per_token(width):,} of them the features); computed "
                      f"{result.computed:,}, reused {result.reused:,} in {result.seconds:,.1f} s\n")
        failed = False
        return EXIT_OK
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"features: {exc or 'interrupted'}\n")
        return EXIT_INTERRUPTED
    except Exception as exc:  # ValueError, FeatureStoreError and every user input error: one line, exit 2
        if isinstance(exc, ValueError) or is_user_input_error(exc):
            return report_user_error(exc)
        raise
    finally:
        shutdown_distributed(dist, failed=failed)


def features_check_command(store: Path, *, pipeline: Path | None, overrides: list[str] | None, recompute: int,
                           tolerance: float | None, limit: int | None, digests: bool, device: str | None) -> int:
    """``dflash-flow features check``: exit 0 when the store has no problem, else 2 listing them."""
    from dflash_flow.app.runner import load
    from dflash_flow.core import ConfigError

    try:
        pf = backend = None
        if pipeline is not None:
            try:
                v = load(pipeline, overrides=overrides)
            except ConfigError as exc:
                return report_user_error(f"{pipeline}: {len(exc.problems)} problem(s)\n"
                                         + "\n".join(p.format() for p in exc.problems))
            pf = prepare(v)
            if recompute > 0:
                backend = target_backend(pf, device_for(device, 0))
        try:
            rep = check_store(store, pipeline=pf, backend=backend, recompute=recompute, tolerance=tolerance, limit=limit,
                              digests=digests)
        finally:
            if backend is not None:
                with contextlib.suppress(Exception):
                    backend.close()
    except Exception as exc:
        if isinstance(exc, ValueError) or is_user_input_error(exc):
            return report_user_error(exc)
        raise
    for line in rep.lines:
        print(line)
    for line in rep.problems:
        print(f"problem: {line}")
    if rep.problems:
        return report_user_error(f"feature store {store}: {len(rep.problems)} problem(s)")
    print(f"ok: {store}")
    return EXIT_OK


#: How far a row computed again may be from the stored one, relative to its token's largest value.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1e-2, "fp8": 7e-2}


@attrs.define
class CheckReport:
    lines: list[str] = attrs.field(factory=list)
    problems: list[str] = attrs.field(factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)

    def problem(self, line: str) -> None:
        self.problems.append(line)


def check_store(path: str | os.PathLike, *, pipeline: PipelineFeatures | None = None, backend: Any = None,
                recompute: int = 8, tolerance: float | None = None, limit: int | None = None,
                digests: bool = False, seed: int = 0) -> CheckReport:
    """Everything ``features check`` looks at, as a report of lines and problems."""
    from dflash_flow.model.feature_store import FeatureStore

    rep = CheckReport()
    store = FeatureStore(path, complete=False)
    try:
        _check_files(rep, store, Path(path), digests)
        _check_rows(rep, store, limit, seed)
        if pipeline is None:
            return rep
        fields = _check_identity(rep, store, pipeline)
        if backend is not None and recompute > 0 and pipeline.samples is not None and not fields:
            _check_recomputed(rep, store, pipeline, backend, recompute, tolerance, seed)
        return rep
    finally:
        store.close()


def _check_files(rep: CheckReport, store: Any, path: Path, digests: bool) -> None:
    """The manifest's figures, and every shard it lists: there, of its size (``digests``: of its digest)."""
    from dflash_flow.util import blake2b_file

    m = store.manifest
    n, tokens = len(store), store.tokens
    listed = {s["file"]: s for s in m.get("shards", [])}
    rep.say(f"store {path}: {m['dtype']}, {store.width:,} features per token ({store.codec.bytes_per_token(store.width):,} "
            f"bytes per token), {n:,} samples, {tokens:,} tokens, {len(listed)} "
            f"shard(s) in the manifest, {m.get('bytes', 0) / 1e6:,.1f} MB")
    expected = m.get("expected_samples")
    if not m.get("complete"):
        rep.problem(f"incomplete: {n:,} of {expected if expected is not None else '?'} samples (run `dflash-flow "
                    "features build PIPELINE` to finish it)")
    if store.duplicates:
        rep.say(f"{store.duplicates} sample(s) stored twice (hybrid writers): the first copy is read")
    for rel, info in listed.items():
        f = path / rel
        if not f.is_file():
            rep.problem(f"shard {rel} is missing (run `dflash-flow features build PIPELINE`: it computes its samples again)")
        elif f.stat().st_size != int(info["bytes"]):
            rep.problem(f"shard {rel} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated: "
                        "delete it and run `dflash-flow features build PIPELINE`)")
        elif digests and info.get("blake2b") and blake2b_file(f) != info["blake2b"]:
            rep.problem(f"shard {rel} does not match its digest (changed on disk: delete it and run "
                        "`dflash-flow features build PIPELINE`)")


def _check_rows(rep: CheckReport, store: Any, limit: int | None, seed: int) -> None:
    """Every row (``limit``: that many, drawn with ``seed``) for its crc32, NaN, infinities and zeros."""
    import numpy as np
    import torch

    from dflash_flow.model.feature_store import FeatureStoreError

    sids = store.sample_ids()
    if limit is not None and limit < sids.size:
        sids = np.sort(np.random.default_rng(seed).choice(sids, size=limit, replace=False))
    bad: dict[str, list[int]] = {"nan": [], "inf": [], "zero rows": [], "zero tokens": [], "crc32": [], "unreadable": []}
    zero_tokens = 0
    for sid in sids.tolist():
        try:
            payload, length, crc, _ = store.payload(sid)
            if zlib.crc32(memoryview(np.ascontiguousarray(payload)).cast("B")) != crc:
                bad["crc32"].append(sid)
                continue
            row = store.codec.decode(payload, length, store.width, torch.float32)
        except FeatureStoreError as exc:
            bad["unreadable"].append(sid)
            rep.problem(str(exc))
            continue
        if torch.isnan(row).any():
            bad["nan"].append(sid)
        if torch.isinf(row).any():
            bad["inf"].append(sid)
        zt = int((row == 0).all(dim=-1).sum())
        if zt == length:
            bad["zero rows"].append(sid)
        elif zt:
            bad["zero tokens"].append(sid)
            zero_tokens += zt
    rep.say(f"scanned {sids.size:,} rows for NaN, infinities and zeros")
    for what, found in bad.items():
        if found and what != "unreadable":
            first = ", ".join(str(s) for s in found[:8])
            rep.problem(f"{len(found):,} row(s) with {what}{f' ({zero_tokens:,} tokens)' if what == 'zero tokens' else ''}"
                        f": samples {first}{' ...' if len(found) > 8 else ''}")


def _check_identity(rep: CheckReport, store: Any, pipeline: PipelineFeatures) -> list[tuple[str, Any, Any]]:
    """The store's identity and samples against the pipeline's; the identity fields that differ."""
    from dflash_flow.model.feature_store import compare_identity, flatten_identity

    fields = compare_identity(store.identity, pipeline.identity)
    for field, stored, want in fields:
        rep.problem(f"{field}: the store has {stored!r}, the pipeline {want!r}")
    if not fields:
        known = [k for k, val in flatten_identity(pipeline.identity).items()
                 if val is not None and flatten_identity(store.identity).get(k) is not None]
        rep.say(f"identity: matches the pipeline ({', '.join(known)})")
    if pipeline.samples is not None:
        want = set(pipeline.samples.sample_ids.tolist())
        have = set(store.sample_ids().tolist())
        if want - have:
            rep.problem(f"{len(want - have):,} of the pipeline's samples are not in the store")
        if have - want:
            rep.problem(f"{len(have - want):,} samples in the store are not the pipeline's")
    return fields


def _check_recomputed(rep: CheckReport, store: Any, pipeline: PipelineFeatures, backend: Any, recompute: int,
                      tolerance: float | None, seed: int) -> None:
    """``recompute`` rows drawn with ``seed`` computed again by the target, against the stored ones."""
    import numpy as np
    import torch

    from dflash_flow.model.feature_store import FeatureStoreError, token_digest

    tol = tolerance if tolerance is not None else TOLERANCE[store.codec.name]
    pos_of = {int(s): i for i, s in enumerate(pipeline.samples.sample_ids.tolist())}
    common = sorted(set(pos_of) & set(store.sample_ids().tolist()))
    pick = np.random.default_rng(seed).choice(len(common), size=min(recompute, len(common)), replace=False)
    worst, worst_sid = 0.0, None
    for k in sorted(pick.tolist()):
        sid = common[k]
        toks = pipeline.samples.fetch(pos_of[sid])
        ids = torch.from_numpy(np.array(toks, dtype=np.int64))[None]
        fresh = backend.features(ids, torch.ones_like(ids), [ids.shape[1]], [sid])[0].float().cpu()
        out = torch.empty(ids.shape[1], store.width, dtype=torch.float32)
        try:
            store.read_into(out, sid, tokens=token_digest(toks))
        except FeatureStoreError as exc:
            rep.problem(str(exc))
            continue
        scale = fresh.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        err = float(((out - fresh).abs() / scale).max())
        if err > worst:
            worst, worst_sid = err, sid
    at = f" (sample {worst_sid})" if worst_sid is not None else ""
    line = (f"recomputed {len(pick)} row(s) with the target: largest difference {worst:.3g} of a token's largest "
            f"value{at}; tolerance {tol:.3g} ({store.codec.name})")
    (rep.problem if worst > tol else rep.say)(line)
