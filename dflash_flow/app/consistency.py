"""Static checks across the DFlash stages, before anything runs (``dflash-flow validate`` and ``run``): one
target for the target forward, the trainer and the evaluation; the layers the target emits are the layers
the drafter fuses, and exist in the target; the mask token and a source's vocabulary fit the target's
vocabulary; a drafter to start from has the target's hidden size and the block size; and the data files and
model directories the stages name exist (``check_paths=False`` skips that, for validating elsewhere).

Each problem names the file and line of the value to change: the stage's own field, or the ``model:``
section's key when the stage takes it from there. The target's sizes come from its ``config.json`` or its
preset (``model.facts``: no torch, no transformers, no network); a target that cannot be read here (a hub
id) is checked by the stages' setup instead.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_flow.core.errors import Problem
from dflash_flow.core.validate import Validated


class _Where:
    """File and line of a stage's field (or of the section key that declares it for the stage)."""

    def __init__(self, v: Validated) -> None:
        self.v = v
        self.loc = v.graph.locator
        self.index = {s.name: i for i, s in enumerate(v.graph.stages)}

    def problem(self, stage: str, field: str, message: str, item: int | None = None) -> Problem:
        spec = self.v.graph.stage(stage)
        path: tuple[Any, ...] = ("stages", self.index[stage], "config", field)
        declared = type(self.v.configs[stage]).section_fields.get(field)
        if field not in spec.config and declared is not None:
            path = tuple(declared.split("."))
            field = declared
        elif item is not None:
            path = (*path, item)
        line = self.loc.line(*path) if self.loc is not None else None
        if line is None and self.loc is not None:
            line = self.loc.line("stages", self.index[stage])
        return Problem(message, file=self.loc.filename if self.loc is not None else None, line=line,
                       stage=stage, field=field)


def _key(target: Any) -> str:
    """One spelling per target: ``embedded`` and its directory, ``~/m`` and ``/home/u/m`` are the same."""
    if isinstance(target, str) and _looks_local(target):
        target = str(Path(target).expanduser().resolve())
    return json.dumps(target, sort_keys=True, default=str)


def _looks_local(spec: Any) -> bool:
    return isinstance(spec, str) and (spec.startswith(("/", ".", "~")) or Path(spec).expanduser().exists())


def model_problems(v: Validated, *, check_paths: bool = True) -> list[Problem]:
    from dflash_flow.embedded import resolve_target
    from dflash_flow.model.facts import build_target_layer_ids, target_facts
    from dflash_flow.stages.drafter_step import DrafterStep
    from dflash_flow.stages.sources import TokenizedSource
    from dflash_flow.stages.spec_eval import SpecDecodeEval
    from dflash_flow.stages.target_forward import TargetForward

    w = _Where(v)
    problems: list[Problem] = []
    by_type = {cls: [(n, c) for n, c in v.configs.items() if type(c) is cls or isinstance(c, cls)]
               for cls in (TargetForward, DrafterStep, SpecDecodeEval)}
    forwards, trainers, evals = by_type[TargetForward], by_type[DrafterStep], by_type[SpecDecodeEval]
    if check_paths:
        problems += _path_problems(v, w)
    with_target = forwards + trainers + evals
    if not with_target:
        return problems
    ref_name, ref = (trainers or forwards or evals)[0]
    same_target = True
    for name, conf in with_target:
        if _key(resolve_target(conf.target)) != _key(resolve_target(ref.target)):
            same_target = False
            problems.append(w.problem(name, "target", (
                f"stage '{name}' ({type(conf).__name__}) uses target {conf.target!r}, but stage '{ref_name}' "
                f"({type(ref).__name__}) uses {ref.target!r}: a drafter works only with the target it was trained "
                "against; declare the target once, in model.target")))
    if not same_target:
        return problems  # sizes compared against the wrong target would only mislead
    facts = target_facts(resolve_target(ref.target))
    if facts is None:
        return problems
    ids_of: dict[str, tuple[list[int], str]] = {}
    for name, conf in forwards + trainers:
        depth_field, depth = (("num_draft_layers", conf.num_draft_layers) if isinstance(conf, TargetForward)
                              else ("num_layers", conf.num_layers))
        if conf.target_layer_ids:
            ids, field = list(conf.target_layer_ids), "target_layer_ids"
        else:
            try:
                ids, field = build_target_layer_ids(facts.depth, depth), depth_field
            except ValueError as exc:
                problems.append(w.problem(name, depth_field, str(exc)))
                continue
        bad = [i for i in ids if not 0 <= i < facts.depth]
        if bad:
            problems.append(w.problem(name, field, (
                f"target layer {bad[0]} does not exist: the target has {facts.depth} decoder layers (ids 0-"
                f"{facts.depth - 1})")))
            continue
        ids_of[name] = (ids, field, conf.target_layer_ids if field == "target_layer_ids" else depth)
    for fname, _ in forwards:
        for tname, _ in trainers:
            if fname in ids_of and tname in ids_of and ids_of[fname][0] != ids_of[tname][0]:
                (emit, efield, evalue), (fuse, tfield, tvalue) = ids_of[fname], ids_of[tname]
                problems.append(w.problem(tname, tfield, (
                    f"stage '{fname}' (TargetForward) emits target layers {emit} ({efield}={evalue}) but stage "
                    f"'{tname}' (DrafterStep) fuses {fuse} ({tfield}={tvalue}): declare the drafter's depth "
                    "once, in model.num_draft_layers (or the layers in model.target_layer_ids)")))
    for name, conf in trainers:
        if conf.mask_token_id is not None and conf.mask_token_id >= facts.vocab_size:
            problems.append(w.problem(name, "mask_token_id", (
                f"mask_token_id {conf.mask_token_id} is outside the target's vocabulary of {facts.vocab_size} "
                "tokens (ids 0-{})".format(facts.vocab_size - 1))))
        problems += _init_from_problems(w, name, conf, facts)
    for name, conf in v.configs.items():
        vocab = conf.vocab_size if isinstance(conf, TokenizedSource) else None
        if vocab is not None and vocab > facts.vocab_size:
            problems.append(w.problem(name, "vocab_size", (
                f"vocab_size {vocab} admits token ids the target cannot embed: its vocabulary has "
                f"{facts.vocab_size} tokens; use {facts.vocab_size} (or the data's tokenizer's target)")))
    return problems


def _init_from_problems(w: _Where, name: str, conf: Any, facts: Any) -> list[Problem]:
    """A drafter to start from (``init_from``) was made for a target of this hidden size and this block size."""
    if not conf.init_from:
        return []
    path = Path(conf.init_from).expanduser() / "config.json"
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return []  # a missing directory is a path problem; an unreadable one, setup's
    out = []
    hidden = d.get("hidden_size")
    if isinstance(hidden, int) and hidden != facts.hidden_size:
        out.append(w.problem(name, "init_from", (
            f"the drafter in {conf.init_from} has hidden_size {hidden}, the target {facts.hidden_size}: it was "
            "made for another target")))
    block = (d.get("dflash_config") or {}).get("block_size", d.get("block_size"))
    if isinstance(block, int) and block != conf.block_size:
        out.append(w.problem(name, "block_size", (
            f"block_size {conf.block_size}, but the drafter in {conf.init_from} was made with block_size {block}")))
    return out


def _path_problems(v: Validated, w: _Where) -> list[Problem]:
    """Data files and model directories that do not exist here."""
    out = []
    for name, conf in v.configs.items():
        for j, f in enumerate(conf.data_files()):
            if not Path(f).expanduser().is_file():
                out.append(w.problem(name, "paths", f"{f}: no such file (a data file {name} reads)", item=j))
        for field, value, kind in conf.input_paths():
            path = Path(value).expanduser()
            if kind == "dir" and not path.is_dir():
                found = w.problem(name, field, f"{field} {value} is not a directory here")
            elif kind == "file" and not path.is_file():
                found = w.problem(name, field, f"{field} file {value} does not exist")
            else:
                continue
            if not any((p.line, p.message) == (found.line, found.message) for p in out):  # one model: line
                out.append(found)
    return out
