"""Structured Monitor samples built by hand (the real classes), for the schema, plot and report tests."""

from __future__ import annotations

import attrs

from dflash_flow.items import EvalReport
from dflash_flow.observe.bottleneck import StageLoad, find_bottleneck
from dflash_flow.observe.record import History
from dflash_flow.observe.sample import (
    BucketSample,
    EvalPoint,
    MonitorSample,
    ReplicaSample,
    StageSample,
    SummaryStats,
    Throughput,
)


def replica(i: int, busy: float, depth: int | None = 2) -> ReplicaSample:
    return ReplicaSample(i, "cpu", "busy", busy, 0.1, 0.0, 10 * i, 10 * i, depth, 8 if depth is not None else None)


def stage(name: str, *reps: ReplicaSample, **metrics) -> StageSample:
    n = len(reps)
    return StageSample(
        name=name,
        type="T",
        replicas=n,
        busy=sum(r.busy for r in reps) / n,
        blocked_in=0.1,
        blocked_out=0.0,
        items_in=20,
        items_out=20,
        items_in_per_s=4.0,
        items_out_per_s=4.0,
        per_replica=tuple(reps),
        **metrics,
    )


def full_sample(step: int = 7, names=("padder", "target")) -> MonitorSample:
    a, b = names
    stages = {
        a: stage(
            a,
            replica(0, 0.9),
            replica(1, 0.7),
            counters={"real_tokens": 500.0},
            rates={"real_tokens": 50.0},
            gauges={"padding_efficiency": 0.8},
            summaries={"seq_len": SummaryStats(10, 100.0, 20.0, 300.0)},
            labeled={"bucket_dispatch": {"128": 3.0, "512": 1.0}},
        ),
        b: stage(b, replica(0, 0.4, depth=None)),
    }
    loads = {n: StageLoad(n, s.replicas, s.busy, s.blocked_in, s.blocked_out) for n, s in stages.items()}
    return MonitorSample(
        step=step,
        elapsed_s=12.0,
        window_s=5.0,
        whole_run=False,
        stages=stages,
        buckets={"128": BucketSample(3.0, 0.75), "512": BucketSample(1.0, 0.25)},
        positions=(0.5,),
        throughput=Throughput(tokens_per_s=1234.0, samples_per_s=None),
        bottleneck=find_bottleneck(loads),
    )


def run_history() -> History:
    """A 200-step run: a decaying loss, throughput, six padder queues, a bucket mix, two evaluations."""
    import math

    h = History()
    for step in range(0, 200):
        h.train.append(step, {"loss": 5.0 * math.exp(-step / 80) + 0.5, "tokens_per_s": 12000 + 50 * step, "samples_per_s": 40 + step / 10})
    q_pre = [43, 50, 28, 31, 25, 39]
    for step in range(0, 200, 10):
        reps = [replica(i, 0.5, depth=(q + step) % 64) for i, q in enumerate(q_pre)]
        s = full_sample(step)
        h.samples.append(
            attrs.evolve(
                s,
                stages={**s.stages, "padder": attrs.evolve(s.stages["padder"], per_replica=tuple(reps), replicas=6)},
                buckets={
                    "128": BucketSample(3.0 * step, 30 / 45),
                    "512": BucketSample(1.0 * step, 10 / 45),
                    "2048": BucketSample(0.5 * step, 5 / 45),
                },
            )
        )
    h.evals.append(EvalPoint(50, (EvalReport("val", {"val_loss": 2.0, "tau": 2.1}),)))
    h.evals.append(EvalPoint(150, (EvalReport("val", {"val_loss": 1.0, "tau": 3.1}),)))
    return h
