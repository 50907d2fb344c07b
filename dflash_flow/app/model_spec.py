"""The model facts, resolved once: the one home of target resolution, the ``ModelSpec`` built from the
``model:`` section, and the static checks that read it (``dflash-flow validate`` and ``run``): the layers the
drafter fuses exist in the target, the mask token and a source's vocabulary fit the target's vocabulary, each
stage's own view of the spec (``model.spec.UsesModel``), and the data files and model directories named exist
(``check_paths=False`` skips that, for validating elsewhere).

Each problem names the file and line of the value to change: the ``model:`` key, or the stage's own field.
The target's sizes come from its ``config.json`` or its preset (``model.facts``: no torch, no transformers, no
network); a target that cannot be read here (a hub id) is checked by the stages' setup instead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_flow.core.devices import device_groups
from dflash_flow.core.errors import Problem
from dflash_flow.core.validate import Validated
from dflash_flow.model.spec import ModelSpec, UsesModel


def resolve_target(target: Any) -> Any:
    """A ``target`` value as the model layer takes it: ``embedded`` is the target this project ships (its
    directory, built on first use when the asset is missing); a mapping is a config preset; anything else a
    path, preset name or hub id. The one place a declared target becomes a loadable one."""
    if target is None:
        return None
    if isinstance(target, dict):
        return dict(target)
    if target == "embedded":
        from dflash_flow.embedded.train_target import embedded_target_path

        return embedded_target_path()
    return str(target)


def _tokenizer_dir(tokenizer: str | None, target: Any) -> str | None:
    """``model.tokenizer``, else the target when it is a local directory (its tokenizer lives beside it)."""
    if tokenizer:
        return tokenizer if tokenizer != "embedded" else resolve_target("embedded")
    if isinstance(target, str) and Path(target).expanduser().is_dir():
        return target
    return None


def build_model_spec(graph: Any) -> ModelSpec:
    """``graph``'s ``model:`` section resolved (a graph without one: a spec with nothing declared)."""
    from dflash_flow.model.facts import target_facts

    section = graph.sections.get("model")
    if section is None:
        return ModelSpec()
    if isinstance(section, dict):  # set in Python and not validated yet
        from dflash_flow.app.sections import ModelConfig

        section = ModelConfig(**section)
    target = resolve_target(section.target)
    ids = section.target_layer_ids
    return ModelSpec(
        declared=section.target,
        target=target,
        tokenizer=_tokenizer_dir(section.tokenizer, target),
        trust_remote_code=bool(section.trust_remote_code),
        num_draft_layers=section.num_draft_layers,
        block_size=section.block_size,
        mask_token_id=section.mask_token_id,
        explicit_layer_ids=tuple(ids) if ids is not None else None,
        facts=target_facts(target) if target is not None else None,
        engine=getattr(section, "engine", None),
        features=getattr(section, "features", None),
    )


class _Where:
    """File and line of a ``model:`` key or of a stage's field."""

    def __init__(self, v: Validated) -> None:
        self.v = v
        self.loc = v.graph.locator
        self.index = {s.name: i for i, s in enumerate(v.graph.stages)}

    def _line(self, *paths: tuple[Any, ...]) -> int | None:
        for path in paths:
            line = self.loc.line(*path) if self.loc is not None else None
            if line is not None:
                return line
        return None

    def problem(self, stage: str | None, field: str, message: str, item: int | None = None) -> Problem:
        if field.startswith("model."):
            keys = tuple(field.split(".")[1:])  # model.engine.servers: the deepest key written, else its parents
            stage_line = ("stages", self.index[stage]) if stage is not None else ("model",)
            line = self._line(*(("model", *keys[:n]) for n in range(len(keys), 0, -1)), ("model",), stage_line)
        else:  # a stage's own config field, or its placement (devices)
            path: tuple[Any, ...] = ("stages", self.index[stage], *(() if field == "devices" else ("config",)), field)
            line = self._line((*path, item) if item is not None else path, ("stages", self.index[stage]))
        return Problem(message, file=self.loc.filename if self.loc is not None else None, line=line,
                       stage=stage, field=field)


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
    out = _subsection_problems(w, spec)
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
        from dflash_flow.engine.layers import to_engine_layer_ids

        try:
            to_engine_layer_ids(ids, facts.depth)
        except ValueError as exc:
            out.append(w.problem(None, field, str(exc)))
    if spec.mask_token_id is not None and spec.mask_token_id >= facts.vocab_size:
        out.append(w.problem(None, "model.mask_token_id", (
            f"mask_token_id {spec.mask_token_id} is outside the target's vocabulary of {facts.vocab_size} "
            f"tokens (ids 0-{facts.vocab_size - 1})")))
    return out


def _subsection_problems(w: _Where, spec: ModelSpec) -> list[Problem]:
    """What ``model.engine`` and ``model.features`` say of themselves (values that cannot work together)."""
    out = []
    for key, section in (("engine", spec.engine), ("features", spec.features)):
        if section is not None:
            out += [w.problem(None, f"model.{key}.{field}", message) for field, message in section.problems()]
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
