"""Text descriptions of stage types (for `dflash-flow stages`)."""

from __future__ import annotations

import inspect

import attrs

from . import registry
from .metrics import declared_metrics
from .wording import describe_type, field_types


def describe_stage(name: str) -> str:
    cls = registry.resolve(name)
    doc = inspect.getdoc(cls) or ""
    summary = doc.splitlines()[0] if doc else ""
    lines = [f"{name}  ({cls.__module__}.{cls.__qualname__})"]
    if summary:
        lines.append(f"  {summary}")
    ins = "none (source)" if cls.input_type is None else ("any" if cls.input_type is object else cls.input_type.__name__)
    outs = "none (sink)" if cls.output_type is None else ("any" if cls.output_type is object else cls.output_type.__name__)
    lines.append(f"  input: {ins}   output: {outs}   cardinality: {cls.cardinality}")
    fields = cls.config_fields()
    hints = field_types(cls)
    if not fields:
        lines.append("  config: (none)")
    for f in fields:
        if f.default is attrs.NOTHING:
            default = "required"
        elif isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
            default = f"default {f.default.factory()!r}"
        else:
            default = f"default {f.default!r}"
        doc_line = f.metadata.get("doc", "")
        rules = _rules(f)
        lines.append(
            f"  - {f.name}: {describe_type(hints.get(f.name, object))} ({default})"
            f"{'  ' + doc_line if doc_line else ''}{f'  [{rules}]' if rules else ''}"
        )
    return "\n".join(lines + _metric_lines(cls))


def _metric_lines(cls: type) -> list[str]:
    """The metrics the stage declares (its ``stage_metrics`` classes), as MLflow names them."""
    listed = [m for group in cls.stage_metrics for m in declared_metrics(group)]
    if not listed:
        return []
    out = ["  metrics (in MLflow: stage/<stage>/metric/<name>; a summary's /count /mean /min /max, a labeled one's "
           "/<label>):"]
    for name, kind, unit, description in listed:
        out.append(f"  - {name}: {kind.__name__.lower()}{f', {unit}' if unit else ''}  {description}")
    return out


_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _rules(f: attrs.Attribute) -> str:
    """What ``cfg`` declared beyond the type: bounds, choices, whether .inf/.nan are accepted."""
    rules = [f"{_OPS[k]} {v}" for k, v in f.metadata.get("bounds", {}).items()]
    if f.metadata.get("choices"):
        rules.append("one of " + ", ".join(repr(c) for c in f.metadata["choices"]))
    if f.metadata.get("finite") is False:
        rules.append(".inf and .nan accepted")
    return ", ".join(rules)
