"""Stage configs as a run records them, and the fields that moved out of the stages into a section
(``Stage.moved_fields``, e.g. ``target`` into ``model.target``): what an old pipeline file that still sets one
is told, and how the settings of a checkpoint written before the move read today."""

from __future__ import annotations

import json
from typing import Any

import attrs

from .registry import resolve
from .sections import section_to_dict


def moved_field_message(field: str, path: str) -> str:
    """One line for a pipeline that sets a field that moved into a section."""
    return (f"'{field}' moved to {path}, which declares it once for every stage: remove it from this stage and "
            f"set {path} (see the README's YAML reference)")


def moved_fields_of(graph: Any) -> dict[str, dict[str, str]]:
    """``{stage name: {field: "section.key"}}`` for the stages whose type moved fields into a section."""
    out = {}
    for spec in graph.stages:
        try:
            cls = resolve(spec.type)
        except Exception:  # noqa: BLE001 - reported by validation
            continue
        if cls.moved_fields:
            out[spec.name] = dict(cls.moved_fields)
    return out


def section_value(graph: Any, path: str) -> Any:
    """The value of ``section.key`` in ``graph`` as plain data (None when the section or key is absent)."""
    key, _, attr = path.partition(".")
    section = graph.sections.get(key)
    return section_to_dict(getattr(section, attr, None)) if section is not None and attr else None


def legacy_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config as releases before the move gave it to the stage: its own values, and each moved
    field filled from its section where the section declares it. Only for the hash of checkpoints that predate
    recorded settings (``app.prepare.legacy_config_hash``)."""
    moved = moved_fields_of(graph)
    out = {}
    for spec in graph.stages:
        filled = {}
        for field, path in moved.get(spec.name, {}).items():
            value = section_value(graph, path)
            if value is not None:
                filled[field] = value
        out[spec.name] = {**filled, **spec.config}
    return out


def field_default(f: attrs.Attribute) -> Any:
    """A config field's default value (None for a required field or a default computed from the instance)."""
    if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
        return f.default.factory() if not f.default.takes_self else None
    return None if f.default is attrs.NOTHING else f.default


def complete_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config with every field written out: its own values and the defaults of every other field
    (a required field the stage leaves out stays out), as plain JSON values (tuples become lists). What the run
    records (MLflow params, ``pipeline.resolved.yaml``), so two runs compare field by field whether or not a
    YAML wrote a default out."""
    out = {}
    for spec in graph.stages:
        config = dict(spec.config)
        try:
            cls = resolve(spec.type)
        except Exception:  # noqa: BLE001 - reported by validation; its own values are all there is
            out[spec.name] = config
            continue
        full = {}
        for f in cls.config_fields():
            if f.name in config:
                full[f.name] = config[f.name]
            elif f.default is not attrs.NOTHING:
                full[f.name] = field_default(f)
        full.update({k: v for k, v in config.items() if k not in full})  # undeclared keys: validation's to refuse
        out[spec.name] = json.loads(json.dumps(full, default=str))
    return out
