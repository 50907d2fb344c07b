"""The runtime's one sampler (core.sampler): snapshots on a clock, also while nothing moves; a subscriber
that raises fails the run as its owner's failure; its thread is joined with the rest."""

from __future__ import annotations

import threading

import pytest

from dflash_flow.core import Graph, Pipeline, StageError
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
