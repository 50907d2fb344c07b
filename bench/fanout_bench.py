"""Fan-out benchmark: batch order x routing policy when a batch's cost depends on its length bucket.

Writes bench/results/fanout.json (also printed). The batches are a real epoch plan (``BatchPlanner``) of
sample lengths from bench/data/lengths-chat-100k.txt under a padded-token budget. Costs are sleeps (GIL-free,
like GPU kernels): a TargetForward stand-in with ``REPLICAS`` replicas sleeps in proportion to the batch's
padded tokens times ``1 + S / c`` (attention grows with the padded length S; ``c`` is set so that the
longest bucket's batches cost ~2.5x the shortest's), and an ordered trainer (``ordered: true``, like
DrafterStep) sleeps in proportion to the batch's real tokens. Orders:

* ``shuffle``: the plan's bucket batches uniformly shuffled (the seed project's order);
* ``interleaver``: the Interleaver's order (``order_packed``: same-bucket runs capped at ``max_run``).

Policies on the fan-out edge: ``round_robin`` and ``least_loaded``. Each run is profiled
(``app.profile``): throughput over the window, divided by the analytic bound ``min(K / w_target,
1 / w_trainer)`` from the work per batch the stages actually did in that run (``app.splitplan.predict``:
sleeps overshoot on a loaded machine, which no schedule wins back), and each target replica's input
queue depth (min/mean/max over the window's polls). Runs alternate over the four cells, ``--reps`` times.

Usage: python bench/fanout_bench.py [--out FILE] [--samples 5000] [--reps 2] [--unit-ms 30]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

import attrs
import common
import numpy as np

from dflash_flow.core import Stage, register_stage

REPLICAS = 3
MAX_TOKENS = 16384
NUM_BUCKETS = 4
MAX_RUN = 3
LONG_OVER_SHORT = 2.5
TRAIN_SHARE = 0.6  # the trainer's mean cost / the targets' mean cost per batch with REPLICAS replicas
CAPACITY = 4
SEED = 42


@register_stage("FanoutSource")
@attrs.define(kw_only=True, eq=False)
class FanoutSource(common.ItemsSource):
    """Emits the batches given as ``items`` (bucket, target seconds, trainer seconds), in that order."""

    output_type = tuple


@register_stage("FanoutTarget")
@attrs.define(kw_only=True, eq=False)
class FanoutTarget(Stage):
    input_type = tuple
    output_type = tuple

    def process(self, item):
        import time

        time.sleep(item[1])
        return (item,)


@register_stage("FanoutTrainer")
@attrs.define(kw_only=True, eq=False)
class FanoutTrainer(Stage):
    input_type = tuple
    output_type = None

    def process(self, item):
        import time

        time.sleep(item[2])
        return None


def _solve_c(buckets: np.ndarray, tokens: np.ndarray, lens: np.ndarray) -> float:
    """``c`` for which the mean cost of the longest bucket's batches is LONG_OVER_SHORT x the shortest's."""
    def ratio(c: float) -> float:
        cost = tokens * (1 + lens / c)
        return cost[buckets == buckets.max()].mean() / cost[buckets == buckets.min()].mean()

    lo, hi = 1.0, 1e7  # ratio falls as c grows
    for _ in range(200):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if ratio(mid) > LONG_OVER_SHORT else (lo, mid)
    return (lo * hi) ** 0.5


def workload(n_samples: int, unit_s: float) -> dict[str, Any]:
    """The epoch's batches with their costs, and the two orders (lists of (bucket, target_s, train_s))."""
    from dflash_flow.data.epoch import order_packed
    from dflash_flow.data.packing import PlanConfig, epoch_rng
    from dflash_flow.data.plan import BatchPlanner, max_same_bucket_run

    lengths = np.loadtxt(common.ROOT / "bench" / "data" / "lengths-chat-100k.txt", dtype=np.int64)[:n_samples]
    planner = BatchPlanner(lengths, PlanConfig(max_tokens=MAX_TOKENS, num_buckets=NUM_BUCKETS, max_run=MAX_RUN), seed=SEED)
    packed = planner.pack(0)
    plan = order_packed(packed, max_run=MAX_RUN)
    n = len(plan)
    sizes = np.diff(plan.offsets)
    padded = sizes * plan.padded_lens
    real = np.add.reduceat(plan.lengths[plan.order], plan.offsets[:-1])
    c = _solve_c(plan.buckets, padded, plan.padded_lens)
    raw = padded * (1 + plan.padded_lens / c)
    target_s = unit_s * raw / raw.mean()
    train_s = TRAIN_SHARE * unit_s / REPLICAS * real / real.mean()
    items = [(int(b), float(t), float(r)) for b, t, r in zip(plan.buckets, target_s, train_s, strict=True)]
    perm = epoch_rng(SEED, 0, 0xBA5E2).permutation(n)  # batching_bench's bucket_shuffle order
    shuffled = [items[i] for i in perm.tolist()]
    per_bucket = {int(b): round(float(target_s[plan.buckets == b].mean()), 4) for b in np.unique(plan.buckets)}
    return {
        "orders": {"shuffle": shuffled, "interleaver": items},
        "batches": n,
        "attention_c": round(c, 1),
        "target_mean_s_per_bucket": per_bucket,
        "long_over_short": round(per_bucket[max(per_bucket)] / per_bucket[min(per_bucket)], 3),
        "max_same_bucket_run": {"shuffle": max_same_bucket_run(plan.buckets[perm]), "interleaver": max_same_bucket_run(plan.buckets)},
        "nominal_bound_batches_per_s": round(1 / max(target_s.mean() / REPLICAS, train_s.mean()), 3),
    }


def run_cell(items: list, policy: str, tag: str) -> dict[str, Any]:
    from dflash_flow.app.profile import profile
    from dflash_flow.app.splitplan import predict
    from dflash_flow.core import Graph, RuntimeOptions, validated

    src = FanoutSource()
    src.items = items
    g = Graph(name=f"fanout-{tag}", seed=SEED, output_dir=str(common.SCRATCH / "fanout"), runtime=RuntimeOptions(capacity=CAPACITY))
    g.add("source", src)
    g.add("target", FanoutTarget(), inputs="source", replicas=REPLICAS, policy=policy)
    g.add("trainer", FanoutTrainer(), inputs="target", ordered=True)
    p = profile(validated(g), len(items), warmup_steps=5, interval_s=0.02)
    bound = predict(p).batches_per_s
    t = p.stage("target")
    return {
        "batches_per_s": round(p.batches_per_s, 3),
        "bound_batches_per_s": round(bound, 3),
        "efficiency": round(p.batches_per_s / bound, 4),
        "target_busy": round(t.busy, 3),
        "trainer_busy": round(p.stage("trainer").busy, 3),
        "queue_depth_per_replica": [
            {"min": r.queue.min, "mean": round(r.queue.mean, 2), "max": r.queue.max} for r in t.per_replica if r.queue
        ],
        "items_per_replica": [r.items_in for r in t.per_replica],
        "busy_per_replica": [round(r.busy, 3) for r in t.per_replica],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=common.RESULTS / "fanout.json")
    ap.add_argument("--samples", type=int, default=5000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--unit-ms", type=float, default=30.0, help="Mean target cost per batch.")
    args = ap.parse_args(argv)
    w = workload(args.samples, args.unit_ms / 1000)
    cells: dict[str, list[dict[str, Any]]] = {}
    for rep in range(args.reps):
        for order in ("shuffle", "interleaver"):
            for policy in ("round_robin", "least_loaded"):
                cells.setdefault(f"{order}/{policy}", []).append(run_cell(w["orders"][order], policy, f"{order}-{policy}-{rep}"))
    summary = {}
    for key, runs in cells.items():
        summary[key] = {
            "efficiency": statistics.median(r["efficiency"] for r in runs),
            "batches_per_s": statistics.median(r["batches_per_s"] for r in runs),
            "mean_queue_depth_per_replica": [round(statistics.fmean(r["queue_depth_per_replica"][i]["mean"] for r in runs), 2)
                                             for i in range(REPLICAS)],
            "max_queue_depth_per_replica": [max(r["queue_depth_per_replica"][i]["max"] for r in runs) for i in range(REPLICAS)],
        }
    best = max(summary, key=lambda k: summary[k]["efficiency"])
    result = {
        "machine": common.machine(),
        "workload": {k: v for k, v in w.items() if k != "orders"},
        "replicas": REPLICAS,
        "capacity": CAPACITY,
        "summary": summary,
        "best": best,
        "runs": cells,
    }
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
