"""What ``features build`` and ``features check`` read of a pipeline: its target stage, the samples of the
sources upstream of it, a store's identity, and the target backend a training run computes features with."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core import Stage
from dflash_flow.items import Sample, SampleSet, SampleTable


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
    """The identity (but ``tokens``) of a store built for ``v``; ``ran``: the sources ran (use their tokenizers)."""
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.data.store import tokenizer_fingerprint
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
    from dflash_flow.data.plan import Corpus
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


def device_for(explicit: str | None, local_rank: int) -> str:
    if explicit:
        return explicit
    import torch

    return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"


def target_backend(pf: PipelineFeatures, device: str):
    """The backend the training run computes features with (the engine, else in process), set up on ``device``."""
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


def compute_fn(backend):
    import numpy as np
    import torch

    def compute(batch):
        ids = [(sid, torch.from_numpy(np.array(toks, dtype=np.int64))[None]) for sid, toks in batch]
        return [backend.features(i, torch.ones_like(i), [i.shape[1]], [sid])[0, : i.shape[1]].cpu() for sid, i in ids]

    return compute
