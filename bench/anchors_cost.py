"""What ``num_anchors`` costs: the embedded default's DFlash 2 step at several anchor counts per row.

One forward + backward of ``objective.dflash_loss`` (no optimizer) of the default's drafter (DFlash 2,
``selector_rank`` 32, 2 layers, block 8, gamma 4: ``dflash2_step.make_step``) on the batch shapes its
1,024-token budget makes (2 x 512, 4 x 256, 8 x 128 ragged rows of the embedded target's shape), one
intra-op thread (the default's setting). Every anchor count runs once per round, in alternating order, in
this one process, with anchors drawn by the objective's own sampler; figures are medians over the rounds
after two warm-up rounds, and ``x64`` is each median over the median at 64 anchors (the default before
issue 25's recipe change) of the same shape. What the anchor counts buy in acceptance is measured by
whole runs (docs/benchmarks.md, the embedded default's recipe table), not here.

    python bench/anchors_cost.py                      # anchors 64, 48, 40, 32; ~1 min on 2 cores
    python bench/anchors_cost.py --anchors 64,32 --rounds 20

Writes ``bench/results/anchors_cost.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import common  # noqa: E402
import dflash2_step as d2  # noqa: E402
import peer_step as ps  # noqa: E402

SHAPES = {"2x512": (2, 512), "4x256": (4, 256), "8x128": (8, 128)}


def run_shape(batch: int, seq_len: int, anchors: list[int], rounds: int) -> dict[int, float]:
    case = dict(target=ps.EMBEDDED_TARGET, batch=batch, seq_len=seq_len, ragged=True)
    c = ps.build_case(case)
    c["target"] = case["target"]
    step = d2.make_step(c, "dflash_flow", d2.DFLASH2)[1]
    times: dict[int, list[float]] = {n: [] for n in anchors}
    for r in range(rounds + 2):
        torch.manual_seed(r)  # the objective draws the anchors: the same draws per round and count
        for n in anchors if r % 2 else anchors[::-1]:
            ps.DRAFT["num_anchors"] = n  # make_step reads it at each call
            t = time.perf_counter()
            step(None)
            if r >= 2:
                times[n].append(time.perf_counter() - t)
    return {n: statistics.median(v) * 1000 for n, v in times.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--anchors", default="64,48,40,32", help="comma-separated anchor counts per row")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", default=str(common.RESULTS / "anchors_cost.json"))
    args = parser.parse_args(argv)
    anchors = [int(a) for a in args.anchors.split(",")]
    torch.set_num_threads(1)
    shapes = {}
    for name, (batch, seq_len) in SHAPES.items():
        ms = run_shape(batch, seq_len, anchors, args.rounds)
        base = ms.get(64)
        shapes[name] = {str(n): {"ms": round(v, 2), "x64": round(v / base, 3) if base else None} for n, v in ms.items()}
        print(f"{name}: " + ", ".join(f"{n} anchors {v:.1f} ms" + (f" (x{v / base:.2f})" if base else "")
                                     for n, v in ms.items()), flush=True)
    return common.write_result(Path(args.out), {
        "bench": "anchors_cost",
        "machine": common.machine(),
        "threads": 1,
        "rounds": args.rounds,
        "drafter": {**d2.DFLASH2, "num_layers": ps.DRAFT["num_layers"], "block_size": ps.DRAFT["block_size"]},
        "shapes": shapes,
        "note": "median ms per forward+backward step at each anchor count per row, one thread, all counts "
                "alternated in one process; x64: over the median at 64 anchors of the same shape",
    })


if __name__ == "__main__":
    main()
