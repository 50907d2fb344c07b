"""The runtime's one sampler (core.snapshot.Sampler): snapshots on a clock, also while nothing moves; a subscriber
that raises fails the run as its owner's failure; its thread is joined with the rest."""

from __future__ import annotations

import threading

import pytest

from dflash_flow.core import Graph, Pipeline, RuntimeOptions, StageError
from dflash_flow.stages.generic import Delay, Discard, Range


def _graph(service_s: float) -> Graph:
    g = Graph(name="sampler")
    g.add("numbers", Range(count=2))
    g.add("slow", Delay(service_s=service_s), inputs="numbers")
    g.add("sink", Discard(), inputs="slow")
    return g


def test_snapshots_arrive_while_no_item_moves(tmp_path):
    p = Pipeline(_graph(0.6), check_devices=False, output_dir=tmp_path)
    seen = []
    p.sampler.subscribe(lambda snap: seen.append(snap.stages["sink"].replicas[0].items_in), 0.05, owner="test")
    p.run()
    # Two items 0.6 s apart: the sink's count stands still between them, and the sampler saw that.
    assert len(seen) >= 8 and seen.count(0) >= 3 and seen[-1] <= 2
    assert not any(t.name == "dflash-flow:sampler" for t in threading.enumerate())


def test_a_subscriber_that_raises_fails_the_run_as_its_owner(tmp_path):
    p = Pipeline(_graph(0.5), check_devices=False, output_dir=tmp_path)

    def broken(_snap):
        raise RuntimeError("broken subscriber")

    p.sampler.subscribe(broken, 0.05, owner="slow")
    with pytest.raises(StageError, match="stage 'slow' replica 0 failed in sample: RuntimeError: broken subscriber"):
        p.run()
    assert not any(t.name.startswith("dflash-flow") for t in threading.enumerate() if t.is_alive())


def test_a_wait_still_going_on_counts_in_the_snapshot(tmp_path):
    """Capacity 1, a 0.6 s stage: the source waits in a put, the sink in a get, from the start until the
    first item passes; a snapshot taken 0.4 s in counts those waits so far (a total that grew only when a
    wait ended would still read 0 and call the source busy)."""
    g = Graph(name="waits", runtime=RuntimeOptions(capacity=1))
    g.add("numbers", Range(count=4))
    g.add("slow", Delay(service_s=0.6), inputs="numbers")
    g.add("sink", Discard(), inputs="slow")
    p = Pipeline(g, check_devices=False, output_dir=tmp_path)
    seen = []
    p.sampler.subscribe(lambda snap: seen.append(snap), 0.05, owner="test")
    p.run()
    mid = [s for s in seen if 0.4 <= s.elapsed_s <= 0.55]
    assert mid, [s.elapsed_s for s in seen]
    src, sink = mid[0].stages["numbers"].replicas[0], mid[0].stages["sink"].replicas[0]
    assert src.blocked_out_s >= 0.25 and src.busy_s <= 0.15, src
    assert sink.blocked_in_s >= 0.25 and sink.items_in == 0, sink
    # ...and once each wait is over, it counts once: busy + waits stay within the time alive.
    end = seen[-1].stages["numbers"].replicas[0]
    assert end.busy_s + end.blocked_in_s + end.blocked_out_s <= end.alive_s + 1e-6
