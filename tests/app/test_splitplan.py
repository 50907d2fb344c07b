"""`dflash-flow plan`: the throughput model on known costs, the GPU splits and the recommendation, the
model's accuracy against real runs of sleep-stage pipelines, and the command's output and errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from dflash_flow.app.profile import Profile, ProfileError, StageProfile, profile, save_profile
from dflash_flow.app.splitplan import (
    allreduce_s,
    evaluate_split,
    plan_splits,
    predict,
    recommend,
    render_plan,
)

REPO = Path(__file__).resolve().parents[2]


def _stage(name: str, type_: str, replicas: int, work: float, *, replicable: bool = True) -> StageProfile:
    return StageProfile(name=name, type=type_, replicas=replicas, replicable=replicable, observer=False, busy=0.5,
                        blocked_in=0.0, blocked_out=0.0, items_in=10, items_out=10, items_per_s=1.0, service_s=work,
                        items_per_batch=1.0, work_s_per_batch=work)


def _profile(target_w: float = 0.3, drafter_w: float = 0.1, padder_w: float = 0.01, grad_accum: int = 2) -> Profile:
    stages = {
        "padder": _stage("padder", "Padder", 1, padder_w),
        "target": _stage("target", "TargetForward", 2, target_w),
        "drafter": _stage("drafter", "DrafterStep", 1, drafter_w, replicable=False),
        "monitor": attrs.evolve(_stage("monitor", "Monitor", 1, 5.0, replicable=False), observer=True),
    }
    return Profile(pipeline="known", step_stage="drafter", steps=10, grad_accum=grad_accum, warmup_batches=2,
                   complete=True, batches=20, window_s=3.0, elapsed_s=5.0, batches_per_s=6.67, steps_per_s=3.33,
                   samples_per_batch=4.0, tokens_per_batch=1000.0, stages=stages)


def test_predict_is_the_slowest_stage_over_its_replicas():
    p = _profile()
    pred = predict(p)
    assert pred.limit == "target" and pred.batches_per_s == pytest.approx(2 / 0.3)
    assert "monitor" not in pred.rates  # an observer's load is its own sampling
    assert predict(p, {"target": 4}).limit == "drafter"
    assert predict(p, {"target": 4}).batches_per_s == pytest.approx(10.0)
    assert predict(p, {"target": 4}, extra_work_s={"drafter": 0.1}).batches_per_s == pytest.approx(5.0)
    with pytest.raises(ProfileError, match="no stage named nope"):
        predict(p, {"nope": 1})


def test_allreduce_grows_like_a_ring():
    assert allreduce_s(1, 0.2) == 0.0 and allreduce_s(2, 0.2) == pytest.approx(0.2)
    assert allreduce_s(4, 0.2) == pytest.approx(0.3) and allreduce_s(8, 0.2) == pytest.approx(0.35)


def test_splits_of_eight_gpus_and_the_recommendation():
    p = _profile()
    splits = plan_splits(p, 8)
    assert [(s.ranks, s.targets_per_rank, s.gpus_used) for s in splits] == [(1, 7, 8), (2, 3, 8), (3, 1, 6), (4, 1, 8)]
    one, two, three, four = splits
    assert one.batches_per_s_rank == pytest.approx(10.0) and one.limit == "drafter"
    assert one.steps_per_s == pytest.approx(5.0) and one.samples_per_s == pytest.approx(40.0)
    assert two.samples_per_s == pytest.approx(80.0) and two.tokens_per_s == pytest.approx(20_000.0)
    assert three.limit == "target" and three.samples_per_s == pytest.approx(40.0)
    assert recommend(splits) == two
    # An all-reduce of 0.1 s per step at two ranks: 0.05 s more per micro-batch for the trainer at two.
    slow = plan_splits(p, 8, allreduce_at_two=0.1)
    assert slow[1].batches_per_s_rank == pytest.approx(1 / 0.15) and slow[1].allreduce_s == pytest.approx(0.1)
    assert slow[3].allreduce_s == pytest.approx(0.15) and slow[3].limit == "target"
    text = render_plan(p, splits, recommend(splits), 8)
    assert "recommended: 2 rank(s) x (3 TargetForward + 1 DrafterStep)" in text and "limited by" in text


def test_ties_prefer_fewer_gpus_then_fewer_ranks():
    # Cheap targets: the drafter bounds a rank at 10 batches/s whatever its targets, so 1 target per rank
    # does as well as 3, and among equals the split using fewer GPUs wins.
    p = _profile(target_w=0.05, drafter_w=0.1)
    splits = plan_splits(p, 4)
    assert [(s.ranks, s.targets_per_rank) for s in splits] == [(1, 3), (2, 1)]
    assert recommend(splits).ranks == 2  # twice the samples/s
    single = [evaluate_split(p, 1, t, target_stage="target", padder_stage="padder") for t in (1, 3)]
    assert single[0].samples_per_s == pytest.approx(single[1].samples_per_s)
    assert recommend(single).targets_per_rank == 1


def test_padders_are_sized_to_not_limit():
    p = _profile(target_w=0.05, drafter_w=0.1, padder_w=0.25)
    s = evaluate_split(p, 1, 3, target_stage="target", padder_stage="padder")
    assert s.padders_per_rank == 3 and s.limit == "drafter"  # ceil(0.25 * 10)


def test_plan_errors():
    p = _profile()
    with pytest.raises(ProfileError, match="at least 2"):
        plan_splits(p, 1)
    with pytest.raises(ProfileError, match="no single TargetForward stage"):
        plan_splits(attrs.evolve(p, stages={k: v for k, v in p.stages.items() if k != "target"}), 4)
    with pytest.raises(ProfileError, match="--padder-stage: no stage named 'x'"):
        plan_splits(p, 4, padder_stage="x")


def _bench(name: str):
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_predictions_match_real_sleep_pipelines():
    """A model-accuracy check, not a speed test: the profile of one replica mix predicts the throughput
    of others, each then run for real. Target 10%; 20% here, for a shared, loaded machine."""
    bench = _bench("profile_bench")
    mixes = [{"a": 2, "b": 1}, {"a": 3, "b": 1}, {"a": 3, "b": 2}]
    result = bench.validate_sleep(80, mixes)
    limits = [r["limited_by"] for r in result["rows"]]
    assert limits == ["a", "a", "b", "a"]  # the model moves the bottleneck where the runs find it
    assert [r["measured_bottleneck"] for r in result["rows"]] == limits
    for row in result["rows"]:
        assert abs(row["error"]) <= 0.20, row


PLAN_YAML = """
name: plan-yaml
output_dir: {out}
tracking: {{enabled: false}}
stages:
  - {{name: src, type: Range, config: {{count: 100000, service_s: 0.001}}}}
  - {{name: work, type: Delay, inputs: [src], replicas: 2, config: {{service_s: 0.02}}}}
  - {{name: train, type: Delay, inputs: [work], config: {{service_s: 0.005}}}}
  - {{name: sink, type: Discard, inputs: [train]}}
"""


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_flow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_cli_plan_from_a_profile(tmp_path):
    import dflash_flow.app  # noqa: F401 - registers the application sections
    from dflash_flow.core import load_graph, validated

    f = tmp_path / "p.yaml"
    f.write_text(PLAN_YAML.format(out=tmp_path / "out"))
    prof = profile(validated(load_graph(f)), 40, warmup_steps=3, interval_s=0.02)
    path = save_profile(prof, tmp_path / "prof.json")
    proc = _cli("plan", str(f), "--gpus", "6", "--profile", str(path), "--target-stage", "work", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plan for 6 GPUs" in proc.stdout and "recommended:" in proc.stdout
    proc = _cli("plan", str(f), "--gpus", "6", "--profile", str(path), cwd=tmp_path)
    assert proc.returncode == 2 and "no single TargetForward stage" in proc.stderr and "Traceback" not in proc.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    proc = _cli("plan", str(f), "--gpus", "6", "--profile", str(bad), cwd=tmp_path)
    assert proc.returncode == 2 and "bad.json: not a profile" in proc.stderr and "Traceback" not in proc.stderr
