"""In-process regeneration (issue 39.1): replies/s of the batched decoder against today's one reply at a time.

The same conversations (the embedded corpus's training prompts, every fourth a conversation of two user turns
whose made-up reply is regenerated first), the shipped target, the same thread count, in one command:

* ``single``: today's one-at-a-time path, ``regenerate --batch-size 1`` of the package as of ``--baseline``
  (transformers ``generate`` on one prompt; ``common.load_package``);
* ``batched_<B>``: this tree's ``regenerate --batch-size B`` (``model.slot_decoder.SlotDecoder``: B replies decode
  together, a finished reply's slot takes the next at once);
* ``one_at_a_time``: this tree's ``--batch-size 1`` (once): what ``same_replies`` compares the batched files with.

Trials alternate (single, then every B, then again) and each figure is the median of its trials; the load average
is recorded before and after. ``batched_over_single`` is the default batch size's replies/s over ``single``'s.
``same_replies``: every batched file equals the one-at-a-time file byte for byte; ``agree_with_today``: how many
records are equal to today's (a reply may differ from ``generate``'s at a near tie: other kernels).

Usage: python bench/regen_bench.py [--n 32] [--max-new-tokens 256] [--sizes 4,8,16,32] [--trials 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import common

DEFAULT_BATCH = 16  # the CLI's --batch-size default (dflash_flow/cli.py), chosen by this benchmark


def _records(n: int) -> list[dict]:
    from dflash_flow.embedded.corpus import make_split

    train, _ = make_split(n + n // 4 + 1, 0, seed=1)
    extra = iter(train[n:])
    recs = []
    for i, ex in enumerate(train[:n]):
        conv = ex.conversations()
        if i % 4 == 3:  # two user turns: the made-up first reply is regenerated, then the second
            conv = conv + [{"role": "user", "content": next(extra).prompt}]
        recs.append({"id": i, "conversations": conv})
    return recs


def main(argv: list[str] | None = None) -> int:
    import subprocess

    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=32, help="conversations")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--sizes", default="4,8,16,32", help="batch sizes measured")
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--baseline", default="8aff533", help="git revision of today's one-at-a-time path")
    p.add_argument("--out", default=str(common.RESULTS / "regen.json"))
    args = p.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    load_start = [round(x, 2) for x in os.getloadavg()]
    t_start = time.perf_counter()
    rev = subprocess.run(["git", "rev-parse", args.baseline], cwd=common.ROOT, check=True, capture_output=True,
                         text=True).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix="regen-bench-"))
    before = common.load_package(rev, scratch / "pkg")
    old = __import__(f"{before}.embedded.regenerate", fromlist=["regenerate"])

    from dflash_flow.embedded.regenerate import regenerate
    from dflash_flow.embedded.train_target import ASSET_DIR, load_model_and_tokenizer

    torch.set_num_threads(args.threads)
    model, tok = load_model_and_tokenizer(ASSET_DIR)
    src = scratch / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in _records(args.n)))

    def run(fn, name: str, bs: int) -> dict:
        out = scratch / f"{name}.jsonl"
        t = time.perf_counter()
        st = fn(src, None, out, batch_size=bs, max_new_tokens=args.max_new_tokens, resume=False, model=model,
                tokenizer=tok)
        dt = time.perf_counter() - t
        print(f"{name}: {st.replies} replies, {st.new_tokens} tokens in {dt:.1f} s "
              f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr, flush=True)
        return {"s": dt, "replies": st.replies, "tokens": st.new_tokens, "file": out.read_bytes()}

    trials: dict[str, list[dict]] = {"single": [], **{f"batched_{b}": [] for b in sizes}}
    for _ in range(args.trials):
        trials["single"].append(run(old.regenerate, "single", 1))
        for b in sizes:
            trials[f"batched_{b}"].append(run(regenerate, f"batched_{b}", b))
    alone = run(regenerate, "one_at_a_time", 1)

    def figure(rs: list[dict]) -> dict:
        s = statistics.median(r["s"] for r in rs)
        return {"seconds": [round(r["s"], 2) for r in rs], "median_s": round(s, 2), "replies": rs[0]["replies"],
                "tokens": rs[0]["tokens"], "replies_per_s": round(rs[0]["replies"] / s, 3),
                "tokens_per_s": round(rs[0]["tokens"] / s, 1)}

    figs = {k: figure(v) for k, v in trials.items()}
    figs["one_at_a_time"] = figure([alone])
    single = figs["single"]["replies_per_s"]
    for b in sizes:
        figs[f"batched_{b}"]["over_single"] = round(figs[f"batched_{b}"]["replies_per_s"] / single, 2)
    figs["one_at_a_time"]["over_single"] = round(figs["one_at_a_time"]["replies_per_s"] / single, 2)
    same = all(r["file"] == alone["file"] for b in sizes for r in trials[f"batched_{b}"])
    today = [json.loads(x) for x in trials["single"][0]["file"].decode().splitlines()]
    ours = [json.loads(x) for x in alone["file"].decode().splitlines()]
    agree = sum(a["conversations"] == b["conversations"] for a, b in zip(today, ours, strict=True))
    default = DEFAULT_BATCH if DEFAULT_BATCH in sizes else max(sizes, key=lambda b: figs[f"batched_{b}"]["replies_per_s"])
    result = {
        "batched_over_single": figs[f"batched_{default}"]["over_single"],
        "same_replies": same,
        "default_batch_size": default,
        "best_batch_size": max(sizes, key=lambda b: figs[f"batched_{b}"]["replies_per_s"]),
        "agree_with_today": f"{agree}/{len(ours)}",
        "figures": figs,
        "conversations": args.n,
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "trials": args.trials,
        "baseline_rev": rev,
        "target": "embedded (shipped, 8 layers, hidden 128, fp32)",
        "machine": {**common.machine(), "load_avg_at_start": load_start,
                    "load_avg_at_end": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(time.perf_counter() - t_start, 1),
        "command": "python bench/regen_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    common.write_result(Path(args.out), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
