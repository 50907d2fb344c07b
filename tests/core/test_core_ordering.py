"""Order-preserving fan-in (``ordered: true``) through replicated 1:1 stages, including dropping ones."""

from __future__ import annotations

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from stages_for_tests import fast_runtime

from dflash_flow.core import Graph, Pipeline, PipelineInterrupted


def _ordered_chain(n, drop_every, replicas_a, replicas_b, delay, ordered=True, seed=0):
    g = Graph(seed=seed, runtime=fast_runtime(capacity=2))
    g.add("src", "TestSource", config={"count": n, "plain": True})
    g.add(
        "a",
        "TestDrop",
        config={"every": drop_every, "max_delay_s": delay},
        inputs=["src"],
        replicas=replicas_a,
    )
    g.add("b", "TestDrop", config={"every": 0, "max_delay_s": delay}, inputs=["a"], replicas=replicas_b)
    g.add("sink", "TestSink", inputs=["b"], ordered=ordered)
    return g


def _sink_items(g):
    services: dict = {}
    Pipeline(g, services=services, check_devices=False).run()
    return [i for _, i in services["sink:sink"]]


def test_ordered_fan_in_restores_source_order_with_drops():
    got = _sink_items(_ordered_chain(60, 3, 3, 2, 0.002))
    assert got == [k for k in range(60) if k % 3]


def test_without_ordered_replicas_reorder():
    # The control experiment: the same chain without `ordered` does reorder, so the test above is meaningful.
    reordered = False
    for seed in range(3):
        got = _sink_items(_ordered_chain(60, 0, 3, 2, 0.002, ordered=False, seed=seed))
        assert sorted(got) == list(range(60))
        if got != list(range(60)):
            reordered = True
            break
    assert reordered


def test_ordered_iterate_through_drops():
    g = Graph(runtime=fast_runtime(capacity=2))
    g.add("src", "TestSource", config={"count": 40, "plain": True})
    g.add("a", "TestDrop", config={"every": 2, "max_delay_s": 0.001}, inputs=["src"], replicas=4)
    g.add("order", "TestPass", inputs=["a"], ordered=True)
    # No sink: the caller consumes the ordered stage's output in its own thread.
    out = list(Pipeline(g, collect=["order"], check_devices=False).iterate("order"))
    assert out == [k for k in range(40) if k % 2]


def test_ordered_drops_everything():
    assert _sink_items(_ordered_chain(20, 1, 3, 2, 0.0)) == []


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(0, 40),
    drop_every=st.integers(0, 4),
    replicas_a=st.integers(1, 4),
    replicas_b=st.integers(1, 4),
    delay=st.sampled_from([0.0, 0.0005, 0.001]),
    seed=st.integers(0, 2**16),
)
def test_property_ordered_fan_in(n, drop_every, replicas_a, replicas_b, delay, seed):
    got = _sink_items(_ordered_chain(n, drop_every, replicas_a, replicas_b, delay, seed=seed))
    assert got == [k for k in range(n) if not (drop_every and k % drop_every == 0)]


def test_ordered_fan_in_streams_past_dropped_items():
    # Tombstones let the ordered consumer move past dropped items at once; without them it would hold
    # every later item until end-of-stream. The source never ends on its own here.
    g = Graph(runtime=fast_runtime(capacity=2))
    g.add("src", "TestInfiniteSource", config={"period_s": 0.0005})
    g.add("a", "TestDrop", config={"every": 2, "max_delay_s": 0.001}, inputs=["src"], replicas=3)
    g.add("sink", "TestSink", inputs=["a"], ordered=True)
    services: dict = {}
    p = Pipeline(g, services=services, check_devices=False)
    streamed = threading.Event()

    def watcher():
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if len(services.get("sink:sink", [])) >= 10:
                streamed.set()
                break
            time.sleep(0.005)
        p.stop("enough")

    t = threading.Thread(target=watcher)
    t.start()
    with pytest.raises(PipelineInterrupted):
        p.run()
    t.join()
    assert streamed.is_set(), "the ordered sink got nothing while the source was running"
    got = [i for _, i in services["sink:sink"]]
    assert got == [k for k in range(1, 2 * len(got), 2)]
