"""take_sample: two runtime snapshots (the real core types, with cumulative readings) -> one window."""

from __future__ import annotations

import pytest

from dflash_flow.core.channel import ChannelStats
from dflash_flow.core.snapshot import ReplicaSnapshot, RuntimeSnapshot, StageSnapshot
from dflash_flow.observe.sample import Throughput, take_sample


def rep(i, busy, bin_, bout, alive, items, metrics=None, depth=None):
    ch = None if depth is None else ChannelStats(capacity=8, depth=depth, items_in=items, items_out=items, blocked_put_s=0.0, blocked_get_s=bin_)
    return ReplicaSnapshot(i, "cpu", "busy", items, items, busy, bin_, bout, alive, metrics or {}, ch)


def snap(t, stages):
    return RuntimeSnapshot(time=t, elapsed_s=t - 100.0, stages=stages)


KINDS = {"batches": "counter", "eff": "gauge", "seq_len": "summary", "bucket_dispatch": "labeled"}


def pad_metrics(batches, eff, n, buckets):
    return {
        "batches": batches,
        "eff": eff,
        "seq_len": {"count": n, "total": 10.0 * n, "min": 5.0, "max": 20.0, "mean": 10.0 if n else float("nan")},
        "bucket_dispatch": buckets,
    }


def before_after():
    prev = snap(
        110.0,
        {
            "src": StageSnapshot("src", "Range", [rep(0, 1.0, 0.0, 9.0, 10.0, 100)], {}),
            "pad": StageSnapshot(
                "pad",
                "Padder",
                [
                    rep(0, 8.0, 2.0, 0.0, 10.0, 40, pad_metrics(40, 0.5, 40, {"128": 30, "512": 10}), depth=3),
                    rep(1, 6.0, 4.0, 0.0, 10.0, 30, pad_metrics(30, 0.7, 30, {"128": 20}), depth=1),
                ],
                KINDS,
            ),
        },
    )
    cur = snap(
        115.0,
        {
            "src": StageSnapshot("src", "Range", [rep(0, 1.5, 0.0, 13.5, 15.0, 150)], {}),
            "pad": StageSnapshot(
                "pad",
                "Padder",
                [
                    rep(0, 12.5, 2.5, 0.0, 15.0, 65, pad_metrics(65, 0.6, 65, {"128": 45, "512": 20}), depth=8),
                    rep(1, 10.0, 5.0, 0.0, 15.0, 55, pad_metrics(55, 0.8, 55, {"128": 40}), depth=0),
                ],
                KINDS,
            ),
        },
    )
    return prev, cur


def test_window_fractions_rates_and_stage_metrics():
    prev, cur = before_after()
    s = take_sample(cur, prev, step=12, throughput=Throughput(tokens_per_s=5.0), sinks=["pad"], edges={"src": ["pad"]})
    assert s.window_s == 5.0 and not s.whole_run and s.step == 12
    pad = s.stages["pad"]
    r0, r1 = pad.per_replica
    assert r0.busy == pytest.approx(0.9) and r0.blocked_in == pytest.approx(0.1)
    assert r1.busy == pytest.approx(0.8) and r1.blocked_in == pytest.approx(0.2)
    assert pad.busy == pytest.approx(0.85) and pad.replicas == 2
    assert (r0.queue_depth, r1.queue_depth, r0.queue_capacity) == (8, 0, 8)
    assert pad.items_out == 120 and pad.items_out_per_s == pytest.approx((120 - 70) / 5)
    assert pad.counters == {"batches": 120} and pad.rates["batches"] == pytest.approx(10.0)
    assert pad.gauges == {"eff": 0.8}  # a gauge merged over replicas: the last finite value
    assert pad.summaries["seq_len"].count == 120 and pad.summaries["seq_len"].max == 20.0
    assert pad.labeled["bucket_dispatch"] == {"128": 85.0, "512": 20.0}
    # Bucket mix of the window: 35 more of 128, 10 more of 512.
    assert s.buckets["128"].dispatched == 85.0 and s.buckets["128"].share == pytest.approx(35 / 45)
    assert s.buckets["512"].share == pytest.approx(10 / 45)
    src = s.stages["src"]
    assert src.per_replica[0].queue_depth is None and src.blocked_out == pytest.approx(0.9)
    assert s.bottleneck.stage == "pad" and s.bottleneck.is_sink
    assert s.throughput.tokens_per_s == 5.0


def test_whole_run_uses_each_replicas_lifetime():
    _, cur = before_after()
    s = take_sample(cur, None, step=20, exclude={"src"})
    assert s.whole_run and s.window_s == cur.elapsed_s
    r0 = s.stages["pad"].per_replica[0]
    assert r0.busy == pytest.approx(12.5 / 15.0)
    assert s.stages["pad"].rates["batches"] == pytest.approx(120 / 15.0)
    assert s.buckets["512"].share == pytest.approx(20 / 105)  # cumulative share over the run
    assert set(s.bottleneck.loads) == {"pad"}  # excluded stages are not in the analysis


def test_a_replica_new_in_the_window_counts_from_zero_and_values_are_clipped():
    prev, cur = before_after()
    pad = cur.stages["pad"]
    pad.replicas.append(rep(2, 9.0, 0.0, 0.0, 3.0, 5, pad_metrics(5, 0.9, 5, {}), depth=2))
    s = take_sample(cur, prev, step=1)
    assert s.stages["pad"].per_replica[2].busy == 1.0  # 9 s busy in a 5 s window: clipped
    prev.stages["pad"].replicas[0].busy_s = 50.0  # a reading that went backwards: clipped to 0
    assert take_sample(cur, prev, step=1).stages["pad"].per_replica[0].busy == 0.0


def test_no_bucket_dispatch_in_the_window_has_no_share():
    prev, _ = before_after()
    s = take_sample(prev, prev, step=3)
    assert s.buckets["128"].share is None and s.buckets["128"].dispatched == 50.0
