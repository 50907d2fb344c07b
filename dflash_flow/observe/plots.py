"""PNG plots of a run from its metric history: loss, throughput, queue depths, bucket mix.

``history`` is ``{metric name: [(step, value), ...]}`` (what the Monitor accumulates; see
``append_history``). Series are picked by name with the patterns below (override with ``keys=``);
a plot whose series are all missing is skipped (the function returns None), NaN/inf points are
dropped. matplotlib is imported lazily and used through ``matplotlib.figure.Figure`` with the Agg
canvas -- never pyplot -- so plotting needs no display, does not touch global pyplot state, and is
safe from a non-main thread.

Default name patterns (regular expressions, searched in the metric name):

- loss:        ``(^|/)([a-z_]*loss)$``           e.g. ``loss``, ``train/loss``, ``eval/val_loss``
- throughput:  ``(tokens|samples)_per_s$``       e.g. ``throughput/tokens_per_s``
- queue depth: ``(^|/)(queue_depth|depth)$``     e.g. ``channel/padder/1/depth``: one line per series
- bucket mix:  ``bucket[/_.](?P<bucket>[^/]+?)(/(count|dispatched|batches|dispatches|samples))?$``
               e.g. ``bucket/512/dispatched``; cumulative counters are differenced automatically.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

History = Mapping[str, Sequence[tuple[float, float]]]

LOSS_PATTERN = r"(^|/)([a-z_]*loss)$"
THROUGHPUT_PATTERN = r"(tokens|samples)_per_s$"
QUEUE_PATTERN = r"(^|/)(queue_depth|depth)$"
BUCKET_PATTERN = r"bucket[/_.](?P<bucket>[^/]+?)(/(count|dispatched|batches|dispatches|samples))?$"


def append_history(
    history: dict[str, list[tuple[float, float]]], metrics: Mapping[str, float], step: int
) -> None:
    """Add one sample of metrics to a history dict (numbers only)."""
    for k, v in metrics.items():
        try:
            history.setdefault(k, []).append((step, float(v)))
        except (TypeError, ValueError):
            continue


def _clean(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for p in points or ():
        try:
            s, v = float(p[0]), float(p[1])
        except (TypeError, ValueError, IndexError):
            continue
        if math.isfinite(s) and math.isfinite(v):
            out.append((s, v))
    out.sort(key=lambda p: p[0])
    return out


def _select(
    history: History, pattern: str, keys: Sequence[str] | None
) -> dict[str, list[tuple[float, float]]]:
    names = list(keys) if keys is not None else [k for k in history if re.search(pattern, k)]
    picked = {}
    for name in names:
        pts = _clean(history.get(name, ()))
        if pts:
            picked[name] = pts
    return picked


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


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


def plot_loss(history: History, path: str | Path, keys: Sequence[str] | None = None) -> Path | None:
    series = _select(history, LOSS_PATTERN, keys)
    if not series:
        return None
    fig, ax = _figure("loss")
    for name in sorted(series, key=_natural_key):
        xs, ys = zip(*series[name], strict=True)
        ax.plot(xs, ys, label=name, linewidth=1.2)
    ys_all = [v for pts in series.values() for _, v in pts]
    if min(ys_all) > 0 and max(ys_all) / min(ys_all) > 30:
        ax.set_yscale("log")  # early losses dwarf the rest otherwise
    ax.legend(loc="best", fontsize=8)
    return _save(fig, path)


def plot_throughput(history: History, path: str | Path, keys: Sequence[str] | None = None) -> Path | None:
    series = _select(history, THROUGHPUT_PATTERN, keys)
    if not series:
        return None
    fig, ax = _figure("throughput")
    tokens = {k: v for k, v in series.items() if "token" in k}
    others = {k: v for k, v in series.items() if k not in tokens}
    # Tokens/s and samples/s differ by ~the mean length: separate y axes keep both readable.
    groups = (
        [(ax, tokens, "tokens/s", "-"), (ax.twinx(), others, "samples/s", "--")]
        if tokens and others
        else [(ax, series, "tokens/s" if tokens else "samples/s", "-")]
    )
    lines = []
    for target, group, unit, style in groups:
        for name in sorted(group, key=_natural_key):
            xs, ys = zip(*group[name], strict=True)
            color = f"C{len(lines) % 10}"  # twin axes each restart the color cycle; keep lines distinct
            lines += target.plot(xs, ys, label=name, linewidth=1.2, linestyle=style, color=color)
        target.set_ylabel(unit)
    ax.legend(lines, [ln.get_label() for ln in lines], loc="best", fontsize=8)
    return _save(fig, path)


def plot_queue_depths(history: History, path: str | Path, keys: Sequence[str] | None = None) -> Path | None:
    series = _select(history, QUEUE_PATTERN, keys)
    if not series:
        return None
    fig, ax = _figure("input queue depth per replica")
    for name in sorted(series, key=_natural_key):
        xs, ys = zip(*series[name], strict=True)
        label = re.sub(QUEUE_PATTERN, "", name).strip("/") or name
        ax.plot(xs, ys, label=label, linewidth=1.0, drawstyle="steps-post")
    ax.set_ylabel("items waiting")
    if len(series) <= 16:
        ax.legend(loc="best", fontsize=7, ncol=2 if len(series) > 8 else 1)
    return _save(fig, path)


def bucket_mix(
    history: History, keys: Sequence[str] | None = None, *, cumulative: bool | None = None
) -> tuple[list[float], dict[str, list[float]]]:
    """Per-step share of each bucket: ``(steps, {bucket: [share, ...]})``; steps without any
    dispatch are left out, so shares sum to 1 at every step. ``cumulative=None`` detects running counters: when every series is
    non-decreasing (and one grows) they are differenced first; the decision is made for all series
    together, since mixing differenced and raw counts would skew the shares."""
    series = _select(history, BUCKET_PATTERN, keys)
    if cumulative is None:
        vals = [[v for _, v in pts] for pts in series.values()]
        cumulative = all(all(b >= a for a, b in zip(v[:-1], v[1:], strict=True)) for v in vals) and any(
            len(v) > 1 and v[-1] > v[0] for v in vals
        )
    per_bucket: dict[str, dict[float, float]] = {}
    for name, pts in series.items():
        m = re.search(BUCKET_PATTERN, name)
        bucket = m["bucket"] if m else name
        d = per_bucket.setdefault(bucket, {})
        prev = 0.0
        for s, v in pts:
            d[s] = d.get(s, 0.0) + (v - prev if cumulative else v)
            prev = v
    steps = []
    shares: dict[str, list[float]] = {b: [] for b in sorted(per_bucket, key=_natural_key)}
    for s in sorted({s for d in per_bucket.values() for s in d}):
        total = sum(max(0.0, d.get(s, 0.0)) for d in per_bucket.values())
        if total <= 0:
            continue  # nothing dispatched in this window: no mix to show
        steps.append(s)
        for b in shares:
            shares[b].append(max(0.0, per_bucket[b].get(s, 0.0)) / total)
    return steps, shares


def plot_bucket_mix(
    history: History, path: str | Path, keys: Sequence[str] | None = None, *, cumulative: bool | None = None
) -> Path | None:
    steps, shares = bucket_mix(history, keys, cumulative=cumulative)
    if not steps:
        return None
    fig, ax = _figure("bucket mix (share of dispatches)")
    ax.stackplot(steps, *shares.values(), labels=[f"bucket {b}" for b in shares], alpha=0.85)
    ax.set_ylim(0, 1)
    ax.set_ylabel("share")
    ax.legend(loc="upper left", fontsize=7, ncol=2 if len(shares) > 6 else 1)
    return _save(fig, path)


def write_plots(history: History, out_dir: str | Path) -> dict[str, Path]:
    """Write every plot that has data into ``out_dir``; returns ``{plot name: path}``."""
    out_dir = Path(out_dir)
    made = {}
    for name, fn in (
        ("loss", plot_loss),
        ("throughput", plot_throughput),
        ("queue_depths", plot_queue_depths),
        ("bucket_mix", plot_bucket_mix),
    ):
        p = fn(history, out_dir / f"{name}.png")
        if p is not None:
            made[name] = p
    return made
