from __future__ import annotations

import pytest

from dflash_flow.observe.bottleneck import StageLoad, find_bottleneck, replicas_needed
from dflash_flow.observe.schema import mlflow_metrics

# A typical CPU run: the padder (1 replica) is saturated, the bucketer upstream waits to hand it
# batches, the trainer downstream waits for its output.
PIPELINE = {
    "source": {"replicas": 1, "busy": 0.10, "blocked_in": 0.0, "blocked_out": 0.85},
    "bucketer": {"replicas": 1, "busy": 0.20, "blocked_in": 0.05, "blocked_out": 0.70},
    "padder": {"replicas": 1, "busy": 0.96, "blocked_in": 0.02, "blocked_out": 0.0},
    "trainer": {"replicas": 1, "busy": 0.45, "blocked_in": 0.55, "blocked_out": 0.0},
}
EDGES = {"source": ["bucketer"], "bucketer": ["padder"], "padder": ["trainer"]}


def test_names_the_saturated_middle_stage_and_replicas_needed():
    b = find_bottleneck(PIPELINE, sinks=["trainer"], edges=EDGES)
    assert b.stage == "padder" and b.saturated and not b.is_sink
    assert b.next_stage == "trainer" and b.next_busy == pytest.approx(0.45)
    # 1 * 0.96 / 0.45 = 2.13 -> 3 replicas bring it to 32% busy, below the trainer's 45%.
    assert b.replicas_needed == 3
    assert "padder is the bottleneck" in b.sentence and "3 replicas" in b.sentence
    assert "trainer 55% starved" in b.sentence and "bucketer 70% blocked on output" in b.sentence
    assert mlflow_metrics(b) == {"busy": 0.96, "replicas": 1.0, "replicas_needed": 3.0, "next_busy": 0.45, "replicable": 1.0, "saturated": 1.0}


def test_replicas_needed_definition():
    assert replicas_needed(1, 0.9, 0.45) == 2  # exactly the next stage's load: float noise ignored
    assert replicas_needed(2, 0.9, 0.6) == 3  # 1.8 / 0.6 = 3
    assert replicas_needed(4, 0.95, 0.93) == 5  # always at least one more than today
    assert replicas_needed(1, 1.0, 0.0) == 20  # next stage idle: min_util 0.05 bounds the answer
    assert replicas_needed(1, 1.0, 0.0, min_util=0.25) == 4


def test_sink_bottleneck_is_the_goal():
    loads = {
        "padder": {"replicas": 3, "busy": 0.30, "blocked_out": 0.65},
        "trainer": {"replicas": 1, "busy": 0.97, "blocked_in": 0.01},
    }
    b = find_bottleneck(loads, sinks=["trainer"])
    assert b.stage == "trainer" and b.is_sink
    assert "keeps it fed" in b.sentence


def test_tie_broken_by_who_waits_for_whom():
    # Both at ~95% busy; the consumer of "b" is starved and the producer of "a" is not blocked,
    # so "b" is the one holding the pipeline back.
    loads = {
        "src": {"replicas": 1, "busy": 0.2, "blocked_out": 0.0},
        "a": {"replicas": 1, "busy": 0.95, "blocked_out": 0.03},
        "b": {"replicas": 2, "busy": 0.94, "blocked_out": 0.0},
        "sink": {"replicas": 1, "busy": 0.3, "blocked_in": 0.7},
    }
    edges = {"src": ["a"], "a": ["b"], "b": ["sink"]}
    assert find_bottleneck(loads, edges=edges).stage == "b"
    # Without a tie the busiest wins, whatever the evidence.
    loads["a"]["busy"] = 0.99
    assert find_bottleneck(loads, edges=edges, tie_tolerance=0.01).stage == "a"


def test_unsaturated_pipeline_says_so():
    loads = {"x": {"replicas": 1, "busy": 0.3, "blocked_in": 0.6}, "y": {"replicas": 1, "busy": 0.2}}
    b = find_bottleneck(loads)
    assert b.stage == "x" and not b.saturated
    assert b.sentence.startswith("No stage is saturated")


def test_empty_and_stageload_inputs():
    assert find_bottleneck({}) is None
    b = find_bottleneck({"only": StageLoad("only", 2, 0.9)})
    assert b.stage == "only" and b.next_stage is None and "only stage" in b.sentence


def test_out_of_range_fractions_are_clipped():
    b = find_bottleneck({"a": {"replicas": 1, "busy": 1.7}, "b": {"replicas": 1, "busy": float("nan")}})
    assert b.busy == 1.0 and b.next_busy == 0.0


def test_a_stage_that_cannot_be_replicated_gets_no_replica_advice():
    """The trainer (one per rank) as the bottleneck: no ``replicas_needed`` beyond what it has; the
    sentence points at ranks. A fixed middle stage: the same, no 'With N replicas'."""
    loads = {
        "target": {"replicas": 2, "busy": 0.39, "blocked_out": 0.53},
        "drafter": {"replicas": 1, "busy": 0.93, "blocked_in": 0.07},
    }
    b = find_bottleneck(loads, sinks=["drafter"], fixed=["drafter"])
    assert b.stage == "drafter" and b.replicas_needed == 1 and not b.replicable
    assert "keeps it fed" in b.sentence and "--nproc" in b.sentence
    assert mlflow_metrics(b)["replicable"] == 0.0 and mlflow_metrics(b)["replicas_needed"] == 1.0
    b = find_bottleneck(PIPELINE, sinks=["trainer"], edges=EDGES, fixed=["padder"])
    assert b.stage == "padder" and b.replicas_needed == 1 and "With" not in b.sentence
    assert "cannot be replicated" in b.sentence


def _snap(t: float, stages: dict[str, tuple[float, float, str]]):
    """A snapshot at time ``t``: per stage ``(alive_s, busy_s, state)`` of one replica."""
    from dflash_flow.core.snapshot import ReplicaSnapshot, RuntimeSnapshot, StageSnapshot

    out = {}
    for name, (alive, busy, state) in stages.items():
        rep = ReplicaSnapshot(0, "cpu", state, 0, 0, busy, alive - busy, 0.0, alive, {}, None)
        out[name] = StageSnapshot(name, "T", [rep], {})
    return RuntimeSnapshot(time=t, elapsed_s=t, stages=out)


def test_stages_not_alive_in_the_window_are_not_judged():
    """A reader busy all of its 2 s life, finished before the window; the trainer is busy 90% of it."""
    from dflash_flow.observe.sample import take_sample

    first = _snap(5.0, {"reader": (2.0, 2.0, "finished"), "trainer": (5.0, 1.0, "busy")})
    last = _snap(15.0, {"reader": (2.0, 2.0, "finished"), "trainer": (15.0, 10.0, "busy")})
    s = take_sample(last, first, step=10, sinks=["trainer"], whole_run=True)
    assert s.whole_run and s.bottleneck.stage == "trainer" and "reader" not in s.bottleneck.loads
    assert s.window_label == "training steady state, 10 s"
    # Over the whole run the reader's own life is 100% busy, the trainer's 67%: still not the reader.
    whole = take_sample(last, None, step=10, sinks=["trainer"])
    assert whole.bottleneck.stage == "trainer" and whole.window_label == "whole run"
