"""Lifecycle and supervision: hooks order, failures in every phase, stop, watchdog, snapshots, threads joined."""

from __future__ import annotations

import threading
import time

import pytest
from stages_for_tests import fast_runtime, wait_threads_back

from dflash_flow.core import (
    ConfigError,
    Graph,
    Pipeline,
    PipelineInterrupted,
    PipelineStalled,
    StageError,
    derive_seed,
)


def _chain(fail_phase="process", at=3, fail_replicas=1, fail_replica=0, infinite=False, count=30):
    g = Graph(runtime=fast_runtime())
    if infinite:
        g.add("src", "TestInfiniteSource", config={"period_s": 0.0005})
    else:
        g.add("src", "TestSource", config={"count": count, "plain": True})
    g.add(
        "fail",
        "TestFail",
        config={"phase": fail_phase, "at": at, "replica": fail_replica},
        inputs=["src"],
        replicas=fail_replicas,
    )
    g.add("mid", "TestPass", inputs=["fail"], replicas=2)
    g.add("sink", "TestSink", inputs=["mid"])
    return g


def test_hooks_run_in_order_on_the_replica_threads(thread_baseline):
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 12, "plain": True})
    g.add("sink", "TestSink", inputs=["src"], replicas=3)
    services: dict = {}
    res = Pipeline(g, services=services, check_devices=False).run()
    life = services["life:sink"]
    for r in range(3):
        mine = [e for e in life if e[1] == r]
        assert [e[0] for e in mine] == ["setup", "finish", "teardown"]
        assert mine[0][2] == f"dflash-flow:sink[{r}]"  # setup ran on the replica's own thread
    assert sorted(i for _, i in services["sink:sink"]) == list(range(12))
    assert res.elapsed_s > 0
    assert res.states["src"] == [{"version": 1, "next": 12}]
    assert wait_threads_back(thread_baseline) == []


@pytest.mark.parametrize(
    "phase,replicas,replica",
    [("setup", 1, 0), ("process", 1, 0), ("process", 3, 2), ("finish", 2, 1), ("teardown", 2, 0)],
)
def test_failure_in_each_phase_surfaces_as_stage_error(phase, replicas, replica, thread_baseline):
    services: dict = {}
    p = Pipeline(
        _chain(phase, at=2, fail_replicas=replicas, fail_replica=replica),
        services=services,
        check_devices=False,
    )
    t0 = time.monotonic()
    with pytest.raises(StageError) as info:
        p.run()
    assert time.monotonic() - t0 < 10
    err = info.value
    assert (err.stage, err.replica, err.phase) == ("fail", replica, phase)
    assert f"stage 'fail' replica {replica} failed in {phase}" in str(err)
    assert isinstance(err.__cause__, ValueError) and err.original is err.__cause__
    # teardown runs once for every replica whose setup started, also after a failure
    life = services["life:fail"]
    for r in range(replicas):
        assert [e[0] for e in life if e[1] == r].count("teardown") == 1
    assert [e[0] for e in services["life:sink"]].count("teardown") == 1
    assert wait_threads_back(thread_baseline) == []


def test_source_failure_names_the_produce_phase(thread_baseline):
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 50, "fail_at": 7})
    g.add("sink", "TestSink", inputs=["src"])
    services: dict = {}
    with pytest.raises(StageError) as info:
        Pipeline(g, services=services, check_devices=False).run()
    assert (info.value.stage, info.value.replica, info.value.phase) == ("src", 0, "produce")
    assert "source failed at item 7" in str(info.value)
    # Items before the failure may or may not arrive, but never one after it.
    assert {i[2] for _, i in services.get("sink:sink", [])} <= set(range(7))
    assert wait_threads_back(thread_baseline) == []


def test_first_exception_stops_an_endless_pipeline_promptly(thread_baseline):
    p = Pipeline(_chain("process", at=5, infinite=True), check_devices=False)
    t0 = time.monotonic()
    with pytest.raises(StageError) as info:
        p.run()
    assert time.monotonic() - t0 < 10
    assert info.value.stage == "fail" and info.value.phase == "process"
    assert len(p.errors) == 1
    assert wait_threads_back(thread_baseline) == []


def test_two_failures_report_the_first_and_keep_both():
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 10, "plain": True})
    g.add("fail", "TestFail", config={"phase": "setup", "shared": True}, inputs=["src"], replicas=2)
    g.add("sink", "TestSink", inputs=["fail"])
    p = Pipeline(g, check_devices=False)
    with pytest.raises(StageError) as info:
        p.run()
    assert info.value is p.errors[0]
    assert {e.replica for e in p.errors} <= {0, 1} and all(e.phase == "setup" for e in p.errors)


def test_invalid_graph_fails_before_any_thread_or_setup(thread_baseline):
    g = Graph()
    g.add("src", "TestSource")
    g.add("sink", "TestSink", inputs=["nope"])
    services: dict = {}
    with pytest.raises(ConfigError):
        Pipeline(g, services=services)
    assert services == {}
    assert set(threading.enumerate()) == thread_baseline


def test_stop_drains_in_flight_items_and_raises_interrupted(thread_baseline):
    g = Graph(runtime=fast_runtime(capacity=2))
    g.add("src", "TestInfiniteSource", config={"period_s": 0.001})
    g.add("mid", "TestSleep", config={"service_s": 0.002}, inputs=["src"])
    g.add("sink", "TestSink", inputs=["mid"])
    started = threading.Event()
    services: dict = {"started": started}
    p = Pipeline(g, services=services, check_devices=False)

    def stopper():
        started.wait(10)
        time.sleep(0.05)
        p.stop("test stop")

    t = threading.Thread(target=stopper)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(PipelineInterrupted) as info:
        p.run()
    t.join()
    assert time.monotonic() - t0 < 10
    assert info.value.reason == "test stop"
    got = [i for _, i in services["sink:sink"]]
    # Graceful: everything the source emitted reached the sink, in order, no gap.
    assert got == list(range(len(got))) and len(got) >= 1
    assert [e[0] for e in services["life:sink"]] == ["setup", "finish", "teardown"]
    assert wait_threads_back(thread_baseline) == []


def test_stop_before_run_produces_nothing():
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 100, "plain": True})
    g.add("sink", "TestSink", inputs=["src"])
    services: dict = {}
    p = Pipeline(g, services=services, check_devices=False)
    p.stop("early")
    with pytest.raises(PipelineInterrupted):
        p.run()
    assert services.get("sink:sink", []) == []


def test_cancel_from_another_thread_stops_promptly(thread_baseline):
    g = Graph(runtime=fast_runtime(capacity=1))
    g.add("src", "TestInfiniteSource", config={"period_s": 0.0})
    g.add("sink", "TestSleep", config={"service_s": 0.01}, inputs=["src"])
    p = Pipeline(g, check_devices=False)
    threading.Timer(0.2, p.cancel, args=("test cancel",)).start()
    t0 = time.monotonic()
    with pytest.raises(PipelineInterrupted, match="test cancel"):
        p.run()
    assert time.monotonic() - t0 < 10
    assert wait_threads_back(thread_baseline) == []


def test_watchdog_names_the_stalled_stage_and_every_queue_depth(thread_baseline):
    g = Graph(runtime=fast_runtime(capacity=2, stall_timeout_s=0.5))
    g.add("src", "TestSource", config={"count": 50, "plain": True})
    g.add("hang", "TestHang", config={"at": 3, "hold_s": 60}, inputs=["src"])
    g.add("after", "TestPass", inputs=["hang"], replicas=2)
    g.add("sink", "TestSink", inputs=["after"])
    p = Pipeline(g, check_devices=False)
    t0 = time.monotonic()
    with pytest.raises(PipelineStalled) as info:
        p.run()
    assert time.monotonic() - t0 < 10
    err = info.value
    assert err.stalled and err.stalled[0].startswith("hang[0]")
    assert "stalled stage: hang[0]" in str(err)
    assert set(err.depths) == {"hang[0]", "after[0]", "after[1]", "sink[0]"}
    assert err.depths["hang[0]"] == "2/2"  # the full queue in front of the stalled stage
    for label in err.depths:
        assert f"{label}=" in str(err)
    assert wait_threads_back(thread_baseline) == []


def test_heartbeat_keeps_the_watchdog_quiet():
    import attrs

    from dflash_flow.core import Stage, register_stage

    @register_stage
    @attrs.define(kw_only=True, eq=False)
    class TestHeartbeat(Stage):
        def setup(self, ctx):
            self._ctx = ctx

        def process(self, item):
            for _ in range(16):  # 0.8 s inside one item, above the 0.5 s stall timeout
                time.sleep(0.05)
                self._ctx.heartbeat()
            return (item,)

    g = Graph(runtime=fast_runtime(stall_timeout_s=0.5))
    g.add("src", "TestSource", config={"count": 1, "plain": True})
    g.add("beat", TestHeartbeat, inputs=["src"])
    g.add("sink", "TestSink", inputs=["beat"])
    services: dict = {}
    Pipeline(g, services=services, check_devices=False).run()
    assert services["sink:sink"] == [(0, 0)]


def test_iterate_yields_outputs_and_reraises_failures(thread_baseline):
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 10, "plain": True})
    g.add("mid", "TestPass", inputs=["src"])
    assert list(Pipeline(g, collect=["mid"], check_devices=False).iterate("mid")) == list(range(10))

    g = _chain("process", at=4)
    g.stages.pop()  # drop the sink: iterate over 'mid'
    got = []
    with pytest.raises(StageError) as info:
        for item in Pipeline(g, collect=["mid"], check_devices=False).iterate("mid"):
            got.append(item)
    assert info.value.stage == "fail"
    assert set(got) <= set(range(4))
    assert wait_threads_back(thread_baseline) == []


def test_iterate_closed_early_cancels_and_joins(thread_baseline):
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestInfiniteSource", config={"period_s": 0.0})
    g.add("mid", "TestPass", inputs=["src"], replicas=2)
    it = Pipeline(g, collect=["mid"], check_devices=False).iterate("mid")
    first = [next(it) for _ in range(5)]
    assert len(first) == 5
    it.close()
    assert wait_threads_back(thread_baseline) == []


def test_pipeline_runs_once():
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 1})
    g.add("sink", "TestSink", inputs=["src"])
    p = Pipeline(g, check_devices=False)
    p.run()
    with pytest.raises(RuntimeError, match="runs once"):
        p.run()


def test_snapshot_counts_channels_and_metrics():
    g = Graph(runtime=fast_runtime(capacity=3))
    g.add("src", "Range", config={"count": 40})
    g.add("mid", "Delay", inputs=["src"], replicas=2)
    g.add("sink", "Discard", inputs=["mid"])
    res = Pipeline(g, check_devices=False).run()
    snap = res.snapshot
    mid = snap.stages["mid"]
    assert sum(r.items_in for r in mid.replicas) == 40
    assert sum(r.items_out for r in mid.replicas) == 40
    for r in mid.replicas:
        assert r.channel is not None and r.channel.capacity == 3
        assert r.channel.items_in == r.channel.items_out == r.items_in
        assert r.channel.depth == 0
        assert r.state == "finished"
    assert snap.stages["sink"].metric("items") == 40
    assert snap.stages["src"].replicas[0].channel is None
    sink = snap.stages["sink"]
    assert sum(r.items_in for r in sink.replicas) == 40
    assert sink.metric_kinds == {"items": "counter"}
    assert [r.replica for r in mid.replicas] == [0, 1]
    fractions = sink.fractions()
    assert set(fractions) == {"busy", "blocked_in", "blocked_out"}
    assert all(0.0 <= v <= 1.0 for v in fractions.values())
    assert sum(fractions.values()) == pytest.approx(1.0, abs=0.05)  # a finished replica: busy + blocked
    assert res.states["sink"] == [{"version": 1, "count": 40}]


def test_resume_state_is_loaded_after_setup():
    g = Graph(runtime=fast_runtime())
    g.add("src", "Range", config={"count": 20})
    g.add("sink", "Discard", inputs=["src"])
    res = Pipeline(g, resume_state={"src": [{"version": 1, "next": 15}]}, check_devices=False).run()
    assert res.states["sink"] == [{"version": 1, "count": 5}]


def test_seeds_are_deterministic_and_distinct():
    assert derive_seed(1, 0, 0, "a") == derive_seed(1, 0, 0, "a")
    values = {derive_seed(s, e, r, n) for s in (0, 1) for e in (0, 1) for r in (0, 1) for n in ("a", "b")}
    assert len(values) == 16
    assert all(0 <= v < 2**63 for v in values)

    def run(seed):
        g = Graph(seed=seed, runtime=fast_runtime())
        g.add("src", "TestSource", config={"count": 30, "plain": True})
        g.add("mid", "TestPass", config={"max_delay_s": 0.0}, inputs=["src"])
        g.add("sink", "TestSink", inputs=["mid"])
        p = Pipeline(g, check_devices=False)
        ctx = p.replicas["mid"][0].ctx
        return ctx.seed_for(0, "x"), ctx.rng(0, "x").integers(0, 1 << 30, 4).tolist()

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_iterate_lets_other_branches_finish(thread_baseline):
    # The collected stage ends first; a slower parallel branch must still run to completion, and the
    # iteration must end normally (not as an interruption).
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 20, "plain": True})
    g.add("mid", "TestPass", inputs=["src"])
    g.add("slow", "TestSleep", config={"service_s": 0.005}, inputs=["src"])
    g.add("sink", "TestSink", inputs=["slow"])
    services: dict = {}
    out = list(Pipeline(g, collect=["mid"], services=services, check_devices=False).iterate("mid"))
    assert out == list(range(20))
    assert [i for _, i in services["sink:sink"]] == list(range(20))
    assert wait_threads_back(thread_baseline) == []


def test_repeated_stop_leaves_no_drain_timer(thread_baseline):
    g = Graph(runtime=fast_runtime(drain_timeout_s=30))
    g.add("src", "TestInfiniteSource", config={"period_s": 0.001})
    g.add("sink", "TestSink", inputs=["src"])
    started = threading.Event()
    p = Pipeline(g, services={"started": started}, check_devices=False)

    def stopper():
        started.wait(10)
        p.stop("first")
        p.stop("second")

    t = threading.Thread(target=stopper)
    t.start()
    with pytest.raises(PipelineInterrupted, match="first"):
        p.run()
    t.join()
    # A leaked drain timer would live for drain_timeout_s (30 s); allow far less.
    assert wait_threads_back(thread_baseline, timeout=2.0) == []


def test_thread_stuck_outside_channels_is_reported_not_waited_for(thread_baseline):
    g = Graph(runtime=fast_runtime(shutdown_grace_s=0.2))
    g.add("src", "TestSource", config={"count": 10, "plain": True})
    g.add("stuck", "TestBlock", inputs=["src"])  # ignores stop requests
    g.add("fail", "TestFail", config={"phase": "process", "at": 0}, inputs=["src"])
    release, blocked = threading.Event(), threading.Event()
    p = Pipeline(g, services={"release": release, "blocked": blocked}, check_devices=False)
    try:
        with pytest.raises(StageError) as info:
            p.run()
        # run() returned while the stuck thread is still blocked: it reported it instead of waiting
        assert not release.is_set() and p.replicas["stuck"][0].thread.is_alive()
    finally:
        release.set()
    assert info.value.stage == "fail"
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "stage threads still running" in notes and "stuck[0]" in notes
    assert wait_threads_back(thread_baseline) == []


def test_watchdog_with_a_plain_sleep_longer_than_the_stall_timeout(thread_baseline):
    g = Graph(runtime=fast_runtime(stall_timeout_s=0.3))
    g.add("src", "TestSource", config={"count": 5, "plain": True})
    g.add("slow", "TestSleep", config={"service_s": 1.2}, inputs=["src"])  # time.sleep: deaf to stop
    g.add("sink", "TestSink", inputs=["slow"])
    t0 = time.monotonic()
    with pytest.raises(PipelineStalled) as info:
        Pipeline(g, check_devices=False).run()
    assert time.monotonic() - t0 < 10
    assert info.value.stalled[0].startswith("slow[0] (in process")
    assert set(info.value.depths) == {"slow[0]", "sink[0]"}
    assert getattr(info.value, "__notes__", []) == []  # the sleep ended within the shutdown grace
    assert wait_threads_back(thread_baseline) == []


def test_watchdog_with_a_stage_stuck_past_the_shutdown_grace(thread_baseline):
    g = Graph(runtime=fast_runtime(stall_timeout_s=0.3, shutdown_grace_s=0.1))
    g.add("src", "TestSource", config={"count": 5, "plain": True})
    g.add("stuck", "TestBlock", inputs=["src"])
    g.add("sink", "TestSink", inputs=["stuck"])
    release, blocked = threading.Event(), threading.Event()
    try:
        with pytest.raises(PipelineStalled) as info:
            Pipeline(g, services={"release": release, "blocked": blocked}, check_devices=False).run()
        assert not release.is_set()
    finally:
        release.set()
    assert info.value.stalled[0].startswith("stuck[0] (in process")
    notes = getattr(info.value, "__notes__", [])
    assert any("stuck[0]" in n and "still running" in n for n in notes)
    assert wait_threads_back(thread_baseline) == []


def test_preload_runs_once_per_class_before_threads_and_failures_name_the_stage(thread_baseline):
    import attrs

    from dflash_flow.core import Stage, register_stage

    calls = []
    fail = []

    @register_stage
    @attrs.define(kw_only=True, eq=False)
    class TestPreloaded(Stage):
        @classmethod
        def preload(cls):
            calls.append(sorted(t.name for t in threading.enumerate() if t.name.startswith("dflash-flow")))
            if fail:
                raise ImportError("no such library")

        def process(self, item):
            return (item,)

    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 3, "plain": True})
    g.add("a", TestPreloaded, inputs=["src"], replicas=2)
    g.add("b", TestPreloaded, inputs=["a"])
    g.add("sink", "TestSink", inputs=["b"])
    services: dict = {}
    Pipeline(g, services=services, check_devices=False).run()
    assert calls == [[]]  # once for the class, before any runtime thread existed
    assert sorted(i for _, i in services["sink:sink"]) == [0, 1, 2]

    fail.append(True)
    services = {}
    with pytest.raises(StageError) as info:
        Pipeline(g, services=services, check_devices=False).run()
    assert info.value.phase == "preload" and info.value.stage == "a"
    assert isinstance(info.value.__cause__, ImportError)
    assert services == {}  # no setup ran
    assert wait_threads_back(thread_baseline) == []
