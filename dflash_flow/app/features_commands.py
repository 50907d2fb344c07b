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
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.app.exits import EXIT_INTERRUPTED, EXIT_OK, report_user_error
from dflash_flow.core import Stage
from dflash_flow.items import Sample, SampleSet, SampleTable

#: How far a row computed again may be from the stored one, relative to its token's largest value.
TOLERANCE = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1e-2, "fp8": 7e-2}


@attrs.define(kw_only=True, eq=False)
class FeatureSamples(Stage):
    """A sink that keeps what the sources emit (their tables and loose samples)."""

    input_type = SampleSet
    output_type = None
    tables: list = attrs.field(factory=list, init=False, metadata={"config": False})
    samples: list = attrs.field(factory=list, init=False, metadata={"config": False})

    @classmethod
    def config_fields(cls):
        return []

    def process(self, item):
        (self.tables if isinstance(item, SampleTable) else self.samples).append(item)
        return None


@attrs.define
class PipelineFeatures:
    """What a pipeline asks of a store: its target stage, spec, sources, samples and identity."""

    validated: Any
    spec: Any  # model.spec.ModelSpec
    target_stage: str
    sources: list[str]
    samples: Any = None  # model.feature_store.SampleIndex (None until the sources ran)
    identity: dict[str, Any] = attrs.field(factory=dict)


def _target_stage(v) -> str:
    names = [s.name for s in v.graph.stages if s.type == "TargetForward"]
    if not names:
        raise ValueError(f"pipeline '{v.graph.name}' has no TargetForward stage: nothing in it computes features")
    if len(names) > 1:
        raise ValueError(f"pipeline '{v.graph.name}' has {len(names)} TargetForward stages ({', '.join(names)}): a "
                         "store holds one target's features")
    return names[0]


def _sources_of(v, stage: str) -> list[str]:
    """The source stages (no inputs) upstream of ``stage``, in the file's order."""
    seen, todo = set(), [stage]
    while todo:
        spec = v.graph.stage(todo.pop())
        for i in spec.inputs:
            if i.stage not in seen:
                seen.add(i.stage)
                todo.append(i.stage)
    return [s.name for s in v.graph.stages if s.name in seen and not s.inputs]


def _template_text(value: str | None, tokenizer: Any) -> str | None:
    if value and "{" not in value and Path(value).expanduser().is_file():
        return Path(value).expanduser().read_text()
    return value if value else getattr(tokenizer, "chat_template", None)


def _one(values: Mapping[str, Any]) -> Any:
    """One value when every source agrees, else the value per source."""
    distinct = {repr(v) for v in values.values()}
    if not values:
        return None
    return next(iter(values.values())) if len(distinct) == 1 else dict(values)


def pipeline_identity(v, *, sources: Sequence[str] | None = None, ran: bool = False) -> dict[str, Any]:
    """The identity a store built for pipeline ``v`` has (``tokens`` aside: it needs the data; ``build`` adds
    it). ``ran``: the source stages have run (their tokenizers are the ones they loaded)."""
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.data.keys import tokenizer_fingerprint
    from dflash_flow.model.feature_identity import store_identity, template_digest

    spec = build_model_spec(v.graph)
    sources = list(sources) if sources is not None else _sources_of(v, _target_stage(v))
    fallback = None
    tokenizers, templates, kwargs = {}, {}, {}
    for name in sources:
        obj = v.configs[name]
        if not hasattr(obj, "chat_template"):
            continue  # pre-tokenized: no tokenizer of its own
        tok = getattr(obj, "_tokenizer", None) if ran else None
        if tok is None:
            if fallback is None and spec.tokenizer:
                from transformers import AutoTokenizer

                fallback = AutoTokenizer.from_pretrained(spec.tokenizer)
            tok = fallback
        tokenizers[name] = tokenizer_fingerprint(tok) if tok is not None else None
        templates[name] = template_digest(_template_text(obj.chat_template, tok))
        kwargs[name] = dict(obj.template_kwargs)
    ident = store_identity(spec.require_target("features"), _layer_ids(spec), trust_remote_code=spec.trust_remote_code,
                           tokenizer=None, template_kwargs=None)
    ident.update(tokenizer=_one(tokenizers), chat_template=_one(templates), template_kwargs=_one(kwargs))
    return ident


def _layer_ids(spec) -> list[int]:
    from dflash_flow.model.spec import ModelSpecError

    try:
        return spec.layer_ids()
    except ModelSpecError:
        from dflash_flow.model.target import load_target_config, num_hidden_layers

        depth = num_hidden_layers(load_target_config(spec.target, trust_remote_code=spec.trust_remote_code))
        return spec.layer_ids(depth)


def prepare(v, *, run_sources: bool = True) -> PipelineFeatures:
    """The pipeline's target stage, sources, samples (running the sources) and identity."""
    from dflash_flow.app.model_spec import build_model_spec

    target = _target_stage(v)
    sources = _sources_of(v, target)
    pf = PipelineFeatures(validated=v, spec=build_model_spec(v.graph), target_stage=target, sources=sources)
    if not run_sources:
        pf.identity = pipeline_identity(v, sources=sources)
    else:
        import numpy as np

        from dflash_flow.model.feature_store import corpus_digest, token_digest

        pf.samples = _run_sources(v, sources)
        pf.identity = pipeline_identity(v, sources=sources, ran=True)
        digests = np.fromiter((token_digest(pf.samples.fetch(i)) for i in range(len(pf.samples))), dtype=np.uint64,
                              count=len(pf.samples))
        pf.identity["tokens"] = corpus_digest(pf.samples.sample_ids, pf.samples.lengths, digests)
    return pf


def _run_sources(v, sources: list[str]):
    """Run the source stages on the core runtime into one corpus (the Bucketer's, so the same sample ids)."""
    import numpy as np

    from dflash_flow.app.runner import model_services
    from dflash_flow.core import Graph, Pipeline
    from dflash_flow.data.corpus import Corpus
    from dflash_flow.model.feature_store import SampleIndex

    g = Graph(name=f"{v.graph.name}-features", seed=v.graph.seed, runtime=v.graph.runtime,
              sections=dict(v.graph.sections))
    for name in sources:
        g.stages.append(attrs.evolve(v.graph.stage(name)))
        g.instances[name] = v.configs[name]
    sink = FeatureSamples()
    g.add("feature_samples", sink, inputs=sources)
    with tempfile.TemporaryDirectory(prefix="dflash-features-") as out:
        Pipeline(g, services=model_services(v), output_dir=out).run()
    corpus = Corpus(sink.tables, [s for s in sink.samples if isinstance(s, Sample)])
    if len(corpus) == 0:
        raise ValueError(f"the sources of pipeline '{v.graph.name}' ({', '.join(sources)}) emitted no samples")

    def fetch(i: int):
        return np.asarray(corpus[i].input_ids, dtype=np.int32)

    return SampleIndex(np.asarray(corpus.sample_ids, dtype=np.int64), np.asarray(corpus.lengths, dtype=np.int64), fetch)


def _device(explicit: str | None, local_rank: int) -> str:
    if explicit:
        return explicit
    import torch

    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


def target_backend(pf: PipelineFeatures, device: str):
    """The backend the training run computes features with, set up on ``device``: the target's inference
    engines when the pipeline declares ``model.engine``, else the target in this process with the target
    stage's dtype, attention and threads."""
    conf = pf.validated.configs[pf.target_stage]
    threads = getattr(conf, "torch_threads", None)
    if threads:
        import torch

        torch.set_num_threads(int(threads))
    if pf.spec.engine is not None:
        from dflash_flow.engine.backend import engine_backend

        backend = engine_backend(pf.spec, output_dir=pf.validated.graph.run_dir, name=pf.target_stage)
    else:
        from dflash_flow.model.backend import InProcessBackend

        backend = InProcessBackend(pf.spec, dtype=getattr(conf, "dtype", "auto"),
                                   attn_implementation=getattr(conf, "attn_implementation", None))
    backend.setup(devices=[device], out_device=device, name=pf.target_stage)
    return backend


def _compute(backend):
    import numpy as np
    import torch

    def compute(batch):
        rows = []
        for sid, toks in batch:
            ids = torch.from_numpy(np.array(toks, dtype=np.int64))[None]
            rows.append(backend.features(ids, torch.ones_like(ids), [ids.shape[1]], [sid])[0, : ids.shape[1]].cpu())
        return rows

    return compute


def _features_config(pf: PipelineFeatures):
    from dflash_flow.model.features_config import FeaturesConfig

    conf = pf.spec.features
    return conf if isinstance(conf, FeaturesConfig) else FeaturesConfig()


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
        conf = _features_config(pf)
        path = store or conf.path
        if not path:
            return report_user_error(f"{file}: no store to build: set model.features.path or pass --store DIR")
        dev = _device(device, dist.local_rank if dist else 0)
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
            path, identity=pf.identity, dtype=c.name, width=width, samples=pf.samples, compute=_compute(backend),
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


# --------------------------------------------------------------------------------------------------
# check


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
    import hashlib

    import numpy as np
    import torch

    from dflash_flow.model.feature_store import (
        FeatureStore,
        FeatureStoreError,
        compare_identity,
        token_digest,
    )

    rep = CheckReport()
    store = FeatureStore(path, complete=False)
    try:
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
            f = Path(path) / rel
            if not f.is_file():
                rep.problem(f"shard {rel} is missing (run `dflash-flow features build PIPELINE`: it computes its samples again)")
            elif f.stat().st_size != int(info["bytes"]):
                rep.problem(f"shard {rel} has {f.stat().st_size} bytes, the manifest says {info['bytes']} (truncated: "
                            "delete it and run `dflash-flow features build PIPELINE`)")
            elif digests and info.get("blake2b"):
                h = hashlib.blake2b(digest_size=20)
                with open(f, "rb") as fh:
                    while chunk := fh.read(16 * 2**20):
                        h.update(chunk)
                if h.hexdigest() != info["blake2b"]:
                    rep.problem(f"shard {rel} does not match its digest (changed on disk: delete it and run "
                                "`dflash-flow features build PIPELINE`)")
        # zeros, NaN, infinities (and each row's crc32)
        sids = store.sample_ids()
        if limit is not None and limit < sids.size:
            sids = np.sort(np.random.default_rng(seed).choice(sids, size=limit, replace=False))
        bad = {"nan": [], "inf": [], "zero rows": [], "zero tokens": [], "crc32": [], "unreadable": []}
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
        if pipeline is None:
            return rep
        # the pipeline's identity, field by field
        fields = compare_identity(store.identity, pipeline.identity)
        for field, stored, want in fields:
            rep.problem(f"{field}: the store has {stored!r}, the pipeline {want!r}")
        if not fields:
            from dflash_flow.model.feature_store import flatten_identity

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
        if backend is None or recompute <= 0 or pipeline.samples is None or fields:
            return rep
        # a sample of rows computed again
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
        return rep
    finally:
        store.close()


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
                backend = target_backend(pf, _device(device, 0))
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
