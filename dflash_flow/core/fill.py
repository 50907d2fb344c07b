"""Values a pipeline section declares once for every stage (``Stage.section_fields``, e.g. ``model.target``):
filled into the stages that leave them out, refused where a stage sets another value."""

from __future__ import annotations

import json
from typing import Any

import attrs

from .registry import resolve
from .sections import section_to_dict
from .wording import short


def section_values(graph: Any, spec: Any, cls: Any) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The config values a section declares for this stage (``Stage.section_fields``) that the stage leaves
    out, and ``(field, message)`` for each field the stage sets to something else than its section."""
    filled: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for field, path in cls.section_fields.items():
        key, _, attr = path.partition(".")
        section = graph.sections.get(key)
        value = getattr(section, attr, None) if section is not None and attr else None
        if value is None:
            continue
        value = section_to_dict(value)
        if field not in spec.config:
            filled[field] = value
        elif spec.config[field] != value:
            problems.append((field, f"'{field}' is declared once, in {path} ({short(repr(value), 60)}); this stage "
                                    f"sets {short(repr(spec.config[field]), 60)}: remove it here, or change {path}"))
    return filled, problems


def resolved_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config as the stage gets it: its own values over those its sections declare (stages of
    a type that does not resolve keep their own)."""
    out = {}
    for spec in graph.stages:
        try:
            cls = resolve(spec.type)
        except Exception:  # reported by validation
            out[spec.name] = dict(spec.config)
            continue
        filled, _ = section_values(graph, spec, cls)
        out[spec.name] = {**filled, **spec.config}
    return out


def field_default(f: attrs.Attribute) -> Any:
    """A config field's default value (None for a required field or a default computed from the instance)."""
    if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
        return f.default.factory() if not f.default.takes_self else None
    return None if f.default is attrs.NOTHING else f.default


def complete_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config with every field written out: its own values, those its sections declare, and
    the defaults of every other field (a required field the stage leaves out stays out), as plain JSON
    values (tuples become lists). What the run records (MLflow params, ``pipeline.resolved.yaml``), so two
    runs compare field by field whether or not a YAML wrote a default out."""
    out = {}
    for name, config in resolved_stage_configs(graph).items():
        try:
            cls = resolve(graph.stage(name).type)
        except Exception:  # noqa: BLE001 - reported by validation; its own values are all there is
            out[name] = config
            continue
        full = {}
        for f in cls.config_fields():
            if f.name in config:
                full[f.name] = config[f.name]
            elif f.default is not attrs.NOTHING:
                full[f.name] = field_default(f)
        full.update({k: v for k, v in config.items() if k not in full})  # undeclared keys: validation's to refuse
        out[name] = json.loads(json.dumps(full, default=str))
    return out
