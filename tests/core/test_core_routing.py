"""Fan-out policies (round_robin with one shared counter, least_loaded, broadcast) and fan-in merges."""

from __future__ import annotations

import threading
from collections import Counter

import pytest
from stages_for_tests import fast_runtime

from dflash_flow.core import Channel, Graph, Pipeline
from dflash_flow.core.channel import Broadcast, LeastLoaded, RoundRobin, make_router


def test_round_robin_router_one_counter_for_many_producer_threads():
    chans = [Channel(10_000) for _ in range(3)]
    router = make_router("round_robin", chans)
    assert isinstance(router, RoundRobin)
    barrier = threading.Barrier(5)

    def producer():
        barrier.wait()
        for _ in range(1001):
            router.targets().put(1)

    threads = [threading.Thread(target=producer) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    counts = [c.depth for c in chans]
    assert sum(counts) == 5 * 1001
    assert max(counts) - min(counts) <= 1


def test_least_loaded_picks_the_shallowest_and_rotates_ties():
    chans = [Channel(10) for _ in range(3)]
    router = make_router("least_loaded", chans)
    assert isinstance(router, LeastLoaded)
    chans[0].put(0)
    chans[0].put(0)
    chans[2].put(0)
    assert router.targets() is chans[1]
    # All equal: successive picks must not always favour the same replica.
    eq = [Channel(10) for _ in range(3)]
    r = make_router("least_loaded", eq)
    picks = {id(r.targets()) for _ in range(6)}
    assert len(picks) == 3


def test_broadcast_and_unknown_policy():
    chans = [Channel(2) for _ in range(3)]
    router = make_router("broadcast", chans)
    assert isinstance(router, Broadcast)
    assert router.targets() == chans
    with pytest.raises(ValueError, match="unknown fan-out policy"):
        make_router("random", chans)


def _run(graph: Graph) -> dict:
    services: dict = {}
    Pipeline(graph, services=services, check_devices=False).run()
    return services


@pytest.mark.parametrize("producers,consumers", [(3, 4), (4, 3), (2, 2)])
def test_round_robin_pipeline_balances_consumers_with_several_producers(producers, consumers):
    g = Graph(runtime=fast_runtime(capacity=2))
    g.add("src", "TestSource", config={"count": 25, "max_delay_s": 0.0005}, replicas=producers)
    g.add("sink", "TestSink", inputs=["src"], replicas=consumers, policy="round_robin")
    s = _run(g)
    items = s["sink:sink"]
    assert sorted(i for _, i in items) == sorted(("src", p, k) for p in range(producers) for k in range(25))
    per_replica = Counter(r for r, _ in items)
    counts = [per_replica.get(r, 0) for r in range(consumers)]
    assert max(counts) - min(counts) <= 1, counts


def test_least_loaded_pipeline_delivers_everything_once_and_uses_every_replica():
    g = Graph(runtime=fast_runtime(capacity=2))
    g.add("src", "TestSource", config={"count": 60})
    g.add(
        "work",
        "TestSleep",
        config={"service_s": 0.002},
        inputs=[{"stage": "src", "policy": "least_loaded"}],
        replicas=3,
    )
    g.add("sink", "TestSink", inputs=["work"])
    s = _run(g)
    got = [i for _, i in s["sink:sink"]]
    assert Counter(got) == Counter(("src", 0, k) for k in range(60))


def test_broadcast_pipeline_every_replica_gets_every_item():
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 20, "plain": True})
    g.add("sink", "TestSink", inputs=[("src", "broadcast")], replicas=3)
    s = _run(g)
    per = {r: [i for rr, i in s["sink:sink"] if rr == r] for r in range(3)}
    for r in range(3):
        assert per[r] == list(range(20))  # one producer, one channel per replica: order kept


def test_many_producer_stages_merge_into_one_consumer():
    g = Graph(runtime=fast_runtime(capacity=1))
    g.add("a", "TestSource", config={"count": 30, "max_delay_s": 0.0003}, replicas=2)
    g.add("b", "TestSource", config={"count": 20})
    g.add("c", "TestSource", config={"count": 10, "max_delay_s": 0.0003}, replicas=3)
    g.add("sink", "TestSink", inputs=["a", "b", "c"])
    s = _run(g)
    expected = (
        [("a", r, k) for r in range(2) for k in range(30)]
        + [("b", 0, k) for k in range(20)]
        + [("c", r, k) for r in range(3) for k in range(10)]
    )
    assert Counter(i for _, i in s["sink:sink"]) == Counter(expected)
    life = s["life:sink"]
    assert [e[0] for e in life] == ["setup", "finish", "teardown"]  # finish only after every producer ended


def test_fan_out_to_two_consumer_stages_each_get_everything():
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 15, "plain": True})
    g.add("x", "TestSink", inputs=["src"], replicas=2)
    g.add("y", "TestSink", inputs=["src"])
    s = _run(g)
    assert sorted(i for _, i in s["sink:x"]) == list(range(15))
    assert [i for _, i in s["sink:y"]] == list(range(15))
