"""Pictures of a graph: Mermaid and Graphviz dot text, and an image when graphviz is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from .devices import device_groups
from .graph import Graph


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


def to_mermaid(graph: Graph) -> str:
    lines = ["flowchart LR"]
    for s in graph.stages:
        lines.append(f'    {_id(s.name)}["{_label(graph, s.name)}"]')
    for s in graph.stages:
        for inp in s.inputs:
            cap = s.capacity or graph.runtime.capacity
            text = f"{inp.policy} cap {cap}" if graph.stage(s.name).replicas > 1 else f"cap {cap}"
            if s.ordered:
                text += " ordered"
            lines.append(f"    {_id(inp.stage)} -->|{text}| {_id(s.name)}")
    return "\n".join(lines) + "\n"


def to_dot(graph: Graph) -> str:
    lines = [f'digraph "{graph.name}" {{', "  rankdir=LR;", '  node [shape=box, style=rounded, fontname="Helvetica"];']
    for s in graph.stages:
        lines.append(f'  {_id(s.name)} [label="{_label(graph, s.name)}"];')
    for s in graph.stages:
        for inp in s.inputs:
            cap = s.capacity or graph.runtime.capacity
            text = f"{inp.policy}\\ncap {cap}" if s.replicas > 1 else f"cap {cap}"
            lines.append(f'  {_id(inp.stage)} -> {_id(s.name)} [label="{text}"];')
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
