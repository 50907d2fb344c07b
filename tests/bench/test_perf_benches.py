"""The profile, fan-out, torchdata, e2e and scale benchmarks still run and write what the docs quote
(tiny sizes; no speed assertions, only the facts each benchmark checks: same batches, sane shapes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchtools import load_bench


def _on_disk(out: Path, result: dict) -> dict:
    data = json.loads(out.read_text())
    assert data == json.loads(json.dumps(result, default=str))
    assert data["machine"]["cpus"] >= 1
    return data


@pytest.mark.slow
def test_profile_bench_sleep_validation(tmp_path):
    out = tmp_path / "profile.json"
    data = _on_disk(out, load_bench("profile_bench").main(["--out", str(out), "--sleep-steps", "40", "--no-embedded"]))
    rows = data["sleep"]["rows"]
    assert [r["mix"] for r in rows][0] == {"a": 1, "b": 1} and len(rows) == 5
    assert all(r["predicted_batches_per_s"] > 0 and r["measured_batches_per_s"] > 0 for r in rows)
    assert data["sleep"]["max_abs_error"] == max(abs(r["error"]) for r in rows)
    # Every prediction carries the plan's interval and says whether the measured rate fell inside it.
    for r in rows:
        low, high = r["predicted_interval"]
        assert low <= r["predicted_batches_per_s"] <= high and isinstance(r["measured_in_interval"], bool)
    inside = sum(r["measured_in_interval"] for r in rows)
    assert data["sleep"]["measured_in_interval"] == f"{inside} of 5" and data["sleep"]["windows"] == 6


def test_fanout_bench_runs_every_cell(tmp_path):
    out = tmp_path / "fanout.json"
    data = _on_disk(out, load_bench("fanout_bench").main(["--out", str(out), "--samples", "600", "--reps", "1", "--unit-ms", "6"]))
    assert set(data["summary"]) == {"shuffle/round_robin", "shuffle/least_loaded", "interleaver/round_robin",
                                    "interleaver/least_loaded"}
    w = data["workload"]
    assert 2.3 <= w["long_over_short"] <= 2.7  # the cost model: long batches ~2.5x on the target
    assert w["max_same_bucket_run"]["interleaver"] <= 3
    for cell in data["summary"].values():
        assert cell["efficiency"] > 0 and len(cell["mean_queue_depth_per_replica"]) == data["replicas"]
    assert data["best"] in data["summary"]


def test_torchdata_bench_trains_the_same_batches(tmp_path):
    pytest.importorskip("torchdata", reason='torchdata is an optional extra: pip install -e ".[torchdata]"')
    out = tmp_path / "torchdata.json"
    data = _on_disk(out, load_bench("torchdata_bench").main(["--out", str(out), "--samples", "400", "--reps", "1", "--unit-ms", "4"]))
    assert data["same_batches"] is True and data["batches"] > 10  # main() raises when they differ
    assert data["ours_over_torchdata"] > 0


def test_torchdata_bench_planned_batches_match_the_stages(tmp_path):
    """The torchdata side's batches are the Bucketer + Interleaver's: the same plan, sample for sample."""
    td = load_bench("torchdata_bench")
    data = td.samples(300)
    theirs = [tuple(b.meta.sample_ids) for b in td.planned_batches(data)]
    from dflash_flow.core import Graph, Pipeline
    from dflash_flow.stages.bucketer import Bucketer
    from dflash_flow.stages.interleaver import Interleaver

    src = td.TdSampleSource()
    src.items = data
    g = Graph(name="td-plan", seed=td.SEED, output_dir=str(tmp_path / "out"))
    g.add("source", src)
    g.add(td.BUCKETER, Bucketer(max_tokens=td.MAX_TOKENS, num_buckets=td.NUM_BUCKETS, epochs=1), inputs="source")
    g.add("interleaver", Interleaver(max_run=td.MAX_RUN), inputs=td.BUCKETER)
    ours = [tuple(b.meta.sample_ids) for b in Pipeline(g, collect=["interleaver"]).iterate("interleaver")]
    assert ours == theirs and len(ours) > 5


@pytest.mark.slow
def test_anchors_cost_bench_times_every_count_on_every_shape(tmp_path):
    out = tmp_path / "anchors_cost.json"
    data = _on_disk(out, load_bench("anchors_cost").main(["--out", str(out), "--rounds", "1", "--anchors", "64,32"]))
    assert set(data["shapes"]) == {"2x512", "4x256", "8x128"} and data["threads"] == 1
    for shape in data["shapes"].values():
        assert set(shape) == {"64", "32"} and shape["64"]["x64"] == 1.0
        assert shape["32"]["ms"] > 0 and shape["32"]["x64"] > 0


@pytest.mark.slow
def test_e2e_bench_same_batches_both_ways(tmp_path):
    out = tmp_path / "e2e.json"
    data = _on_disk(out, load_bench("e2e_bench").main(["--out", str(out), "--steps", "3", "--pairs", "1"]))
    assert data["same_batches"] is True
    assert set(data["variants"]) == {"default", "one_thread"}
    assert 0.0 <= data["drafter_data_wait"] <= 1.0 and data["pipelined_tokens_per_s"] > 0


@pytest.mark.slow
def test_scale_bench_measures_the_allreduce_wait(tmp_path):
    out = tmp_path / "scale.json"
    data = _on_disk(out, load_bench("scale_bench").main(["--out", str(out), "--steps", "6"]))
    assert data["one_process"]["steps"] == 6 and data["two_ranks"]["steps"] == 6
    assert data["one_process"]["allreduce_wait_s_per_step"] is None  # no DDP, no hook
    assert data["allreduce_wait_s_per_step"] is not None and data["allreduce_wait_s_per_step"] >= 0.0
    assert data["two_over_one"] > 0


@pytest.mark.slow
def test_data_scale_bench_runs_and_ranks_tokenize_once(tmp_path):
    """A tiny corpus through every measurement of bench/data_scale_bench.py (not its speed)."""
    out = tmp_path / "data_scale.json"
    data = _on_disk(out, load_bench("data_scale_bench").main(["--n", "40", "--out", str(out), "--workdir", str(tmp_path / "w"),
                                                              "--plan-samples", "5000"]))
    assert data["corpus"]["conversations"] == 40 and data["corpus"]["tokens"] > 0
    assert sorted(r["built"] for r in data["cold_2ranks"]) == [False, True]  # one rank tokenized, one waited or mapped
    for key in ("reader_over_raw", "cold_2ranks_over_1rank", "warm_start_s", "resident_data_bytes_per_token"):
        assert data[key] >= 0, key
    assert len(data["peak_rss_per_rank_bytes"]) == 2 and data["plan_1m"]["state_bytes"] < 200
