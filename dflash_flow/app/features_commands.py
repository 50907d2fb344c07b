"""``dflash-flow features build PIPELINE`` and ``dflash-flow features check STORE [--pipeline P]``.

``build`` runs the pipeline's own data stages (the sources upstream of its ``TargetForward``, on the core
runtime, into a collecting sink: the same corpus, so the same sample ids, as the Bucketer of a training run
builds) and then its target once over every sample, through the target backend the training run would use,
writing the store (``model.feature_store.build_store``: the size estimate against the free space first,
resumable, one shard file per rank and generation, rank 0 merging the manifest). Under torchrun every rank
computes its share on its own device.

``check`` reads a store: its manifest and shards (sizes, trailers; ``--digests``: every byte against the
manifest), every row for zeros, NaN and infinities (``--limit``), and with ``--pipeline``: the store's
identity against the pipeline's, field by field, and a sample of rows computed again by the pipeline's
target and compared within the dtype's tolerance.

Each command is one function from arguments to an exit code; a user error is one line and exit 2.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from pathlib import Path

from dflash_flow.app.exits import EXIT_INTERRUPTED, EXIT_OK, report_user_error
from dflash_flow.app.features_check import check_store
from dflash_flow.app.features_pipeline import compute_fn, device_for, features_config, prepare, target_backend

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
    from dflash_flow.app.exits import is_user_input_error
    from dflash_flow.app.runner import load
    from dflash_flow.core import ConfigError
    from dflash_flow.model.feature_store import CODECS, FeatureStoreError, LocalComm, build_store, codec
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
        conf = features_config(pf)
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
    except (FeatureStoreError, ValueError, OSError) as exc:
        if isinstance(exc, OSError) and not is_user_input_error(exc):
            raise
        return report_user_error(exc)
    except Exception as exc:
        if is_user_input_error(exc):
            return report_user_error(exc)
        raise
    finally:
        shutdown_distributed(dist, failed=failed)


def features_check_command(store: Path, *, pipeline: Path | None, overrides: list[str] | None, recompute: int,
                           tolerance: float | None, limit: int | None, digests: bool, device: str | None) -> int:
    """``dflash-flow features check``: exit 0 when the store has no problem, else 2 listing them."""
    from dflash_flow.app.exits import is_user_input_error
    from dflash_flow.app.runner import load
    from dflash_flow.core import ConfigError
    from dflash_flow.model.feature_store import FeatureStoreError

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
    except (FeatureStoreError, ValueError) as exc:
        return report_user_error(exc)
    except Exception as exc:
        if is_user_input_error(exc):
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
