"""Property test: random DAGs, random failures, a random graceful stop (Ctrl-C) or cancel.

tests/core/test_core_properties.py covers runs that finish or fail once; this one adds stops and cancels
racing with failures, and checks what a sink *acknowledged*:

* the run always terminates (bounded) and joins every thread;
* nothing is invented or duplicated: each acknowledged item is one a source emitted, over a real DAG path,
  at most as often as the DAG has paths with that signature;
* with no failure and no stop: every item exactly once per path;
* after a graceful stop with no failure: every item a source emitted is delivered (the drain loses none).

Stages: RelSource / RelHop / RelSink (rel_stages.py: items carry the hops they took), the generic Delay
(pass-through) and Discard (a counting sink), and FaultyDelay (the real Delay with an injected fault).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import rel_stages  # noqa: F401 - registers the Rel* stages
from faulty_stages import InjectedFault
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from reltools import wait_threads_back

from dflash_flow.core import Graph, Pipeline, PipelineInterrupted, StageError
from dflash_flow.core.graph import RuntimeOptions

POLICIES = ["round_robin", "least_loaded"]  # broadcast copies items on purpose (tests/core covers it)


@st.composite
def scenarios(draw):
    stages: list[dict] = []
    producers: list[str] = []
    for i in range(draw(st.integers(1, 2))):
        stages.append(dict(name=f"src{i}", type="RelSource", replicas=draw(st.integers(1, 2)), inputs=[],
                           config={"count": draw(st.integers(0, 15)), "max_delay_s": draw(st.sampled_from([0.0, 0.0005]))}))
        producers.append(f"src{i}")
    for j in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["RelHop", "RelHop", "Delay"]))
        inputs = draw(st.lists(st.sampled_from(producers), min_size=1, max_size=min(2, len(producers)), unique=True))
        conf = {"max_delay_s": draw(st.sampled_from([0.0, 0.0005]))} if kind == "RelHop" else {}
        stages.append(dict(name=f"mid{j}", type=kind, replicas=draw(st.integers(1, 3)),
                           inputs=[(i, draw(st.sampled_from(POLICIES))) for i in inputs],
                           capacity=draw(st.integers(1, 3)), config=conf))
        producers.append(f"mid{j}")
    for s in range(draw(st.integers(1, 2))):
        inputs = draw(st.lists(st.sampled_from(producers), min_size=1, max_size=min(2, len(producers)), unique=True))
        stages.append(dict(name=f"sink{s}", type="RelSink", replicas=draw(st.integers(1, 2)),
                           inputs=[(i, draw(st.sampled_from(POLICIES))) for i in inputs], capacity=None, config={}))
    stages.append(dict(name="discard", type="Discard", replicas=1, inputs=[(draw(st.sampled_from(producers)), "round_robin")],
                       capacity=None, config={}))

    victim = None
    mids = [s for s in stages if s["name"].startswith("mid")]
    if mids and draw(st.integers(0, 2)) > 0:
        spec = draw(st.sampled_from(mids))
        victim = spec["name"]
        replica = draw(st.integers(0, spec["replicas"] - 1))
        if spec["type"] == "RelHop":
            spec["config"] = {**spec["config"], "fail_at": draw(st.integers(0, 3)), "fail_replica": replica}
        else:
            phase = draw(st.sampled_from(["setup", "process", "teardown"]))
            spec["type"] = "FaultyDelay"
            spec["config"] = {"fault_phase": phase, "fault_replica": replica, "fault_at": draw(st.integers(0, 3))}
    stop = draw(st.sampled_from(["stop", "cancel", None]))
    delay = draw(st.sampled_from([0.0, 0.002, 0.01, 0.03]))
    return stages, victim, stop, delay


def _expected(stages) -> dict[str, Counter]:
    """Per sink: how many times each (source, replica, k, hops) may arrive (= the DAG paths with that signature)."""
    by_name = {s["name"]: s for s in stages}
    sigs: dict[str, Counter] = {}
    for s in stages:  # already in topological order
        if not s["inputs"]:
            sigs[s["name"]] = Counter({(s["name"], ()): 1})
            continue
        c: Counter = Counter()
        for inp, _ in s["inputs"]:
            for (src, hops), m in sigs[inp].items():
                key = (src, (*hops, s["name"])) if s["type"] == "RelHop" else (src, hops)
                c[key] += m
        sigs[s["name"]] = c
    out = {}
    for s in stages:
        if s["type"] != "RelSink":
            continue
        exp: Counter = Counter()
        for (src, hops), m in sigs[s["name"]].items():
            spec = by_name[src]
            for r in range(spec["replicas"]):
                for k in range(spec["config"]["count"]):
                    exp[(src, r, k, hops)] += m
        out[s["name"]] = exp
    return out


def _graph(stages, seed) -> Graph:
    g = Graph(seed=seed, runtime=RuntimeOptions(capacity=2, stall_timeout_s=20, drain_timeout_s=10,
                                                shutdown_grace_s=5, watchdog_interval_s=0.05))
    for s in stages:
        g.add(s["name"], s["type"], config=s["config"], replicas=s["replicas"], inputs=s["inputs"], capacity=s.get("capacity"))
    return g


@pytest.mark.timeout(300)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(scenario=scenarios(), seed=st.integers(0, 2**16))
def test_random_dag_with_failures_and_stops_terminates_and_never_duplicates_or_loses(scenario, seed):
    import faulty_stages  # noqa: F401 - registers FaultyDelay

    stages, victim, stop, delay = scenario
    expected = _expected(stages)
    baseline = set(threading.enumerate())
    services: dict = {}
    p = Pipeline(_graph(stages, seed), services=services, check_devices=False)
    timer = None
    if stop is not None:
        timer = threading.Timer(delay, p.stop if stop == "stop" else p.cancel, args=(f"test {stop}",))
    t0 = time.monotonic()
    outcome = "finished"
    try:
        if timer is not None:
            timer.start()
        p.run()
    except StageError as err:
        outcome = "failed"
        assert victim is not None, f"no failure was injected, yet: {err}"
        assert err.stage == victim, str(err)
        assert isinstance(err.original, (RuntimeError, InjectedFault))
    except PipelineInterrupted:
        outcome = "interrupted"
        assert stop is not None
    finally:
        if timer is not None:
            timer.cancel()
            timer.join()
    event(f"{outcome} (stop={stop}, failure={'yes' if victim else 'no'})")
    assert time.monotonic() - t0 < 60, "the run did not end promptly"
    assert wait_threads_back(baseline) == [], "threads left behind"

    for sink, exp in expected.items():
        got = Counter(services.get(f"acked:{sink}", []))
        invented = {x: n for x, n in got.items() if n > exp.get(x, 0)}
        assert not invented, f"{sink}: items acknowledged more often than the DAG delivers them: {invented}"
        if outcome == "finished" and stop is None:
            assert got == exp, f"{sink}: missing {exp - got}"
        if outcome == "interrupted" and stop == "stop" and not p.errors:
            # A graceful stop drains: every item a source emitted reaches every sink over every path.
            emitted = {(s["name"], r): p.replicas[s["name"]][r].items_out for s in stages if not s["inputs"]
                       for r in range(s["replicas"])}
            want = Counter({x: n for x, n in exp.items() if x[2] < emitted[(x[0], x[1])]})
            assert got == want, f"{sink}: the drain lost {want - got}"
    # The generic counting sink: never more than it can be sent; everything when nothing stopped the run.
    discarded = p.replicas["discard"][0].stage.state_dict()["count"]
    total = sum(_expected_counts(stages, "discard").values())
    assert discarded <= total
    if outcome == "finished" and stop is None:
        assert discarded == total


def _expected_counts(stages, name) -> Counter:
    """Items a stage may receive in all (any path signature)."""
    fake = [dict(s) for s in stages]
    for s in fake:
        if s["name"] == name:
            s["type"] = "RelSink"
        elif s["type"] == "RelSink":
            s["type"] = "Discard"
    return _expected(fake)[name]
