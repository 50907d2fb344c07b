"""torchdata.nodes benchmark: our pipeline against the same bucketing, padding and fan-out built from
torchdata.nodes (torchdata 0.11), on the same batches.

Writes bench/results/torchdata.json (also printed). Installs the package's ``torchdata`` extra when it
is missing (``bench/peers.py``), or exits 2 naming the command that would.

The work: ``--samples`` synthetic tokenized samples (lengths from bench/data/lengths-chat-100k.txt),
planned into length-bucketed batches under a padded-token budget (our ``BatchPlanner`` + ``order_packed``:
torchdata has no token-budget bucketing, so both sides use the same plan functions), right-padded into
tensors (``data.plan.pad_batch``) by 2 workers, a TargetForward stand-in with 3 workers sleeping in
proportion to the padded tokens (GIL-free, like a GPU kernel), and an in-order trainer stand-in sleeping
in proportion to the real tokens.

* ours: ``Bucketer -> Interleaver -> Padder x2 -> Target x3 -> Trainer (ordered)`` on the runtime;
* theirs: ``IterableWrapper(planned batches) -> ParallelMapper(pad, 2 threads) -> ParallelMapper(target,
  3 threads, in_order) -> Prefetcher -> Loader``, the trainer stand-in in the consuming loop.

Both are timed the same way: batches/s from the start of the trainer's batch ``WARMUP`` to the start of
its last one. ``bound``: the analytic limit ``1 / max(mean target cost / 3, mean trainer cost)``.

Both sides' batches are compared (sample ids and padded input_ids of every batch, in order) and must be
equal. Runs alternate, ``--reps`` pairs; the figure is the median ratio of batches/s (ours / theirs).

Usage: python bench/torchdata_bench.py [--out FILE] [--samples 4000] [--reps 3] [--unit-ms 20]
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import attrs
import common
import numpy as np

from dflash_flow.core import Stage, cfg, register_stage
from dflash_flow.items import PaddedBatch, Sample

MAX_TOKENS = 8192
NUM_BUCKETS = 4
MAX_RUN = 3
PADDERS = 2
TARGETS = 3
CAPACITY = 4
TRAIN_SHARE = 0.6  # trainer cost / (target cost / TARGETS), on average
SEED = 7
WARMUP = 5
# Like ParallelMapper's workers, which take the next item when free: the shortest queue gets it.
POLICY = "least_loaded"
TARGET_CAPACITY = 1  # and nothing queued behind a busy one: a free replica takes the next batch
BUCKETER = "bucketer"  # the Bucketer derives its plan seed from its stage name


def samples(n: int) -> list[Sample]:
    lengths = np.loadtxt(common.ROOT / "bench" / "data" / "lengths-chat-100k.txt", dtype=np.int64)[:n]
    lengths = np.minimum(lengths, MAX_TOKENS)
    rng = np.random.default_rng(SEED)
    out = []
    for i, n_tok in enumerate(lengths.tolist()):
        ids = rng.integers(3, 30000, size=n_tok, dtype=np.int64)
        mask = np.ones(n_tok, dtype=np.int64)
        out.append(Sample(sample_id=i, input_ids=ids, loss_mask=mask))
    return out


@attrs.frozen
class Costs:
    unit_s: float  # target seconds for a batch of MAX_TOKENS padded tokens
    train_s_per_token: float

    def target(self, batch: PaddedBatch) -> float:
        return self.unit_s * batch.input_ids.numel() / MAX_TOKENS

    def train(self, batch: PaddedBatch) -> float:
        return self.train_s_per_token * batch.meta.real_tokens


def fingerprint(batch: PaddedBatch) -> tuple:
    return tuple(batch.meta.sample_ids), hashlib.sha256(batch.input_ids.numpy().tobytes()).hexdigest()[:16]


# -- ours ------------------------------------------------------------------------------------------
@register_stage("TdSampleSource")
@attrs.define(kw_only=True, eq=False)
class TdSampleSource(common.ItemsSource):
    output_type = Sample


@register_stage("TdTarget")
@attrs.define(kw_only=True, eq=False)
class TdTarget(Stage):
    input_type = PaddedBatch
    output_type = PaddedBatch
    unit_s: float = cfg(0.02, ge=0)

    def process(self, batch):
        time.sleep(self.unit_s * batch.input_ids.numel() / MAX_TOKENS)
        return (batch,)


@register_stage("TdTrainer")
@attrs.define(kw_only=True, eq=False)
class TdTrainer(Stage):
    input_type = PaddedBatch
    output_type = None
    train_s_per_token: float = cfg(0.0, ge=0)
    seen: list = attrs.field(factory=list, metadata={"config": False})

    @classmethod
    def config_fields(cls):
        return [f for f in super().config_fields() if f.name not in ("seen", "starts")]

    starts: list = attrs.field(factory=list, metadata={"config": False})

    def process(self, batch):
        self.starts.append(time.perf_counter())
        time.sleep(self.train_s_per_token * batch.meta.real_tokens)
        self.seen.append(fingerprint(batch))
        return None


def steady_rate(starts: list[float]) -> float:
    """Batches per second from the start of batch WARMUP to the start of the last one (both sides)."""
    return (len(starts) - 1 - WARMUP) / (starts[-1] - starts[WARMUP])


def ours(data: list[Sample], costs: Costs, tag: str) -> tuple[float, list[tuple]]:
    from dflash_flow.core import Graph, Pipeline, RuntimeOptions
    from dflash_flow.stages.bucketer import Bucketer
    from dflash_flow.stages.interleaver import Interleaver
    from dflash_flow.stages.padder import Padder

    src = TdSampleSource()
    src.items = data
    trainer = TdTrainer(train_s_per_token=costs.train_s_per_token)
    g = Graph(name=f"td-ours-{tag}", seed=SEED, output_dir=str(common.SCRATCH / "torchdata"),
              runtime=RuntimeOptions(capacity=CAPACITY))
    g.add("source", src)
    g.add(BUCKETER, Bucketer(max_tokens=MAX_TOKENS, num_buckets=NUM_BUCKETS, epochs=1), inputs="source")
    g.add("interleaver", Interleaver(max_run=MAX_RUN), inputs=BUCKETER)
    g.add("padder", Padder(pin_memory=False), inputs="interleaver", replicas=PADDERS)
    g.add("target", TdTarget(unit_s=costs.unit_s), inputs="padder", replicas=TARGETS, policy=POLICY,
          capacity=TARGET_CAPACITY)
    g.add("trainer", trainer, inputs="target", ordered=True)
    Pipeline(g).run()
    return steady_rate(trainer.starts), trainer.seen


# -- theirs ----------------------------------------------------------------------------------------
def planned_batches(data: list[Sample]):
    """The epoch's planned batches exactly as Bucketer + Interleaver make them (same config and seed)."""
    from dflash_flow.core import derive_seed
    from dflash_flow.data.epoch import order_packed
    from dflash_flow.data.packing import PlanConfig
    from dflash_flow.data.plan import BatchPlanner
    from dflash_flow.items import PlannedBatch

    lengths = np.array([len(s) for s in data], dtype=np.int64)
    ids = np.array([s.sample_id for s in data], dtype=np.int64)
    planner = BatchPlanner(lengths, PlanConfig(max_tokens=MAX_TOKENS, num_buckets=NUM_BUCKETS), seed=derive_seed(SEED, 0, 0, BUCKETER),
                           sample_ids=ids)
    plan = order_packed(planner.pack(0), max_run=MAX_RUN)
    for pos in range(len(plan)):
        yield PlannedBatch(meta=plan.meta(pos), samples=[data[i] for i in plan.batch(pos).tolist()])


def theirs(data: list[Sample], costs: Costs) -> tuple[float, list[tuple]]:
    import torchdata.nodes as tn

    from dflash_flow.data.plan import pad_batch

    def target(batch: PaddedBatch) -> PaddedBatch:
        time.sleep(costs.target(batch))
        return batch

    node = tn.IterableWrapper(planned_batches(data))
    node = tn.ParallelMapper(node, lambda b: pad_batch(b, pin_memory=False), num_workers=PADDERS, in_order=True, method="thread")
    node = tn.ParallelMapper(node, target, num_workers=TARGETS, in_order=True, method="thread")
    node = tn.Prefetcher(node, prefetch_factor=CAPACITY)
    starts, seen = [], []
    for batch in tn.Loader(node, restart_on_stop_iteration=False):
        starts.append(time.perf_counter())
        time.sleep(costs.train(batch))
        seen.append(fingerprint(batch))
    return steady_rate(starts), seen


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=common.RESULTS / "torchdata.json")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--unit-ms", type=float, default=20.0, help="Target seconds for a full batch (MAX_TOKENS padded).")
    args = ap.parse_args(argv)
    import peers

    try:
        peers.ensure_torchdata()  # the package's torchdata extra, installed when missing
    except peers.Missing as exc:
        print(f"torchdata_bench: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    import torchdata

    data = samples(args.samples)
    batches = list(planned_batches(data))
    real = np.array([b.meta.real_tokens for b in batches], dtype=np.float64)
    unit = args.unit_ms / 1000
    mean_target = unit * np.mean([b.meta.padded_tokens for b in batches]) / MAX_TOKENS
    costs = Costs(unit_s=unit, train_s_per_token=TRAIN_SHARE * mean_target / TARGETS / real.mean())
    bound = 1 / max(mean_target / TARGETS, costs.train_s_per_token * real.mean())
    rows = []
    for rep in range(args.reps):
        mine, mine_seen = ours(data, costs, str(rep))
        other, other_seen = theirs(data, costs)
        if mine_seen != other_seen:
            raise AssertionError("the two pipelines trained different batches")
        rows.append({"ours_batches_per_s": round(mine, 3), "torchdata_batches_per_s": round(other, 3), "ratio": round(mine / other, 4)})
    result = {
        "machine": common.machine(),
        "torchdata": torchdata.__version__,
        "batches": len(batches),
        "same_batches": True,
        "config": {"padders": PADDERS, "targets": TARGETS, "capacity": CAPACITY, "unit_ms": args.unit_ms,
                   "max_tokens": MAX_TOKENS, "samples": args.samples},
        "bound_batches_per_s": round(bound, 2),
        "ours_over_torchdata": statistics.median(r["ratio"] for r in rows),
        "ours_over_bound": round(statistics.median(r["ours_batches_per_s"] for r in rows) / bound, 4),
        "torchdata_over_bound": round(statistics.median(r["torchdata_batches_per_s"] for r in rows) / bound, 4),
        "rows": rows,
    }
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
