"""The runtime benchmark's building blocks still run (tiny sizes; no speed assertions)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "runtime_bench.py"


def _load():
    spec = importlib.util.spec_from_file_location("runtime_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_runtime_bench_runs_end_to_end_at_tiny_size(tmp_path):
    rb = _load()
    out = tmp_path / "runtime.json"
    result = rb.main(["--out", str(out), "--items", "30", "--reps", "1", "--hop-items", "2000"])
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(result))
    for key in (
        "hop_overhead_us",
        "queue_hop_us",
        "pipeline_efficiency",
        "vs_handwritten",
        "rr_max_imbalance",
    ):
        assert key in on_disk
    assert on_disk["hop_overhead_us"] > 0 and on_disk["queue_hop_us"] > 0
    assert 0 < on_disk["pipeline_efficiency"] and 0 < on_disk["vs_handwritten"]
    assert on_disk["rr_max_imbalance"] <= 1
    assert sum(on_disk["details"]["round_robin"]["rr_counts"]) == 3 * 2001
