"""`dflash-flow profile`: the window arithmetic on hand-made snapshots, real runs of sleep-stage pipelines
(Python and CLI), the JSON file, MLflow read back from a real sqlite store, bad input, and the embedded
default shortened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_flow.app.profile import (
    Profile,
    ProfileError,
    build_profile,
    find_step_stage,
    load_profile,
    profile,
    render_profile,
    save_profile,
)
from dflash_flow.core import Graph, RuntimeOptions, validated
from dflash_flow.core.channel import ChannelStats
from dflash_flow.core.snapshot import ReplicaSnapshot, RuntimeSnapshot, StageSnapshot
from dflash_flow.stages.generic import Delay, Discard, Range

REPO = Path(__file__).resolve().parents[2]


def _graph(tmp_path: Path, a_s: float = 0.02, b_s: float = 0.008, a_replicas: int = 2, count: int = 100_000) -> Graph:
    g = Graph(name="sleepy", seed=0, output_dir=str(tmp_path / "out"), runtime=RuntimeOptions(capacity=6))
    g.add("src", Range(count=count, service_s=0.001))
    g.add("a", Delay(service_s=a_s), inputs="src", replicas=a_replicas)
    g.add("b", Delay(service_s=b_s), inputs="a")
    g.add("sink", Discard(), inputs="b")
    return g


def _rep(i: int, busy: float, bin_: float, bout: float, n_in: int, n_out: int, depth: int | None = 2) -> ReplicaSnapshot:
    ch = ChannelStats(4, depth, n_in, n_in, 0.0, bin_) if depth is not None else None
    return ReplicaSnapshot(i, "cpu", "busy", n_in, n_out, busy, bin_, bout, busy + bin_ + bout, {}, ch)


def _snap(t: float, stages: dict[str, list[ReplicaSnapshot]], types: dict[str, str]) -> RuntimeSnapshot:
    return RuntimeSnapshot(time=t, elapsed_s=t, stages={n: StageSnapshot(n, types[n], r, {}) for n, r in stages.items()})


def test_window_arithmetic_on_hand_made_snapshots(tmp_path):
    v = validated(_graph(tmp_path))
    types = {"src": "Range", "a": "Delay", "b": "Delay", "sink": "Discard"}
    start = _snap(10.0, {
        "src": [_rep(0, 1.0, 0.0, 9.0, 0, 100, depth=None)],
        "a": [_rep(0, 8.0, 2.0, 0.0, 50, 50), _rep(1, 8.0, 2.0, 0.0, 50, 50)],
        "b": [_rep(0, 5.0, 5.0, 0.0, 100, 100)],
        "sink": [_rep(0, 0.1, 9.9, 0.0, 100, 0)],
    }, types)
    # 10 s later: 400 more items; `a` (2 replicas) did 20 s of work for them, `b` 4 s.
    end = _snap(20.0, {
        "src": [_rep(0, 1.8, 0.0, 18.2, 0, 500, depth=None)],
        "a": [_rep(0, 18.0, 2.0, 0.0, 250, 250), _rep(1, 18.0, 2.0, 0.0, 250, 250)],
        "b": [_rep(0, 9.0, 11.0, 0.0, 500, 500)],
        "sink": [_rep(0, 0.2, 19.8, 0.0, 500, 0)],
    }, types)
    p = build_profile(v, start, end, step_stage="sink", steps=400, warmup_batches=100, complete=True, elapsed_s=20.0,
                      depths={"a": {0: [4, 4, 3], 1: [2, 4, 3]}})
    assert p.batches == 400 and p.window_s == pytest.approx(10.0) and p.batches_per_s == pytest.approx(40.0)
    a, b, src = p.stage("a"), p.stage("b"), p.stage("src")
    assert a.busy == pytest.approx(1.0) and a.items_per_s == pytest.approx(40.0)
    assert a.service_s == pytest.approx(0.05) and a.work_s_per_batch == pytest.approx(0.05)
    assert a.max_batches_per_s == pytest.approx(40.0)
    assert b.busy == pytest.approx(0.4) and b.blocked_in == pytest.approx(0.6)
    assert b.service_s == pytest.approx(0.01) and b.items_per_batch == 1.0
    assert src.service_s == pytest.approx(0.002) and src.items_per_batch == pytest.approx(1.0)
    assert a.per_replica[1].queue.min == 2 and a.per_replica[1].queue.max == 4
    assert a.queue.mean == pytest.approx(20 / 6)
    assert p.bottleneck.stage == "a"
    # Fixed stages (src: Range shards, so not fixed; the sink is the trainer) allow sink's 1/0.00025 = 4000/s;
    # today's 4 replicable replicas spread by work (0.062 s/batch) allow 64.5/s: a 4, b 1, src 1.
    assert p.balanced_replicas == {"src": 1, "a": 4, "b": 1, "sink": 1}


def test_profile_of_a_sleep_pipeline(tmp_path):
    # a: 40 ms an item on 2 replicas (20 ms a batch), b: 4 ms: a stays the bottleneck however much a busy
    # machine stretches each sleep (an overshoot adds the same to both; with 20 and 8 ms it could swap them).
    v = validated(_graph(tmp_path, a_s=0.04, b_s=0.004))
    p = profile(v, 60, warmup_steps=4, interval_s=0.02)
    assert p.complete and p.step_stage == "sink" and p.batches >= 60
    a, b = p.stage("a"), p.stage("b")
    # A sleep never ends early; the window's edges cut one item per replica at most (the lower bounds). It
    # overshoots on a loaded machine by as much as the machine likes: no upper bound but the order of the two.
    assert a.service_s >= 0.036 and b.service_s >= 0.0036 and a.service_s > b.service_s
    assert p.bottleneck.stage == "a" and a.busy > 0.8
    assert a.queue.capacity == 12 and a.queue.mean > 3  # a's input queues stay full: src waits for a
    assert p.balanced_replicas["a"] >= 3
    assert set(p.queues.depth) == {"a[0]", "a[1]", "b[0]", "sink[0]"} and len(p.queues.t) == len(p.queues.depth["b[0]"])
    # Sleeps spend no CPU: the process's CPU seconds per batch are a small part of a's 20 ms of work, every
    # part has its own, and the cores are this process's.
    from dflash_flow.util import usable_cores

    assert p.cpu_s_per_batch is not None and 0 < p.cpu_s_per_batch < 0.5 * a.work_s_per_batch
    assert p.cores == usable_cores() and all(w.cpu_s is not None and w.cpu_s >= 0 for w in p.windows)
    text = render_profile(p)
    assert "bottleneck: a is the bottleneck" in text and "a[1]" in text and "balanced replicas: a 2 ->" in text
    path = save_profile(p, tmp_path / "p.json")
    assert load_profile(path) == p


def test_a_pipeline_that_ends_before_the_window_is_a_profile_error(tmp_path):
    v = validated(_graph(tmp_path, count=3))
    with pytest.raises(ProfileError, match="ended before its trainer 'sink' took 5 batch"):
        profile(v, 10, warmup_steps=5, interval_s=0.02)


def test_a_pipeline_that_ends_inside_the_window_is_marked_incomplete(tmp_path):
    v = validated(_graph(tmp_path, a_s=0.002, b_s=0.001, count=60))
    p = profile(v, 1000, warmup_steps=2, interval_s=0.01)
    assert not p.complete and 0 < p.batches < 60
    assert "the pipeline ended before 1000 steps" in render_profile(p)


def test_profile_until_the_rate_is_known_to_the_asked_precision(tmp_path):
    """A jittered sleep stage (10 ms +- 9 ms an item): 60 steps in 6 parts know the rate to about +-15%;
    asked for +-5%, the window grows a 10-batch part at a time until its parts say so; asked for +-0.1%
    with at most 80 steps, it stops at 80 and says it did not get there. Bad asks fail before running."""
    g = Graph(name="jitter", seed=0, output_dir=str(tmp_path / "out"), runtime=RuntimeOptions(capacity=6))
    g.add("src", Range(count=100_000))
    g.add("a", Delay(service_s=0.01, jitter_s=0.009), inputs="src")
    g.add("sink", Discard(), inputs="a")
    v = validated(g)
    p = profile(v, 60, warmup_steps=2, interval_s=0.01, windows=6, precision=0.05)
    assert p.precision == 0.05 and p.reached is not None and p.complete
    assert 60 < p.steps <= 600 and p.batches >= p.steps - 10 and len(p.windows) > 6
    from dflash_flow.app.profile_data import batch_means

    rates = [w.batches / w.window_s for w in p.windows]
    assert batch_means(p.batches_per_s, rates).half_width <= p.reached * p.batches_per_s * 1.01  # what it says
    if p.reached <= 0.05:  # a quiet machine: ~150 steps
        assert "measured until the rate was known to +-" in render_profile(p)
    else:  # a busy machine's drift can keep the rate from settling: then it stops at 10x and says so
        assert p.steps == 600 and "not the asked +-5%" in render_profile(p), render_profile(p)
    short = profile(v, 20, warmup_steps=2, interval_s=0.01, windows=4, precision=0.001, max_steps=40)
    assert short.steps == 40 and short.reached > 0.001 and 40 <= short.batches <= 45
    assert "not the asked +-0.1%" in render_profile(short)
    assert load_profile(save_profile(short, tmp_path / "short.json")) == short
    with pytest.raises(ProfileError, match="--precision must be a fraction"):
        profile(v, 10, windows=1, precision=0.05)
    with pytest.raises(ProfileError, match=r"--max-steps \(5\) must be at least --steps \(10\)"):
        profile(v, 10, precision=0.05, max_steps=5)


def test_step_stage_must_be_found(tmp_path):
    g = _graph(tmp_path)
    g.add("sink2", Discard(), inputs="b")
    v = validated(g)
    with pytest.raises(ProfileError, match="cannot tell which stage is the trainer"):
        find_step_stage(v)
    with pytest.raises(ProfileError, match="no stage named 'nope'"):
        profile(v, 3, step_stage="nope")


def test_load_profile_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match=r"bad\.json: not a profile \(invalid JSON"):
        load_profile(bad)
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(ProfileError, match="not a profile of version 1 or 2"):
        load_profile(bad)
    with pytest.raises(ProfileError, match="cannot read"):
        load_profile(tmp_path / "missing.json")


SLEEP_YAML = """
name: sleepy-yaml
output_dir: {out}
runtime: {{capacity: 4}}
tracking: {{enabled: false, tracking_uri: "sqlite:///{db}", experiment: prof}}
stages:
  - {{name: src, type: Range, config: {{count: 100000, service_s: 0.001}}}}
  - {{name: work, type: Delay, inputs: [src], replicas: 2, config: {{service_s: 0.01}}}}
  - {{name: sink, type: Discard, inputs: [work]}}
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_flow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.slow
def test_cli_profile_writes_json_and_logs_to_mlflow(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(SLEEP_YAML.format(out=tmp_path / "out", db=tmp_path / "mlflow.db"))
    proc = _cli("profile", str(f), "--steps", "40", "--warmup", "3", "--interval", "0.02", "--tracking",
                "--precision", "0.2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bottleneck: work is the bottleneck" in proc.stdout and "work[1]" in proc.stdout
    data = json.loads((tmp_path / "out" / "profile.json").read_text())
    assert data["step_stage"] == "sink" and data["stages"]["work"]["replicas"] == 2

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("prof").experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "sleepy-yaml-profile"
    assert run.data.metrics["profile/batches_per_s"] == pytest.approx(data["batches_per_s"])
    assert run.data.metrics["profile/stage/work/service_s"] == pytest.approx(data["stages"]["work"]["service_s"])
    assert run.data.metrics["profile/stage/work/replica/1/queue/max"] <= 4
    assert run.data.tags["bottleneck"] == "work"
    assert run.data.metrics["profile/reached"] == pytest.approx(data["reached"]) and data["reached"] <= 0.2
    assert run.data.metrics["profile/cpu_s_per_batch"] == pytest.approx(data["cpu_s_per_batch"])
    assert "profile.json" in [a.path for a in client.list_artifacts(run.info.run_id)]


@pytest.mark.slow
def test_cli_profile_bad_input_is_one_line_and_exit_2(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(SLEEP_YAML.format(out=tmp_path / "out", db=tmp_path / "mlflow.db").replace("count: 100000", "count: 2"))
    proc = _cli("profile", str(f), "--steps", "5", "--warmup", "3", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error:" in proc.stderr and "ended before its trainer" in proc.stderr
    proc = _cli("profile", str(f), "--steps", "5", "--step-stage", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "no stage named 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    proc = _cli("profile", str(f), "--steps", "5", "--precision", "0.05", "--windows", "1", cwd=tmp_path)
    assert proc.returncode == 2 and "--precision must be a fraction" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_cli_profile_of_the_embedded_default(tmp_path):
    out = tmp_path / "out"
    proc = _cli(
        "profile", str(REPO / "pipelines" / "dflash.yaml"), "--steps", "3",
        "--set", f"output_dir={out}", "--set", "stages.monitor.progress=false", "--out", str(tmp_path / "prof.json"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    p = load_profile(tmp_path / "prof.json")
    assert isinstance(p, Profile) and p.step_stage == "drafter" and p.complete and p.batches >= 3
    assert p.tokens_per_batch > 0 and p.samples_per_batch > 0
    assert p.stage("target").replicas == 2 and p.stage("target").service_s > 0
    assert p.stage("drafter").work_s_per_batch > 0 and not p.stage("monitor").replicable
    # The drafter's step is CPU compute here: its thread ran or waited, runnable, for a core through most of it
    # (beside other work the wait grows, not the sum).
    d = p.stage("drafter")
    assert d.cpu_s_per_batch + d.cpu_wait_s_per_batch >= 0.5 * d.work_s_per_batch and p.cpu_s_per_batch > 0
    assert p.cores >= 1
    assert "cores busy" in proc.stdout
    assert not (out / "drafter").exists()  # cancelled after the window: no export, no evaluation
