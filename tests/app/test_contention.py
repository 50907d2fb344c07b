"""CPU contention in the planner's model (`app.splitplan`): the processor-sharing wait on known cases,
the prediction on a hand-made profile, and real threads that outnumber the cores: GIL-free hashing
stages, pinned to two cores, profiled with one replica and predicted, then run, with more."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import attrs
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common import hash_graph  # noqa: E402 - the bench's workload, one copy

from dflash_flow.app.profile import Profile, StageProfile, profile
from dflash_flow.app.splitplan import predict, wait_per_cpu_s, waits
from dflash_flow.core import validated


def test_the_wait_of_processor_sharing_on_known_cases():
    # Two other threads always runnable on 2 cores: 3 share 2, so a CPU-second takes 1.5 s.
    assert wait_per_cpu_s(2, [(1.0, 2)]) == pytest.approx(0.5)
    # Each runnable half the time: all three only a quarter of it.
    assert wait_per_cpu_s(2, [(0.5, 2)]) == pytest.approx(0.25 * 0.5)
    # Never more threads than cores, however busy; and idle threads cost nothing.
    assert wait_per_cpu_s(4, [(1.0, 3)]) == 0.0 and wait_per_cpu_s(1, [(0.0, 5)]) == 0.0
    # One core, 3 others each runnable 0.3: E[K] = 0.9 (the binomial's mean).
    assert wait_per_cpu_s(1, [(0.3, 3)]) == pytest.approx(0.9)
    # Two classes convolve: (1.0 x 1) and (0.5 x 2) on 2 cores: K = 1 + Binomial(2, 0.5).
    expected = 0.5 * 0.5 + 0.25 * 1.0  # K = 2: 1.5 - 1 (p 0.5); K = 3: 2 - 1 (p 0.25)
    assert wait_per_cpu_s(2, [(1.0, 1), (0.5, 2)]) == pytest.approx(expected)


def _stage(name: str, replicas: int, work: float, cpu: float, wait: float, *, type_: str = "X",
           replicable: bool = True) -> StageProfile:
    return StageProfile(name=name, type=type_, replicas=replicas, replicable=replicable, observer=False, busy=0.5,
                        blocked_in=0.0, blocked_out=0.0, items_in=10, items_out=10, items_per_s=1.0, service_s=work,
                        items_per_batch=1.0, work_s_per_batch=work, cpu_s_per_batch=cpu, cpu_wait_s_per_batch=wait)


def _two_stage(cores: int = 2, target_wait: float = 0.0) -> Profile:
    """A drafter of 0.2 s a batch (all CPU) fed by one target of 0.15 s (all CPU): 5 batches/s, the
    drafter always runnable, the target 75% of the time; two threads on ``cores`` cores."""
    stages = {"target": _stage("target", 1, 0.15 + target_wait, 0.15, target_wait, type_="TargetForward"),
              "drafter": _stage("drafter", 1, 0.2, 0.2, 0.0, type_="DrafterStep", replicable=False)}
    return Profile(pipeline="cpu", step_stage="drafter", steps=10, grad_accum=1, warmup_batches=1, complete=True,
                   batches=50, window_s=10.0, elapsed_s=12.0, batches_per_s=5.0, steps_per_s=5.0, stages=stages,
                   cpu_s_per_batch=0.35, cores=cores)


def test_a_second_target_thread_slows_the_drafter_on_two_cores():
    p = _two_stage()
    assert predict(p).batches_per_s == pytest.approx(5.0) and not any(predict(p).waits.values())
    two = predict(p, {"target": 2})
    # Three threads on two cores: the drafter waits while both targets run, so it passes fewer than 5.
    assert two.limit == "drafter" and 4.0 < two.batches_per_s < 5.0 and two.waits["drafter"] > 0
    # The fixed point: at the predicted rate, the drafter's work with its predicted wait gives that rate.
    q = waits(p, {"target": 2}, 1, 2, two.batches_per_s)
    assert 1 / (0.2 + q["drafter"]) == pytest.approx(two.batches_per_s, rel=1e-3)
    # With cores to spare nothing waits; two ranks on the same two cores wait more than one rank does.
    assert predict(p, {"target": 2}, cores=8).batches_per_s == pytest.approx(5.0)
    assert predict(p, ranks=2).batches_per_s < two.batches_per_s
    # Both ranks' CPU (0.35 s a batch each) fits 2 cores only below 2.86 batches/s each.
    assert predict(p, ranks=2).batches_per_s <= 2 / (2 * 0.35) + 1e-9
    # A wait the model does not cover (another process took the cores while profiling) stays in the work.
    loaded = _two_stage(target_wait=0.05)
    assert predict(loaded).batches_per_s == pytest.approx(5.0)
    assert predict(loaded, {"target": 2}).rates["target"] > predict(p, {"target": 2}).rates["target"] * 0.5


def test_threads_that_outnumber_the_cores_are_foreseen(tmp_path):
    """Pinned to 2 cores: ``a`` (8 units of hashing an item) with 1 replica feeds ``b`` (4 units). The model,
    given the profile's CPU figures, foresees that 2 replicas of ``a`` (3 busy threads on 2 cores) wait for a
    core, so it predicts a slower rate than the model without them; and a real run with 2 replicas does wait.
    How close the prediction comes to that run is a quiet machine's question: bench/profile_bench.py measures
    it (within 30% on the 2-core box, docs/benchmarks.md); here, beside other work, only what holds under load."""
    cores = 2
    before = os.sched_getaffinity(0)  # Linux, as the CPU figures (schedstat) are
    assert len(before) >= cores, "this check pins its threads to two cores; our machines have two"
    os.sched_setaffinity(0, sorted(before)[:cores])  # threads started from here on inherit it
    try:
        one = profile(validated(hash_graph(tmp_path, 1, cores, 4)), 150, warmup_steps=5, interval_s=0.02)
        assert one.cores == cores and one.stage("a").cpu_s_per_batch > 0
        pred = predict(one, {"a": cores})
        plain_stages = {n: attrs.evolve(s, cpu_s_per_batch=None, cpu_wait_s_per_batch=None) for n, s in one.stages.items()}
        plain = predict(attrs.evolve(one, stages=plain_stages, cpu_s_per_batch=None), {"a": cores})
        two = profile(validated(hash_graph(tmp_path, cores, cores, 4)), 150, warmup_steps=5, interval_s=0.02)
    finally:
        os.sched_setaffinity(0, before)
    waited = sum(s.cpu_wait_s_per_batch for n, s in two.stages.items() if n in ("a", "b"))
    ran = sum(s.cpu_s_per_batch for n, s in two.stages.items() if n in ("a", "b"))
    assert waited > 0.05 * ran, (waited, ran)  # the oversubscription is seen (more so on a busy machine)
    print(f"predicted {pred.batches_per_s:.1f} ({pred.limit}), without the CPU figures {plain.batches_per_s:.1f}, "
          f"measured {two.batches_per_s:.1f} batches/s; waited {waited:.4f} s a batch for {ran:.4f} s of CPU")
    # The CPU figures can only slow the prediction (on a quiet box by 25-40%: profile_bench's contention row;
    # beside other work the profiled mix's own waits already hold most of it).
    assert pred.batches_per_s <= plain.batches_per_s * (1 + 1e-9), (pred, plain)


