"""PNG plots of a run from its typed history and of the pipeline DAG: ``<name>_figure(history)`` (None without
data) and ``plot_<name>(history, path)``; matplotlib through ``Figure`` and Agg, never pyplot."""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Sequence
from pathlib import Path

from .names import eval_label
from .record import History

Series = dict[str, list[tuple[float, float]]]


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _windows(history: History):
    return [s for s in history.samples if not s.whole_run]


def loss_series(history: History) -> Series:
    """Trainer columns named ``*loss`` per step, and evaluation metrics named ``*loss``."""
    out: Series = {n: pts for n in history.train.columns if n.endswith("loss") and (pts := history.train.series(n))}
    for point in history.evals:
        for report in point.reports:
            for k, v in report.metrics.items():
                if k.endswith("loss") and math.isfinite(v):
                    out.setdefault(f"eval {eval_label(report)} {k}", []).append((point.step, v))
    return out


def queue_depth_series(history: History) -> Series:
    """``{"stage[replica]": [(step, depth)]}`` for every replica with an input queue."""
    out: Series = {}
    for sample in _windows(history):
        for name, st in sample.stages.items():
            for r in st.per_replica:
                if r.queue_depth is not None:
                    out.setdefault(f"{name}[{r.replica}]", []).append((sample.step, float(r.queue_depth)))
    return out


def stage_load_series(history: History) -> Series:
    """``{stage: [(step, busy fraction)]}``."""
    out: Series = {}
    for sample in _windows(history):
        for name, st in sample.stages.items():
            out.setdefault(name, []).append((sample.step, st.busy))
    return out


def bucket_mix(history: History) -> tuple[list[float], dict[str, list[float]]]:
    """Per-window share of each bucket among the batches the Interleaver dispatched: ``(steps, {bucket:
    [share]})``, windows without a dispatch left out; the plot's fallback for :func:`trained_bucket_mix`."""
    windows = [s for s in _windows(history) if any(b.share is not None for b in s.buckets.values())]
    names = sorted({b for s in windows for b in s.buckets}, key=_natural_key)
    steps = [float(s.step) for s in windows]
    shares = {b: [(s.buckets[b].share or 0.0) if b in s.buckets else 0.0 for s in windows] for b in names}
    return steps, shares


def trained_bucket_mix(history: History, bins: int = 50) -> tuple[list[float], dict[int, list[float]]]:
    """The share of each length bucket among the steps trained, the run's steps cut into at most ``bins``
    equal spans: ``(span starts, {bucket: [share per span]})``, spans without a trained step left out."""
    points = history.trained_buckets
    if not points:
        return [], {}
    last = max(step for step, _ in points)
    width = max(1, -(-last // bins))
    counts: dict[int, dict[int, int]] = {}
    for step, bucket in points:
        span = counts.setdefault(max(0, step - 1) // width, {})
        span[bucket] = span.get(bucket, 0) + 1
    names = sorted({b for _, b in points})
    order = sorted(counts)
    starts = [float(i * width) for i in order]
    shares = {b: [counts[i].get(b, 0) / sum(counts[i].values()) for i in order] for b in names}
    return starts, shares


def smoothed(ys: Sequence[float], span: int | None = None) -> list[float]:
    """An exponential moving average of ``ys``, bias-corrected at the start (it does not begin at 0), over
    about ``span`` points (default: a twentieth of the series, at least 1: no smoothing for short runs)."""
    n = len(ys)
    span = max(1, n // 20) if span is None else max(1, int(span))
    if span == 1:
        return [float(y) for y in ys]
    keep = 1.0 - 2.0 / (span + 1)
    out, avg, weight = [], 0.0, 0.0
    for y in ys:
        avg = keep * avg + (1.0 - keep) * float(y)
        weight = keep * weight + (1.0 - keep)
        out.append(avg / weight)
    return out


def _new_figure(**kwargs):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(**kwargs)
    FigureCanvasAgg(fig)
    return fig


def _figure(title: str):
    fig = _new_figure(figsize=(8, 4.5), dpi=100)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    return fig, ax


def _legend(ax, handles=None, *, fontsize: int = 8, ncol: int = 1, right: float = 1.02):
    """The legend beside the axes, never over the data (``tight_layout`` makes room for it)."""
    kwargs = {"loc": "upper left", "bbox_to_anchor": (right, 1.0), "borderaxespad": 0.0, "fontsize": fontsize,
              "ncol": ncol, "frameon": False}
    if handles is not None:
        return ax.legend(handles, [h.get_label() for h in handles], **kwargs)
    return ax.legend(**kwargs)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path


@functools.cache
def _font():
    from matplotlib import font_manager
    from matplotlib.ft2font import FT2Font

    return FT2Font(font_manager.findfont(font_manager.FontProperties()))


def label(name: str) -> str:
    """A legend label the plot font can draw: a name in a script the font lacks (CJK, say) is shown escaped
    (``\\u6570\\u636e``), not as a row of boxes indistinguishable from another stage's."""
    font = _font()
    if all(font.get_char_index(ord(c)) for c in name):
        return name
    return name.encode("ascii", "backslashreplace").decode("ascii")


def _each(series: Series):
    """``(colour, legend label, finite points)`` of each series with data, in natural order."""
    for i, name in enumerate(sorted(series, key=_natural_key)):
        if pts := [(s, v) for s, v in series[name] if v is not None and math.isfinite(v)]:
            yield f"C{i % 10}", label(name), pts


def _smoothed_line(ax, pts: Sequence[tuple[float, float]], name: str, color: str, **style) -> list:
    """The raw values faint behind, their moving average in front (the one in the legend)."""
    xs, ys = zip(*pts, strict=True)
    smooth = smoothed(ys)
    if smooth != list(ys):
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=0.8, label="_nolegend_")
        name = f"{name} (smoothed)"
    return ax.plot(xs, smooth, color=color, linewidth=1.5, label=name, **style)


def loss_figure(history: History):
    """The loss curves (smoothed, raw faint behind), or None without data."""
    series = loss_series(history)
    if not series:
        return None
    fig, ax = _figure("loss")
    for color, name, pts in _each(series):
        _smoothed_line(ax, pts, name, color)
    ys = [v for pts in series.values() for _, v in pts]
    if min(ys) > 0 and max(ys) / min(ys) > 30:
        ax.set_yscale("log")  # early losses dwarf the rest otherwise
    _legend(ax)
    return fig


def throughput_figure(history: History):
    """Tokens/s and samples/s (smoothed, raw faint behind), or None without data."""
    series = {name: pts for name in ("tokens_per_s", "samples_per_s") if (pts := history.train.series(name))}
    if not series:
        return None
    fig, ax = _figure("throughput")
    # Tokens/s and samples/s differ by about the mean length: separate y axes keep both readable.
    lines = []
    if "tokens_per_s" in series:
        lines += _smoothed_line(ax, series["tokens_per_s"], "tokens/s", "C0")
        ax.set_ylabel("tokens/s")
    if "samples_per_s" in series:
        target = ax.twinx() if lines else ax
        lines += _smoothed_line(target, series["samples_per_s"], "samples/s", "C1", linestyle="--")
        target.set_ylabel("samples/s")
    _legend(ax, lines, right=1.12 if len(lines) > 1 else 1.02)  # past the second y axis's labels
    return fig


def _lines_figure(series: Series, title: str, ylabel: str, ylim: tuple[float, float] | None = None, **style):
    if not series:
        return None
    fig, ax = _figure(title)
    for color, name, pts in _each(series):
        ax.plot(*zip(*pts, strict=True), label=name, color=color, **style)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_ylabel(ylabel)
    if len(series) <= 16:
        _legend(ax, fontsize=7, ncol=2 if len(series) > 8 else 1)
    return fig


def queue_depths_figure(history: History):
    return _lines_figure(queue_depth_series(history), "input queue depth per replica", "items waiting",
                         linewidth=1.0, drawstyle="steps-post")


def stage_load_figure(history: History):
    return _lines_figure(stage_load_series(history), "stage busy fraction (mean over replicas)", "busy", (0, 1.05),
                         linewidth=1.2)


def bucket_mix_figure(history: History):
    """The bucket mix of the trained steps over the whole run, each bucket's length range in the legend;
    without trained steps, the Interleaver's dispatch windows. None without data."""
    steps, shares = trained_bucket_mix(history)
    if steps:
        ranges = history.bucket_ranges  # each bucket's lengths, when known: "bucket 2: 129-256 tokens"
        labels = [f"bucket {b}: {r[0]}-{r[1]} tokens" if (r := ranges.get(b)) else f"bucket {b}"
                  for b in shares]
        title = "bucket mix (share of the steps trained)"
        # Each span's shares hold until the next span; the last one until the run's last step.
        end = float(max(step for step, _ in history.trained_buckets))
        steps = [*steps, max(end, steps[-1])]
        shares = {b: [*v, v[-1]] for b, v in shares.items()}
    else:
        steps, named = bucket_mix(history)
        if not steps:
            return None
        shares = named  # type: ignore[assignment]
        labels = [label(f"bucket {b}") for b in named]
        title = "bucket mix (share of dispatches per window)"
    fig, ax = _figure(title)
    ax.stackplot(steps, *shares.values(), labels=labels, alpha=0.85, step="post")
    last = max([*steps, *(float(s) for s in history.train.steps)])
    ax.set_xlim(0, max(last, 1.0))  # the whole run, not only the part a window saw
    ax.set_ylim(0, 1)
    ax.set_ylabel("share")
    _legend(ax, fontsize=7, ncol=2 if len(shares) > 12 else 1)
    return fig


def _plot(draw):
    def plot(history: History, path: str | Path) -> Path | None:
        fig = draw(history)
        return None if fig is None else _save(fig, path)

    plot.__doc__ = f"Draw ``{draw.__name__}`` into the PNG ``path`` (None: nothing to draw)."
    return plot


plot_loss = _plot(loss_figure)
plot_throughput = _plot(throughput_figure)
plot_queue_depths = _plot(queue_depths_figure)
plot_stage_load = _plot(stage_load_figure)
plot_bucket_mix = _plot(bucket_mix_figure)


def plot_heldout(history: History, path: str | Path) -> Path | None:
    """Acceptance over time: the trainer's held-out walk against steps and against wall time."""
    points = [(p.step, p.values.elapsed_s, p.values.tau) for p in history.heldout if math.isfinite(p.values.tau)]
    if not points:
        return None
    fig = _new_figure(figsize=(10, 4), dpi=100)
    by_step = fig.add_subplot(1, 2, 1)
    by_time = fig.add_subplot(1, 2, 2, sharey=by_step)
    fig.suptitle("held-out acceptance (teacher-forced walk) during training")
    steps, secs, taus = zip(*points, strict=True)
    by_step.plot(steps, taus, marker="o", markersize=3, linewidth=1.2, color="C0")
    by_step.set_xlabel("step")
    by_step.set_ylabel("tokens per block")
    by_time.plot(secs, taus, marker="o", markersize=3, linewidth=1.2, color="C1")
    by_time.set_xlabel("seconds since the trainer started")
    for ax in (by_step, by_time):
        ax.grid(alpha=0.3)
    return _save(fig, path)


def plot_position_rates(ours: dict[str, Sequence[float]], path: str | Path, *,
                        engine: dict[str, Sequence[float]] | None = None, title: str | None = None) -> Path | None:
    """Acceptance per draft position, one line per suite (``dflash-flow eval --suite``): ours solid, the
    serving engine's (where measured) dashed in the same colour. None when there is nothing to draw."""
    series = {name: list(r) for name, r in ours.items() if r}
    if not series:
        return None
    fig, ax = _figure(title or "acceptance rate per draft position, by suite")
    ax.set_xlabel("draft position (1 = the first token after the block's own)")
    ax.set_ylabel("share of verify steps accepting it")
    for i, name in enumerate(sorted(series, key=_natural_key)):
        color = f"C{i % 10}"
        rates = series[name]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", markersize=3, color=color, label=label(name))
        theirs = list((engine or {}).get(name) or [])
        if theirs:
            ax.plot(range(1, len(theirs) + 1), theirs, linestyle="--", marker="x", markersize=4, color=color,
                    label=label(f"{name} (engine)"))
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _legend(ax, fontsize=7)
    return _save(fig, path)


PLOTS = {
    "loss": plot_loss, "throughput": plot_throughput, "queue_depths": plot_queue_depths,
    "bucket_mix": plot_bucket_mix, "stage_load": plot_stage_load, "heldout_acceptance": plot_heldout,
}


def write_plots(history: History, out_dir: str | Path) -> dict[str, Path]:
    """Write every plot that has data into ``out_dir``; returns ``{plot name: path}``."""
    made = {name: fn(history, Path(out_dir) / f"{name}.png") for name, fn in PLOTS.items()}
    return {name: p for name, p in made.items() if p is not None}


# ------------------------------------------------------------------------------------------- the DAG
# Stages in columns by their depth from the sources (longest path), rows in file order within a column;
# edges labelled with the fan-out policy when the consumer is replicated.


def _depths(graph) -> dict[str, int]:
    depth: dict[str, int] = {}
    names = {s.name for s in graph.stages}

    def visit(name: str, seen: frozenset = frozenset()) -> int:
        if name not in depth:
            ups = [i.stage for i in graph.stage(name).inputs if i.stage in names and i.stage not in seen]
            depth[name] = 1 + max(visit(u, seen | {name}) for u in ups) if ups else 0
        return depth[name]

    for s in graph.stages:
        visit(s.name)
    return depth


def render_dag_png(graph, path: str | Path) -> Path:
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    depth = _depths(graph)
    columns: dict[int, list[str]] = {}
    for s in graph.stages:
        columns.setdefault(depth[s.name], []).append(s.name)
    ncols = max(columns) + 1
    nrows = max(len(v) for v in columns.values())
    pos = {name: (c * 3.0, -(r - (len(names) - 1) / 2) * 1.4)
           for c, names in columns.items() for r, name in enumerate(names)}
    fig = _new_figure(figsize=(max(6, ncols * 2.6), max(2.5, nrows * 1.3)))
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
                tag = inp.policy if s.replicas > 1 else "ordered"
                ax.text((x0 + x) / 2, (y0 + y) / 2 + 0.12, tag, ha="center", fontsize=6, color="#555")
    xs, ys = zip(*pos.values(), strict=True)
    ax.set_xlim(min(xs) - w, max(xs) + w)
    ax.set_ylim(min(ys) - 1, max(ys) + 1)
    ax.set_axis_off()
    ax.set_title(graph.name, fontsize=10)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    return Path(path)
