"""PNG plots of a run from its structured history (``observe.record.History``): loss, throughput, queue
depths, bucket mix, stage load, held-out acceptance over steps and wall time.

Series are read from the typed history (trainer columns, Monitor samples, evaluations), never picked
out of metric names. A plot without data is skipped (its function returns None); NaN points are
dropped. Window plots leave out the Monitor's closing whole-run sample, which is not a window.
matplotlib is imported lazily and used through ``matplotlib.figure.Figure`` with the Agg canvas --
never pyplot -- so plotting needs no display, leaves global pyplot state alone, and is safe from a
non-main thread.
"""

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


def _finite_points(points: Sequence[tuple[float, float | None]]) -> list[tuple[float, float]]:
    return [(s, v) for s, v in points if v is not None and math.isfinite(v)]


def _windows(history: History):
    return [s for s in history.samples if not s.whole_run]


# ----------------------------------------------------------------------------- series from history


def loss_series(history: History) -> Series:
    """Trainer columns named ``*loss`` per step, and evaluation metrics named ``*loss``."""
    out: Series = {}
    for name in history.train.columns:
        if name.endswith("loss"):
            pts = history.train.series(name)
            if pts:
                out[name] = pts
    for point in history.evals:
        for report in point.reports:
            for k, v in report.metrics.items():
                if k.endswith("loss") and math.isfinite(v):
                    out.setdefault(f"eval {eval_label(report)} {k}", []).append((point.step, v))
    return out


def throughput_series(history: History) -> Series:
    out: Series = {}
    for name in ("tokens_per_s", "samples_per_s"):
        pts = history.train.series(name)
        if pts:
            out[name] = pts
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
    """Per-window share of each bucket among the batches dispatched: ``(steps, {bucket: [share]})``.
    Windows without a dispatch are left out, so the shares sum to 1 at every step shown."""
    windows = [s for s in _windows(history) if any(b.share is not None for b in s.buckets.values())]
    names = sorted({b for s in windows for b in s.buckets}, key=_natural_key)
    steps = [float(s.step) for s in windows]
    shares = {b: [(s.buckets[b].share or 0.0) if b in s.buckets else 0.0 for s in windows] for b in names}
    return steps, shares


# ----------------------------------------------------------------------------------------- drawing


def _figure(title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(True, alpha=0.3)
    return fig, ax


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
    """A legend label the plot font can draw: a stage name in a script the font lacks (CJK, say)
    would be a row of identical boxes -- two such stages indistinguishable -- so it is shown escaped
    (``\\u6570\\u636e``) instead."""
    font = _font()
    if all(font.get_char_index(ord(c)) for c in name):
        return name
    return name.encode("ascii", "backslashreplace").decode("ascii")


def _lines(ax, series: Series, **style) -> list:
    drawn = []
    for i, name in enumerate(sorted(series, key=_natural_key)):
        pts = _finite_points(series[name])
        if pts:
            xs, ys = zip(*pts, strict=True)
            drawn += ax.plot(xs, ys, label=label(name), color=f"C{i % 10}", **style)
    return drawn


def plot_loss(history: History, path: str | Path) -> Path | None:
    series = loss_series(history)
    if not series:
        return None
    fig, ax = _figure("loss")
    _lines(ax, series, linewidth=1.2)
    ys = [v for pts in series.values() for _, v in pts]
    if min(ys) > 0 and max(ys) / min(ys) > 30:
        ax.set_yscale("log")  # early losses dwarf the rest otherwise
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def plot_throughput(history: History, path: str | Path) -> Path | None:
    series = throughput_series(history)
    if not series:
        return None
    fig, ax = _figure("throughput")
    # Tokens/s and samples/s differ by about the mean length: separate y axes keep both readable.
    lines = []
    if "tokens_per_s" in series:
        xs, ys = zip(*series["tokens_per_s"], strict=True)
        lines += ax.plot(xs, ys, label="tokens/s", linewidth=1.2, color="C0")
        ax.set_ylabel("tokens/s")
    if "samples_per_s" in series:
        target = ax.twinx() if lines else ax
        xs, ys = zip(*series["samples_per_s"], strict=True)
        lines += target.plot(xs, ys, label="samples/s", linewidth=1.2, linestyle="--", color="C1")
        target.set_ylabel("samples/s")
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    return _save(fig, path)


def plot_queue_depths(history: History, path: str | Path) -> Path | None:
    series = queue_depth_series(history)
    if not series:
        return None
    fig, ax = _figure("input queue depth per replica")
    _lines(ax, series, linewidth=1.0, drawstyle="steps-post")
    ax.set_ylabel("items waiting")
    if len(series) <= 16:
        ax.legend(loc="best", fontsize=7, ncol=2 if len(series) > 8 else 1)
    return _save(fig, path)


def plot_stage_load(history: History, path: str | Path) -> Path | None:
    series = stage_load_series(history)
    if not series:
        return None
    fig, ax = _figure("stage busy fraction (mean over replicas)")
    _lines(ax, series, linewidth=1.2)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("busy")
    if len(series) <= 16:
        ax.legend(loc="best", fontsize=7, ncol=2 if len(series) > 8 else 1)
    return _save(fig, path)


def plot_bucket_mix(history: History, path: str | Path) -> Path | None:
    steps, shares = bucket_mix(history)
    if not steps:
        return None
    fig, ax = _figure("bucket mix (share of dispatches per window)")
    ax.stackplot(steps, *shares.values(), labels=[label(f"bucket {b}") for b in shares], alpha=0.85)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share")
    ax.legend(loc="upper left", fontsize=7, ncol=2 if len(shares) > 6 else 1)
    return _save(fig, path)


def plot_heldout(history: History, path: str | Path) -> Path | None:
    """Acceptance over time: the trainer's held-out walk against steps and against wall time."""
    points = [(p.step, p.values.elapsed_s, p.values.tau) for p in history.heldout if math.isfinite(p.values.tau)]
    if not points:
        return None
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
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


PLOTS = {
    "loss": plot_loss,
    "throughput": plot_throughput,
    "queue_depths": plot_queue_depths,
    "bucket_mix": plot_bucket_mix,
    "stage_load": plot_stage_load,
    "heldout_acceptance": plot_heldout,
}


def write_plots(history: History, out_dir: str | Path) -> dict[str, Path]:
    """Write every plot that has data into ``out_dir``; returns ``{plot name: path}``."""
    out_dir = Path(out_dir)
    made = {}
    for name, fn in PLOTS.items():
        p = fn(history, out_dir / f"{name}.png")
        if p is not None:
            made[name] = p
    return made
