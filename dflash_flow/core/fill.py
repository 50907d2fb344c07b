"""Values a pipeline section declares once for every stage (``Stage.section_fields``, e.g. ``model.target``):
filled into the stages that leave them out, refused where a stage sets another value."""

from __future__ import annotations

from typing import Any

from .convert import short
from .registry import resolve
from .sections import section_to_dict


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
