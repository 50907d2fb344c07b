"""Plots read the structured history: real PNGs, series picked from typed fields, nothing parsed."""

from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from samples_for_tests import full_sample, run_history

from dflash_flow.observe.plots import (
    bucket_mix,
    loss_series,
    plot_bucket_mix,
    plot_loss,
    plot_queue_depths,
    plot_throughput,
    queue_depth_series,
    write_plots,
)
from dflash_flow.observe.record import History, TrainSeries
from dflash_flow.observe.sample import BucketSample

REPO = Path(__file__).resolve().parents[2]


def png_size(path: Path) -> tuple[int, int]:
    """Width/height from a PNG's IHDR chunk; raises if the file is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def test_write_plots_makes_valid_pngs(tmp_path):
    made = write_plots(run_history(), tmp_path / "plots")
    assert set(made) == {"loss", "throughput", "queue_depths", "bucket_mix", "stage_load"}
    for name, path in made.items():
        assert path == tmp_path / "plots" / f"{name}.png"
        assert png_size(path) == (800, 450)
        assert path.stat().st_size > 5000, f"{name} looks empty"


def test_series_come_from_typed_fields():
    h = run_history()
    loss = loss_series(h)
    assert set(loss) == {"loss", "eval val val_loss"}  # "tau" is not a loss; "tokens_per_s" neither
    assert loss["eval val val_loss"] == [(50, 2.0), (150, 1.0)]
    depths = queue_depth_series(h)
    assert set(depths) == {f"padder[{i}]" for i in range(6)}  # target is a source: no queue
    assert depths["padder[0]"][:2] == [(0, 43.0), (10, 53.0)]


def test_missing_series_are_skipped(tmp_path):
    h = History()
    h.train.append(0, {"loss": 2.0})
    h.train.append(1, {"loss": 1.5, "unrelated": 1.0})
    made = write_plots(h, tmp_path)
    assert set(made) == {"loss"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
    assert write_plots(History(), tmp_path / "none") == {}
    assert plot_throughput(h, tmp_path / "t.png") is None
    assert plot_queue_depths(h, tmp_path / "q.png") is None
    assert plot_bucket_mix(h, tmp_path / "b.png") is None


def test_nan_points_are_dropped_and_a_closing_sample_is_not_a_window(tmp_path):
    series = TrainSeries()
    series.append(0, {"loss": float("nan")})
    series.append(1, {"loss": 1.0})
    series.append(2, {"loss": 0.5, "lr": 1e-3})
    assert series.series("loss") == [(1, 1.0), (2, 0.5)]
    assert math.isnan(series.columns["lr"][0]) and len(series.columns["lr"]) == 3
    h = History(train=series, samples=[attrs.evolve(full_sample(5), whole_run=True)])
    assert queue_depth_series(h) == {} and bucket_mix(h) == ([], {})
    assert png_size(plot_loss(h, tmp_path / "l.png")) == (800, 450)


def test_bucket_mix_from_window_shares():
    steps, shares = bucket_mix(run_history())
    assert len(steps) == 20 and list(shares) == ["128", "512", "2048"]  # natural order
    assert shares["128"][3] == pytest.approx(30 / 45) and shares["2048"][3] == pytest.approx(5 / 45)
    for j in range(len(steps)):
        assert sum(s[j] for s in shares.values()) == pytest.approx(1.0)
    # A window without dispatches has no share: left out. A bucket absent from a window counts 0.
    h = History(
        samples=[
            attrs.evolve(full_sample(1), buckets={"a": BucketSample(1.0, None)}),
            attrs.evolve(full_sample(2), buckets={"a": BucketSample(2.0, 1.0)}),
            attrs.evolve(full_sample(3), buckets={"a": BucketSample(2.0, 0.25), "b": BucketSample(3.0, 0.75)}),
        ]
    )
    steps, shares = bucket_mix(h)
    assert steps == [2.0, 3.0] and shares == {"a": [1.0, 0.25], "b": [0.0, 0.75]}


def test_importing_observe_does_not_import_heavy_libraries():
    code = (
        "import sys, dflash_flow.observe.plots, dflash_flow.observe.progress, dflash_flow.observe.bottleneck, "
        "dflash_flow.observe.report, dflash_flow.observe.record, dflash_flow.observe.tracking, dflash_flow.services; "
        "print(*[m in sys.modules for m in ('matplotlib', 'mlflow', 'rich', 'psutil')])"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False False False", out.stderr


def test_stage_names_the_font_cannot_draw_get_distinct_labels(tmp_path):
    import warnings

    from dflash_flow.observe.plots import label, stage_load_series

    h = run_history()
    rename = {"padder": "数据", "target": "数字"}
    h.samples = [attrs.evolve(s, stages={rename[k]: v for k, v in s.stages.items()}) for s in h.samples]
    assert set(stage_load_series(h)) == {"数据", "数字"}
    assert label("数据") == "\\u6570\\u636e" and label("数字") != label("数据")
    assert label("données") == "données" and label("padder") == "padder"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a missing glyph would warn (and draw boxes)
        made = write_plots(h, tmp_path)
    assert {"queue_depths", "stage_load"} <= set(made)


def _trained_history(steps: int = 200) -> History:
    """A run as the Monitor records it: a noisy loss and throughput per step, each step's length bucket."""
    from dflash_flow.observe.record import RunRecord
    from dflash_flow.observe.sample import TrainPoint

    ranges = {0: (1, 128), 1: (129, 512), 2: (513, 2048)}
    record = RunRecord()
    for step in range(1, steps + 1):
        bucket = (0, 0, 1, 2)[step % 4] if step <= steps // 2 else (0, 1)[step % 2]
        noise = 0.3 * math.sin(step * 1.7)
        record.add_train(TrainPoint(step, 0, {"loss": 4.0 * math.exp(-step / 60) + 1 + noise,
                                              "tokens_per_s": 9000 + 900 * noise, "samples_per_s": 30 + 3 * noise},
                                    bucket=bucket, bucket_range=ranges[bucket]))
    return record.history


def _legend_beside_the_data(fig, ax) -> None:
    fig.canvas.draw()
    legend = ax.get_legend() or fig.axes[-1].get_legend()
    assert legend is not None
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # right of the axes: never on a curve


def test_loss_and_throughput_are_smoothed_with_the_raw_values_faint_behind(tmp_path):
    from dflash_flow.observe.plots import loss_figure, smoothed, throughput_figure

    h = _trained_history()
    fig = loss_figure(h)
    ax = fig.axes[0]
    raw, smooth = ax.get_lines()
    assert raw.get_alpha() < 0.5 and smooth.get_alpha() in (None, 1.0)  # raw first (behind), faint
    assert list(raw.get_ydata()) == [v for _, v in h.train.series("loss")]
    assert list(smooth.get_ydata()) == smoothed(raw.get_ydata()) != list(raw.get_ydata())
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["loss (smoothed)"]
    _legend_beside_the_data(fig, ax)
    fig = throughput_figure(h)
    texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert texts == ["tokens/s (smoothed)", "samples/s (smoothed)"]
    _legend_beside_the_data(fig, fig.axes[0])
    # Smoothing: a constant stays itself (bias-corrected), a short series is left alone.
    assert smoothed([2.0] * 100) == pytest.approx([2.0] * 100) and smoothed([1.0, 5.0]) == [1.0, 5.0]
    assert png_size(plot_loss(h, tmp_path / "l.png")) == (800, 450)
    assert png_size(plot_throughput(h, tmp_path / "t.png")) == (800, 450)


def test_bucket_mix_spans_the_whole_run_with_each_buckets_length_range(tmp_path):
    from dflash_flow.observe.plots import bucket_mix_figure, trained_bucket_mix

    h = _trained_history()
    starts, shares = trained_bucket_mix(h)
    assert starts[0] == 0.0 and list(shares) == [0, 1, 2]
    for j in range(len(starts)):
        assert sum(s[j] for s in shares.values()) == pytest.approx(1.0)
    assert shares[2][0] > 0 and shares[2][-1] == 0  # the second half trains no bucket-2 batch
    fig = bucket_mix_figure(h)
    ax = fig.axes[0]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["bucket 0: 1-128 tokens", "bucket 1: 129-512 tokens", "bucket 2: 513-2048 tokens"]
    assert ax.get_xlim() == (0.0, 200.0)  # the whole run, first step to last
    _legend_beside_the_data(fig, ax)
    assert png_size(plot_bucket_mix(h, tmp_path / "b.png")) == (800, 450)
