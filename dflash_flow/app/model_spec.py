"""The ``ModelSpec`` resolved from ``model:``, and the static checks before a run that generic validation cannot
know (the model facts, each stage's view of them, paths, checks across stages), each located at the value to
change; for ``run`` also the checkpoint size, the data fingerprint and whether ``--extend`` has work to do.
The target's sizes come from its ``config.json`` or preset (no torch, no network)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

from dflash_flow.core.devices import device_groups
from dflash_flow.core.errors import Problem
from dflash_flow.core.validate import Validated
from dflash_flow.model.spec import ModelSpec, UsesModel


def resolve_target(target: Any) -> Any:
    """A declared ``target`` as the model layer takes it: ``embedded`` is the shipped target's directory (built
    on first use); a mapping is a config preset; anything else a path, preset name or hub id."""
    if target is None:
        return None
    if isinstance(target, dict):
        return dict(target)
    if target == "embedded":
        from dflash_flow.embedded.train_target import embedded_target_path

        return embedded_target_path()
    return str(target)


def build_model_spec(graph: Any) -> ModelSpec:
    """``graph``'s ``model:`` section resolved (a graph without one: a spec with nothing declared)."""
    from dflash_flow.model.facts import target_facts

    section = graph.sections.get("model")
    if section is None:
        return ModelSpec()
    if isinstance(section, dict):  # set in Python and not validated yet
        from dflash_flow.app import ModelConfig

        section = ModelConfig(**section)
    target, tok, ids = resolve_target(section.target), section.tokenizer, section.target_layer_ids
    # model.tokenizer, else the target when it is a local directory (its tokenizer lives beside it)
    tokenizer = ((tok if tok != "embedded" else resolve_target("embedded")) if tok else
                 target if isinstance(target, str) and Path(target).expanduser().is_dir() else None)
    return ModelSpec(declared=section.target, target=target, tokenizer=tokenizer,
                     trust_remote_code=bool(section.trust_remote_code), num_draft_layers=section.num_draft_layers,
                     block_size=section.block_size, mask_token_id=section.mask_token_id,
                     explicit_layer_ids=tuple(ids) if ids is not None else None,
                     facts=target_facts(target) if target is not None else None,
                     engine=getattr(section, "engine", None), features=getattr(section, "features", None))


class _Where:
    """File and line of a ``model:`` key or of a stage's field."""

    def __init__(self, v: Validated) -> None:
        self.loc = v.graph.locator
        self.index = {s.name: i for i, s in enumerate(v.graph.stages)}

    def problem(self, stage: str | None, field: str, message: str, item: int | None = None) -> Problem:
        if field.startswith("model."):
            keys = tuple(field.split(".")[1:])  # model.engine.servers: the deepest key written, else its parents
            stage_line = ("stages", self.index[stage]) if stage is not None else ("model",)
            paths = (*(("model", *keys[:n]) for n in range(len(keys), 0, -1)), ("model",), stage_line)
        else:  # a stage's own config field, or its placement (devices)
            path: tuple[Any, ...] = ("stages", self.index[stage], *(() if field == "devices" else ("config",)), field)
            paths = ((*path, item) if item is not None else path, ("stages", self.index[stage]))
        return _located(self.loc, message, *paths, stage=stage, field=field)


def model_problems(v: Validated, *, check_paths: bool = True) -> list[Problem]:
    """Every problem of the model facts and of the stages' view of them, located."""
    w = _Where(v)
    spec = build_model_spec(v.graph)
    problems: list[Problem] = []
    if check_paths:
        problems += _path_problems(v, w, spec)
    problems += _spec_problems(w, spec)
    for spec_ in v.graph.stages:
        conf = v.configs.get(spec_.name)
        if not isinstance(conf, UsesModel):
            continue
        try:
            found = conf.model_problems(spec, device_groups(spec_.devices))
        except Exception as exc:  # noqa: BLE001 - a failing check is reported, never raised
            found = [("model.target", f"stage type '{spec_.type}' failed to check the model: {type(exc).__name__}: {exc}")]
        for field, message in found:
            found_p = w.problem(spec_.name, field, message)
            if not any((p.line, p.message) == (found_p.line, found_p.message) for p in problems):
                problems.append(found_p)
    return problems


def _spec_problems(w: _Where, spec: ModelSpec) -> list[Problem]:
    """The layers exist in the target and the rule can place them; the mask token is in its vocabulary."""
    out = [w.problem(None, f"model.{key}.{field}", message)  # what model.engine and model.features say of themselves
           for key, section in (("engine", spec.engine), ("features", spec.features)) if section is not None
           for field, message in section.problems()]
    facts = spec.facts
    ids = list(spec.explicit_layer_ids) if spec.explicit_layer_ids is not None else None
    if ids is not None and not ids:
        return [*out, w.problem(None, "model.target_layer_ids",
                                "model.target_layer_ids must not be empty (omit it for the DFlash default)")]
    if ids is not None and min(ids) < 0:
        return [*out, w.problem(None, "model.target_layer_ids", f"target layer ids must be >= 0, got {min(ids)}")]
    if facts is None:
        return out
    if ids is not None:
        field = "model.target_layer_ids"
    else:
        field = "model.num_draft_layers"
        try:
            ids = spec.layer_ids()
        except ValueError as exc:
            return [*out, w.problem(None, field, str(exc))]
    bad = [i for i in ids if not 0 <= i < facts.depth]
    if bad:
        out.append(w.problem(None, field, (
            f"target layer {bad[0]} does not exist: the target has {facts.depth} decoder layers (ids 0-"
            f"{facts.depth - 1})")))
    elif spec.engine is not None:  # the engine's ids are ours + 1: the last layer has no equal there
        from dflash_flow.engine.config import to_engine_layer_ids

        try:
            to_engine_layer_ids(ids, facts.depth)
        except ValueError as exc:
            out.append(w.problem(None, field, str(exc)))
    if spec.mask_token_id is not None and spec.mask_token_id >= facts.vocab_size:
        out.append(w.problem(None, "model.mask_token_id", (
            f"mask_token_id {spec.mask_token_id} is outside the target's vocabulary of {facts.vocab_size} "
            f"tokens (ids 0-{facts.vocab_size - 1})")))
    return out


def _path_problems(v: Validated, w: _Where, spec: ModelSpec) -> list[Problem]:
    """Data files and model directories that do not exist here."""
    from dflash_flow.core.config import searched_in
    from dflash_flow.util import local_dirs

    out = []
    section = v.graph.sections.get("model")
    declared = [("model.target", spec.target), ("model.tokenizer", getattr(section, "tokenizer", None))]
    for field, value, kind in local_dirs(*declared):
        if kind == "dir" and not Path(value).expanduser().is_dir():
            out.append(w.problem(None, field, f"{field} {value} is not a directory here{searched_in(value)}"))
    for name, conf in v.configs.items():
        for j, f in enumerate(conf.data_files()):
            if not Path(f).expanduser().is_file():
                out.append(w.problem(name, "paths", f"{f}: no such file (a data file {name} reads){searched_in(f)}",
                                     item=j))
        for field, value, kind in conf.input_paths():
            path = Path(value).expanduser()
            if kind == "dir" and not path.is_dir():
                found = w.problem(name, field, f"{field} {value} is not a directory here{searched_in(value)}")
            elif kind == "file" and not path.is_file():
                found = w.problem(name, field, f"{field} file {value} does not exist{searched_in(value)}")
            else:
                continue
            if not any((p.line, p.message) == (found.line, found.message) for p in out):
                out.append(found)
    return out


def _located(loc, message: str, *paths: tuple, stage: str | None = None, field: str | None = None) -> Problem:
    """``message`` located at the first of ``paths`` the pipeline file has."""
    line = next((n for p in paths if (n := loc.line(*p)) is not None), None) if loc is not None else None
    return Problem(message, file=loc.filename if loc is not None else None, line=line, stage=stage, field=field)


def preflight_problems(v: Validated, *, check_paths: bool = True, local_world_size: int | None = None,
                       gpu_count: int | None = None) -> list[Problem]:
    """``model_problems``, then the checks across stages: a Bucketer token budget smaller than the longest
    sample upstream (it would only fail after reading all the data), its mixture, aliased files, the backend."""
    from dflash_flow.stages.bucketer import Bucketer

    graph = v.graph
    loc = graph.locator
    problems = model_problems(v, check_paths=check_paths)
    for i, spec in enumerate(graph.stages):
        conf = v.configs.get(spec.name)
        if not isinstance(conf, Bucketer):
            continue
        problems += _mixture_problems(v, i, conf.mixture)
        todo, seen = [inp.stage for inp in spec.inputs], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            up = v.configs.get(name)
            max_length = up.longest_item() if up is not None else None
            if max_length is not None:
                multiple = max(conf.pad_to_multiple, 1)
                padded = math.ceil(max_length / multiple) * multiple
                if conf.max_tokens < padded:
                    problems.append(_located(
                        loc, f"max_tokens={conf.max_tokens} is smaller than one sample: stage '{name}' emits samples "
                        f"of up to max_length={max_length} tokens ({padded} padded); raise max_tokens or lower max_length",
                        ("stages", i, "config", "max_tokens"), stage=spec.name, field="max_tokens"))
                continue
            todo.extend(inp.stage for inp in graph.stage(name).inputs)
    if check_paths:
        problems += aliased_data_files(v)
    problems += _backend_problems(v, local_world_size, gpu_count)
    return problems


def _backend_problems(v: Validated, local_world_size: int | None, gpu_count: int | None) -> list[Problem]:
    """``distributed.backend: nccl`` where the node's ranks would share a GPU (fails at the first collective)."""
    from dflash_flow.app.distributed import backend_problem, node_layouts
    from dflash_flow.core.devices import visible_gpu_count

    ranks = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1) or 1)
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    if ranks < 2 or gpus < 1:
        return []
    graph = v.graph
    message = backend_problem(graph.sections["distributed"].backend, node_layouts(gpus, ranks, graph.runtime))
    if message is None:
        return []
    return [_located(graph.locator, message, ("distributed", "backend"), field="distributed.backend")]


def preflight_warnings(v: Validated) -> list[str]:
    """What validate warns of, located: a ``max_length`` past the target's ``max_position_embeddings``."""
    graph = v.graph
    loc = graph.locator
    try:
        facts = build_model_spec(graph).facts
    except Exception:  # noqa: BLE001 - the model's own problems are reported by the checks
        return []
    window = facts.max_positions if facts is not None else None
    if window is None:
        return []
    out = []
    for i, spec in enumerate(graph.stages):
        conf = v.configs.get(spec.name)
        longest = conf.longest_item() if conf is not None else None
        if longest is not None and longest > window:
            out.append("warning: " + _located(
                loc, f"max_length {longest} is past the target's context window of {window} positions "
                "(max_position_embeddings): longer samples would run it where it was not trained; set max_length "
                f"to at most {window}", ("stages", i, "config", "max_length"), stage=spec.name,
                field="max_length").format())
    return out


def _mixture_problems(v: Validated, index: int, mixture: dict | None) -> list[Problem]:
    """A Bucketer's mixture must weigh every source it draws from (the source stages upstream of it: samples
    carry their source's name) and name nothing else; found here, not after every input was read."""
    if mixture is None:
        return []
    graph = v.graph
    spec = graph.stages[index]
    sources, ancestors, todo = [], set(), [inp.stage for inp in spec.inputs]
    while todo:
        name = todo.pop(0)
        if name in ancestors:
            continue
        ancestors.add(name)
        up = [inp.stage for inp in graph.stage(name).inputs]
        if not up:
            sources.append(name)
        todo.extend(up)
    missing = [s for s in sources if s not in mixture]
    unknown = sorted(k for k in mixture if k not in ancestors)
    if not (missing or unknown):
        return []
    parts = []
    if missing:
        parts.append(f"no weight for {', '.join(repr(s) for s in missing)} (give every source a weight; 0 leaves it "
                     "out)")
    if unknown:
        parts.append(f"{', '.join(repr(s) for s in unknown)} {'is' if len(unknown) == 1 else 'are'} not among its "
                     f"sources")
    return [_located(graph.locator, f"mixture: {'; '.join(parts)}; its sources are {', '.join(sources)}",
                     ("stages", index, "config", "mixture"), stage=spec.name, field="mixture")]


def aliased_data_files(v: Validated) -> list[Problem]:
    """A data file read twice (the same inode: two stages, a link or another spelling) would train its samples
    twice per epoch without a word: refused, naming both."""
    w = _Where(v)
    seen: dict[tuple[int, int], tuple[str, int, str]] = {}
    problems: list[Problem] = []
    for name, conf in v.configs.items():
        for j, f in enumerate(conf.data_files()):
            try:
                st = os.stat(Path(f).expanduser())
            except OSError:
                continue  # a missing file is the path check's
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen[key] = (name, j, str(f))
                continue
            first, k, other = seen[key]
            where = f"stage '{first}' paths[{k}]" if first != name else f"paths[{k}]"
            problems.append(w.problem(
                name, "paths", f"{f} is the same file as {other} ({where}): its samples would be trained twice per "
                "epoch; list each file once (to weight a source, give it its own source stage and a Bucketer mixture "
                "weight)", item=j))
    return problems


def extend_problem(recorded: dict | None, current: dict, length_keys, moved: dict | None = None) -> str | None:
    """Why ``--extend`` has nothing to do (None: the run gets longer): no run-length setting is larger than the
    checkpoint's (a shorter or equal one would train nothing and write over the run's summary)."""
    from dflash_flow.core.identity import recorded_as_today

    if recorded is None:  # written before checkpoints recorded their settings: cannot be told
        return None
    recorded = recorded_as_today(recorded, moved or {}, current)
    same, shorter = [], []
    for key in sorted(length_keys):
        old, new = recorded.get(key), current.get(key)
        if old == new:
            same.append(f"{key.rsplit('.', 1)[-1]} {new if new is not None else 'unlimited'}")
        elif new is None or (old is not None and isinstance(new, int | float) and new > old):
            return None  # longer (None: no budget)
        else:
            shorter.append(f"{key}: {old if old is not None else 'unlimited'} in the checkpoint, {new} now")
    what = f"shorter ({'; '.join(shorter)})" if shorter else f"the same ({', '.join(same)})"
    return (f"nothing to extend: the run length is {what}; --extend trains a run on to a larger epochs or "
            "max_batches (a stopped run continues with --resume alone); the run and its summary are left as they are")


def data_fingerprint(v: Validated) -> dict[str, str]:
    """sha256 of every data file the sources read, keyed by the path as configured (missing ones left out)."""
    from dflash_flow.data.records import file_sha256

    out: dict[str, str] = {}
    for conf in v.configs.values():
        for name in conf.data_files():
            try:
                out[str(name)] = file_sha256(Path(name).expanduser())
            except OSError:
                continue
    return out


def checkpoint_bytes(v: Validated) -> tuple[int, int]:
    """Upper estimates of (one checkpoint, the export) from the stages' ``parameter_count()``; zeros if unknown."""
    ckpt = export = 0
    spec = build_model_spec(v.graph)
    for name, conf in v.configs.items():
        try:
            n = int(conf.parameter_count(spec) if isinstance(conf, UsesModel) else conf.parameter_count())
        except Exception as exc:  # noqa: BLE001
            logging.getLogger("dflash_flow").debug("no checkpoint size estimate for stage '%s': %s", name, exc)
            continue
        if not n:
            continue
        ckpt += 16 * n + 2**20  # fp32 weights, fp32 masters and two AdamW moments, plus the JSON files
        export += 4 * n
    return ckpt, export
