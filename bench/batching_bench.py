"""Batching benchmark: padding, same-bucket runs and window mix of the epoch plan vs. two baselines.

Reads sample lengths (one per line) and writes bench/results/batching.json (also printed). All figures
come from one run:

* ``plan``: `BatchPlanner` (quantile buckets, token budget, diversity-first interleaving);
* ``random_fixed``: samples in a uniform shuffle cut into fixed-size batches (16 by default; 8, the
  largest size that never exceeds a 65,536 budget at length 8192, gives 0.33); a batch's bucket is its
  longest sample's bucket;
* ``bucket_shuffle``: the plan's own batches in a uniform shuffle (the seed project's order).

Usage: python bench/batching_bench.py [--lengths FILE] [--out FILE] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dflash_flow.data.packing import PlanConfig, assign_buckets, epoch_rng  # noqa: E402
from dflash_flow.data.plan import BatchPlanner, max_same_bucket_run, window_mix_max_deviation  # noqa: E402

WINDOW = 32


def _figures(buckets: np.ndarray, real: int, padded: int) -> dict:
    return {
        "padding_efficiency": round(real / padded, 4),
        "max_same_bucket_run": max_same_bucket_run(buckets),
        "window_mix_max_deviation": round(window_mix_max_deviation(buckets, WINDOW), 4),
        "batches": int(buckets.size),
    }


def _pair_retention(plan_a, plan_b, n: int) -> float:
    """Share of same-batch sample pairs of epoch a that share a batch again in epoch b (1 = no change)."""
    ids = []
    for p in (plan_a, plan_b):
        b = np.empty(n, dtype=np.int64)
        b[p.order] = np.repeat(np.arange(len(p)), np.diff(p.offsets))
        ids.append(b)

    def pairs(keys: np.ndarray) -> int:
        _, c = np.unique(keys, return_counts=True, axis=0)
        return int((c * (c - 1) // 2).sum())

    return pairs(np.stack(ids, axis=1)) / pairs(ids[0][:, None])


def run(
    lengths_path: Path,
    epochs: int,
    seed: int,
    max_tokens: int,
    num_buckets: int,
    max_run: int,
    random_batch_size: int = 16,
) -> dict:
    lengths = np.loadtxt(lengths_path, dtype=np.int64)
    config = PlanConfig(max_tokens=max_tokens, num_buckets=num_buckets, max_run=max_run)

    # Build time: a fresh planner (boundaries, bucket assignment) plus one epoch's plan, best of a few.
    times = []
    for e in range(max(epochs, 3)):
        t0 = time.perf_counter()
        planner = BatchPlanner(lengths, config, seed=seed)
        plan = planner.plan(e)
        times.append(time.perf_counter() - t0)

    planner = BatchPlanner(lengths, config, seed=seed)
    plans = [planner.plan(e) for e in range(epochs)]
    per_epoch = []
    max_batch_tokens = 0
    for plan in plans:
        real = int(plan.lengths[plan.order].sum())
        sizes = np.diff(plan.offsets)
        padded = int((plan.padded_lens * sizes).sum())
        max_batch_tokens = max(max_batch_tokens, int((plan.padded_lens * sizes).max()))
        per_epoch.append(_figures(plan.buckets, real, padded))
    plan0 = plans[0]
    sizes0 = np.diff(plan0.offsets)

    # Baseline 1: uniform shuffle, fixed batch size.
    rng = epoch_rng(seed, 0, 0xBA5E1)
    fixed_bs = random_batch_size
    perm = rng.permutation(lengths.size)
    n_full = lengths.size // fixed_bs * fixed_bs
    groups = lengths[perm[:n_full]].reshape(-1, fixed_bs)
    rest = lengths[perm[n_full:]]
    real_rf = int(lengths.sum())
    padded_rf = int(groups.max(axis=1).sum()) * fixed_bs + (int(rest.max()) * rest.size if rest.size else 0)
    longest = np.concatenate([groups.max(axis=1), rest.max(keepdims=True) if rest.size else []]).astype(
        np.int64
    )
    rf_buckets = assign_buckets(longest, planner.boundaries)
    random_fixed = _figures(rf_buckets, real_rf, padded_rf)
    random_fixed["batch_size"] = fixed_bs

    # Baseline 2: the same bucket batches, uniformly shuffled.
    shuffled = plan0.buckets[epoch_rng(seed, 0, 0xBA5E2).permutation(len(plan0))]
    real0 = int(plan0.lengths[plan0.order].sum())
    padded0 = int((plan0.padded_lens * sizes0).sum())
    bucket_shuffle = _figures(shuffled, real0, padded0)

    # Multi-rank: each rank's strided share of the one global order, and of the rank-aware order.
    world = 8
    rank_runs = [max_same_bucket_run(plan0.buckets[plan0.rank_positions(r, world)]) for r in range(world)]
    ranked = planner.plan(0, world_size=world)
    ranked_shares = [ranked.buckets[ranked.rank_positions(r, world)] for r in range(world)]
    ranked_runs = [max_same_bucket_run(b) for b in ranked_shares]
    ranked_window = max(window_mix_max_deviation(b, WINDOW) for b in ranked_shares)
    counts = np.bincount(plan0.buckets, minlength=plan0.num_buckets)

    return {
        "input": {
            "lengths_file": str(
                lengths_path.relative_to(ROOT) if lengths_path.is_relative_to(ROOT) else lengths_path
            ),
            "samples": int(lengths.size),
            "length_mean": round(float(lengths.mean()), 1),
            "length_max": int(lengths.max()),
        },
        "config": {
            "max_tokens": max_tokens,
            "num_buckets": num_buckets,
            "max_run": max_run,
            "length_jitter": config.length_jitter,
            "evenness": config.evenness,
            "repeat_penalty": config.repeat_penalty,
            "seed": seed,
            "window": WINDOW,
        },
        "plan": {
            **per_epoch[0],
            "per_epoch": per_epoch,
            "boundaries": plan0.boundaries.tolist(),
            "bucket_batch_share": [round(float(c) / len(plan0), 4) for c in counts],
            "largest_bucket_share": round(float(counts.max()) / len(plan0), 4),
            "run_cap_feasible": plan0.run_cap_feasible,
            "max_batch_padded_tokens": max_batch_tokens,
            "budget_exceeded": max_batch_tokens > max_tokens,
            "batch_size_mean": round(float(sizes0.mean()), 2),
            "batch_size_max": int(sizes0.max()),
            "same_batch_pair_retention_epoch0_to_1": round(
                _pair_retention(plans[0], plans[1], lengths.size), 4
            )
            if epochs > 1
            else None,
            "build_seconds_median": round(statistics.median(times), 4),
            "build_seconds_max": round(max(times), 4),
            "world8_global_order_rank_max_run": max(rank_runs),
            "world8_rank_aware_order_rank_max_run": max(ranked_runs),
            "world8_rank_aware_order_rank_window_mix_max_deviation": round(ranked_window, 4),
        },
        "baselines": {"random_fixed": random_fixed, "bucket_shuffle": bucket_shuffle},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=Path, default=ROOT / "bench/data/lengths-chat-100k.txt")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/batching.json")
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--max-tokens", type=int, default=65536)
    ap.add_argument("--num-buckets", type=int, default=6)
    ap.add_argument("--max-run", type=int, default=3)
    ap.add_argument("--random-batch-size", type=int, default=16)
    args = ap.parse_args(argv)
    result = run(
        args.lengths,
        args.epochs,
        args.seed,
        args.max_tokens,
        args.num_buckets,
        args.max_run,
        args.random_batch_size,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, indent=2)
    args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
