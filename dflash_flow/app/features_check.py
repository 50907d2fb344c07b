"""``features check``'s look at a store: its manifest and shards (sizes; ``digests``: every byte against the
manifest), every row for zeros, NaN and infinities (``limit``: a sample of them), and with a pipeline: the
store's identity against the pipeline's, field by field, and a sample of rows computed again by the
pipeline's target and compared within the dtype's tolerance."""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.features_pipeline import PipelineFeatures

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
    """Everything ``features check`` looks at (see the module doc), as a report of lines and problems."""
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
    from dflash_flow.model.feature_store.manifest import file_blake2b

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
        elif digests and info.get("blake2b") and file_blake2b(f) != info["blake2b"]:
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
    """The store's identity against the pipeline's, field by field, and its samples against the pipeline's;
    the fields that differ."""
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
