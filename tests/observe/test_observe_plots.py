from __future__ import annotations

import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_flow.observe.plots import (
    append_history,
    bucket_mix,
    plot_bucket_mix,
    plot_loss,
    plot_queue_depths,
    plot_throughput,
    write_plots,
)

REPO = Path(__file__).resolve().parents[2]


def png_size(path: Path) -> tuple[int, int]:
    """Width/height from a PNG's IHDR chunk; raises if the file is not a PNG."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"
    return struct.unpack(">II", data[16:24])


def full_history() -> dict:
    h: dict = {}
    q_pre = [43, 50, 28, 31, 25, 39]  # the seed team's per-replica view
    for step in range(0, 200, 10):
        m = {
            "train/loss": 5.0 * math.exp(-step / 80) + 0.5,
            "eval/val_loss": 5.5 * math.exp(-step / 90) + 0.6 if step % 50 == 0 else float("nan"),
            "throughput/tokens_per_s": 12000 + 50 * step,
            "throughput/samples_per_s": 40 + step / 10,
            "bucket/128/dispatched": 3 * step,  # cumulative counters
            "bucket/512/dispatched": step,
            "bucket/2048/dispatched": step // 2,
        }
        for r, q in enumerate(q_pre):
            m[f"channel/padder/{r}/depth"] = (q + step) % 64
        append_history(h, m, step)
    return h


def test_write_plots_makes_valid_pngs(tmp_path):
    made = write_plots(full_history(), tmp_path / "plots")
    assert set(made) == {"loss", "throughput", "queue_depths", "bucket_mix"}
    for name, path in made.items():
        assert path == tmp_path / "plots" / f"{name}.png"
        w, h = png_size(path)
        assert (w, h) == (800, 450)
        assert path.stat().st_size > 5000, f"{name} looks empty"


def test_missing_series_are_skipped(tmp_path):
    h = {"train/loss": [(0, 2.0), (1, 1.5)], "unrelated": [(0, 1.0)], "throughput/tokens_per_s": []}
    made = write_plots(h, tmp_path)
    assert set(made) == {"loss"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loss.png"]
    assert write_plots({}, tmp_path / "none") == {}
    assert plot_throughput(h, tmp_path / "t.png") is None
    assert plot_queue_depths({"x/depth": [(0, float("nan"))]}, tmp_path / "q.png") is None
    assert plot_bucket_mix({}, tmp_path / "b.png") is None


def test_explicit_keys_and_single_series(tmp_path):
    h = {"my_tps": [(1, 10.0), (2, 12.0)], "lossy": [(0, 1.0), (1, 0.5), (2, "bad")]}
    assert png_size(plot_throughput(h, tmp_path / "t.png", keys=["my_tps"])) == (800, 450)
    assert png_size(plot_loss(h, tmp_path / "l.png", keys=["lossy", "absent"])) == (800, 450)


def test_bucket_mix_shares_from_cumulative_and_window_counts():
    steps, shares = bucket_mix(full_history())
    assert steps[0] == 10 and len(steps) == 19  # step 0: counters still 0, nothing to mix
    assert list(shares) == ["128", "512", "2048"]  # natural order
    i = steps.index(100)
    assert shares["128"][i] == pytest.approx(30 / 45)  # per-window: 30 vs 10 vs 5 dispatches
    assert shares["2048"][i] == pytest.approx(5 / 45)
    for j in range(len(steps)):
        assert sum(s[j] for s in shares.values()) == pytest.approx(1.0)
    # window counts (not cumulative) are used as they are
    steps, shares = bucket_mix({"bucket/a/count": [(0, 1), (1, 3)], "bucket/b/count": [(0, 3), (1, 1)]})
    assert shares["a"] == pytest.approx([0.25, 0.75])
    _, shares = bucket_mix(
        {"bucket/a/count": [(0, 1), (1, 3)], "bucket/b/count": [(0, 3), (1, 3)]}, cumulative=False
    )
    assert shares["a"] == pytest.approx([0.25, 0.5])
    _, shares = bucket_mix({"bucket/a/count": [(0, 1), (1, 3)], "bucket/b/count": [(0, 3), (1, 3)]})
    assert shares["a"] == pytest.approx([0.25, 1.0])  # both non-decreasing: running counters


def test_importing_plots_does_not_import_matplotlib():
    code = "import sys, dflash_flow.observe.plots, dflash_flow.observe.progress, dflash_flow.observe.bottleneck; print('matplotlib' in sys.modules, 'mlflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False False", out.stderr
