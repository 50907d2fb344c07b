"""DFlash 2 training step cost against plain DFlash, on the embedded CPU default's shapes.

One forward + backward of ``objective.dflash_loss`` (the trainer's chunking defaults, no optimizer) for a
plain DFlash drafter and a DFlash 2 drafter of the embedded default (``selector_rank`` 32, top-k 16, 2
layers, block 8, 64 anchors, gamma 4) on the embedded target's shape (vocab 768, hidden 128, 4 heads /
2 KV heads, head_dim 32), batches of ragged rows (``peer_step.build_case``): 4 x 256 and 8 x 128.
The DFlash 2 drafter's convolutions and selector are randomised (a trained drafter's work,
not the identity it starts as); the plain drafter shares its DFlash weights.

    python bench/dflash2_step.py                          # 1 and 2 threads, both shapes
    python bench/dflash2_step.py --threads 1 --rounds 20
    python bench/dflash2_step.py --baseline 53de2ef       # also the package at a git revision ("before")

Each round draws fresh anchors (seeded by the round) and runs every implementation once, in alternating
order, in this one process; figures are medians over the rounds after two warm-up rounds, and the ratios
(``x dflash``: DFlash 2 over plain DFlash of the same package; ``extra``: DFlash 2's extra cost over plain
DFlash, after over before) are ratios of medians measured in this one command. ``--baseline`` copies the
package at that revision under another name (``dflash_flow_before``) and prints the largest relative
difference of the two packages' losses on the same anchors (fp32 rounding: ~1e-7). Absolute milliseconds depend on the machine and its load: compare
the ratios.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import peer_step as ps  # noqa: E402
from common import load_package  # noqa: E402

CASES = {
    "embedded_4x256": dict(target=ps.EMBEDDED_TARGET, batch=4, seq_len=256, ragged=True),
    "embedded_8x128": dict(target=ps.EMBEDDED_TARGET, batch=8, seq_len=128, ragged=True),
}
DFLASH2 = dict(variant="dflash2", selector_rank=32)


def make_step(c: dict, package: str, variant: dict, seed: int = 0):
    """``(model, step(anchors) -> loss)`` of ``package``'s drafter of ``variant`` (forward + backward)."""
    dflash2 = importlib.import_module(f"{package}.model.dflash2")
    objective = importlib.import_module(f"{package}.model.objective")
    defaults = importlib.import_module(f"{package}.model.trainer").TrainerConfig()
    cfg = dflash2.make_variant_config(
        ps.target_config(c["target"]), num_layers=ps.DRAFT["num_layers"], block_size=ps.DRAFT["block_size"],
        mask_token_id=c["mask_id"], **variant,
    )
    cfg._attn_implementation = "sdpa"
    model = dflash2.drafter_from_config(cfg)
    model.load_state_dict(c["state"], strict=False)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a trained DFlash 2 drafter: convolutions and selector away from their start
        for name, p in model.named_parameters():
            if name not in c["state"]:
                p.copy_(0.1 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("base_kernel") else 0.0))
    model.train()

    def step(anchors):
        out = objective.dflash_loss(
            model, embed_tokens=c["embed"], lm_head=c["head"], input_ids=c["input_ids"], loss_mask=c["loss_mask"],
            hidden_states=c["hidden_states"], attention_mask=c["attention_mask"], num_anchors=ps.DRAFT["num_anchors"],
            gamma=ps.DRAFT["gamma"], anchors=anchors, chunk_blocks=defaults.chunk_blocks,
            activation_budget_mb=defaults.activation_budget_mb,
        )
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        return out.loss.item()

    return model, step


def run_case(case: dict, threads: int, rounds: int, packages: list[str]) -> dict[str, float]:
    torch.set_num_threads(threads)
    c = ps.build_case(case)
    c["target"] = case["target"]
    steps = {}
    for pkg in packages:
        tag = "" if pkg == "dflash_flow" else "_before"
        steps["dflash" + tag] = make_step(c, pkg, dict(variant="dflash"))[1]
        steps["dflash2" + tag] = make_step(c, pkg, DFLASH2)[1]
    times = {n: [] for n in steps}
    diffs: dict[str, float] = {}
    for r in range(rounds + 2):
        anchors = ps.draw_anchors(c, r)
        names = list(steps) if r % 2 else list(steps)[::-1]
        losses = {}
        for n in names:
            t = time.perf_counter()
            losses[n] = steps[n](anchors)
            if r >= 2:
                times[n].append(time.perf_counter() - t)
        for n in ("dflash", "dflash2"):
            if n + "_before" in losses:
                diffs[n] = max(diffs.get(n, 0.0), abs(losses[n] / losses[n + "_before"] - 1))
    if diffs:
        print("  largest relative loss difference, after vs before: "
              + ", ".join(f"{n} {d:.1e}" for n, d in diffs.items()))
    return {n: statistics.median(v) * 1000 for n, v in times.items()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated torch intra-op thread counts")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--baseline", help="also time the package at this git revision")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        packages = ["dflash_flow"] + ([load_package(args.baseline, Path(tmp))] if args.baseline else [])
        for name in args.cases.split(","):
            for threads in (int(t) for t in args.threads.split(",")):
                ms = run_case(CASES[name], threads, args.rounds, packages)
                line = f"{name} {threads} thread(s): " + ", ".join(f"{n} {v:.1f} ms" for n, v in ms.items())
                line += f"; dflash2 x dflash {ms['dflash2'] / ms['dflash']:.2f}"
                if args.baseline:
                    line += f" (before x{ms['dflash2_before'] / ms['dflash_before']:.2f})"
                    extra = (ms["dflash2"] - ms["dflash"]) / (ms["dflash2_before"] - ms["dflash_before"])
                    line += f"; extra cost after/before {extra:.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
