"""Text descriptions of stage types (`dflash-flow stages`) and pictures of a graph (Mermaid, Graphviz dot, an
image when graphviz is installed)."""

from __future__ import annotations

import inspect
import shutil
import subprocess
from pathlib import Path

import attrs

from . import registry
from .convert_types import describe_type, field_types
from .devices import device_groups
from .graph import Graph
from .metrics import declared_metrics


def describe_stage(name: str) -> str:
    cls = registry.resolve(name)
    doc = inspect.getdoc(cls) or ""
    summary = doc.splitlines()[0] if doc else ""
    lines = [f"{name}  ({cls.__module__}.{cls.__qualname__})"]
    if summary:
        lines.append(f"  {summary}")
    ins, outs = (f"none ({none})" if t is None else "any" if t is object else t.__name__
                 for t, none in ((cls.input_type, "source"), (cls.output_type, "sink")))
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
        lines.append(f"  - {f.name}: {describe_type(hints.get(f.name, object))} ({default})"
                     f"{'  ' + doc_line if doc_line else ''}{f'  [{rules}]' if rules else ''}")
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


def _label(graph: Graph, name: str) -> str:
    s = graph.stage(name)
    extra = []
    if s.replicas > 1:
        extra.append(f"x{s.replicas}")
    if s.devices not in ("cpu", ["cpu"]):
        # One entry per replica list; a replica's own devices joined by '+': cuda:0+cuda:1,cuda:2+cuda:3
        extra.append(s.devices if isinstance(s.devices, str) else ",".join("+".join(g) for g in device_groups(s.devices)))
    suffix = f" ({' '.join(extra)})" if extra else ""
    return f"{name}: {s.type}{suffix}"


def _edges(graph: Graph, sep: str):
    """(stage, input, edge label) of every edge: its policy (where it fans out) and capacity."""
    for s in graph.stages:
        for inp in s.inputs:
            cap = s.capacity or graph.runtime.capacity
            yield s, inp, f"{inp.policy}{sep}cap {cap}" if s.replicas > 1 else f"cap {cap}"


def to_mermaid(graph: Graph) -> str:
    lines = ["flowchart LR", *(f'    {_id(s.name)}["{_label(graph, s.name)}"]' for s in graph.stages)]
    for s, inp, text in _edges(graph, " "):
        lines.append(f"    {_id(inp.stage)} -->|{text}{' ordered' if s.ordered else ''}| {_id(s.name)}")
    return "\n".join(lines) + "\n"


def to_dot(graph: Graph) -> str:
    lines = [f'digraph "{graph.name}" {{', "  rankdir=LR;", '  node [shape=box, style=rounded, fontname="Helvetica"];']
    lines += [f'  {_id(s.name)} [label="{_label(graph, s.name)}"];' for s in graph.stages]
    lines += [f'  {_id(inp.stage)} -> {_id(s.name)} [label="{text}"];' for s, inp, text in _edges(graph, "\\n")]
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_image(graph: Graph, path: str | Path) -> Path | None:
    """Write an image with graphviz's `dot` when it is installed; None otherwise."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "png"
    subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=to_dot(graph).encode(), check=True, timeout=60)
    return path


def _id(name: str) -> str:
    return "s_" + "".join(c if c.isalnum() else "_" for c in name)
