"""A PNG of the pipeline DAG drawn with matplotlib, for machines without graphviz.

Stages are placed in columns by their depth from the sources (longest path), rows in file order within
a column; edges are arrows labelled with the fan-out policy when the consumer is replicated.
"""

from __future__ import annotations

from pathlib import Path


def _depths(graph) -> dict[str, int]:
    depth: dict[str, int] = {}
    names = {s.name for s in graph.stages}

    def visit(name: str, seen: frozenset = frozenset()) -> int:
        if name in depth:
            return depth[name]
        spec = graph.stage(name)
        ups = [i.stage for i in spec.inputs if i.stage in names and i.stage not in seen]
        d = 0 if not ups else 1 + max(visit(u, seen | {name}) for u in ups)
        depth[name] = d
        return d

    for s in graph.stages:
        visit(s.name)
    return depth


def render_dag_png(graph, path: str | Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    depth = _depths(graph)
    columns: dict[int, list[str]] = {}
    for s in graph.stages:
        columns.setdefault(depth[s.name], []).append(s.name)
    ncols = max(columns) + 1
    nrows = max(len(v) for v in columns.values())
    pos = {}
    for c, names in columns.items():
        for r, name in enumerate(names):
            pos[name] = (c * 3.0, -(r - (len(names) - 1) / 2) * 1.4)
    fig = Figure(figsize=(max(6, ncols * 2.6), max(2.5, nrows * 1.3)))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    w, h = 2.3, 0.8
    for s in graph.stages:
        x, y = pos[s.name]
        ax.add_patch(FancyBboxPatch((x - w / 2, y - h / 2), w, h, boxstyle="round,pad=0.05", fc="#eef3fb", ec="#3b5b92"))
        extra = f" x{s.replicas}" if s.replicas > 1 else ""
        ax.text(x, y + 0.12, s.name, ha="center", va="center", fontsize=9, weight="bold")
        ax.text(x, y - 0.18, f"{s.type}{extra}", ha="center", va="center", fontsize=7)
        for inp in s.inputs:
            if inp.stage not in pos:
                continue
            x0, y0 = pos[inp.stage]
            # An edge that skips columns arcs over the boxes in between.
            skip = depth[s.name] - depth[inp.stage] > 1
            ax.add_patch(FancyArrowPatch(
                (x0 + w / 2, y0 + (0.25 if skip else 0)), (x - w / 2, y + (0.25 if skip else 0)),
                arrowstyle="-|>", mutation_scale=10, color="#555",
                connectionstyle="arc3,rad=-0.25" if skip else "arc3,rad=0",
            ))
            if s.replicas > 1 or s.ordered:
                label = inp.policy if s.replicas > 1 else "ordered"
                ax.text((x0 + x) / 2, (y0 + y) / 2 + 0.12, label, ha="center", fontsize=6, color="#555")
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ax.set_xlim(min(xs) - w, max(xs) + w)
    ax.set_ylim(min(ys) - 1, max(ys) + 1)
    ax.set_axis_off()
    ax.set_title(graph.name, fontsize=10)
    path = Path(path)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return path
