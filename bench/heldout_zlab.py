"""An exported drafter of the embedded target, decoded by z-lab's own ``dflash_generate`` (the reference
decoder, installed from requirements/reference.txt) on held-out prompts the project never evaluates on:
fresh draws of the embedded corpus (another seed) on its held-out side, minus every prompt the shipped
dataset holds. Greedy, batch size 1; each output is checked against plain greedy decoding (lossless).

    python bench/heldout_zlab.py runs/dflash-cpu/drafter            # 32 prompts, 64 new tokens
    python bench/heldout_zlab.py DRAFTER --n 48 --seed 11 --max-new-tokens 256
    python bench/heldout_zlab.py --train [--set KEY=VALUE ...]      # trains the default first (no tracking)

Prints and writes (``--out``, default bench/results/heldout_zlab.json) z-lab's figure, the mean over
prompts of each one's mean acceptance length (``dflash.benchmark``'s "Average Acceptance length"), beside
the pooled tokens per step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def fresh_prompts(n: int, seed: int) -> list[dict]:
    """``n`` held-out-side prompts of the embedded corpus drawn with ``seed``, none in the shipped dataset."""
    from dflash_flow.embedded.corpus import make_split

    shipped = set()
    dataset = REPO / "dflash_flow" / "embedded" / "assets" / "dataset"
    for name in ("eval_prompts.jsonl", "train_prompts.jsonl"):
        for line in (dataset / name).read_text(encoding="utf-8").splitlines():
            shipped.update(t["content"] for t in json.loads(line)["conversations"] if t["role"] == "user")
    _, evals = make_split(0, n + len(shipped) // 8 + 64, seed=seed)
    out = [ex for ex in evals if ex.prompt not in shipped][:n]
    if len(out) < n:
        raise SystemExit(f"only {len(out)} fresh held-out prompts with seed {seed}; pass a smaller --n")
    return [{"family": ex.family, "conversations": ex.conversations(with_answer=False)} for ex in out]


def train_default(sets: list[str]) -> tuple[Path, dict]:
    """``dflash-flow run pipelines/dflash.yaml`` (no tracking, ``sets`` applied) into a fresh directory: its
    drafter and what the run printed of itself (wall seconds, its own acceptance)."""
    import os
    import subprocess
    import tempfile

    sys.path.insert(0, str(REPO / "bench"))
    import common

    out = Path(tempfile.mkdtemp(prefix="heldout-zlab-"))
    cmd = [sys.executable, "-m", "dflash_flow", "run", str(common.DFLASH_YAML)]
    for o in common.embedded_overrides(out, *sets):
        cmd += ["--set", o]
    load = [round(x, 2) for x in os.getloadavg()]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"training the default failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    wall = time.perf_counter() - t0
    evals = json.loads((out / "monitor" / "summary.json").read_text(encoding="utf-8")).get("eval", {})
    own = {k: {"tau": round(v["metrics"]["tau"], 3), "lossless": v.get("lossless")} for k, v in evals.items()}
    return out / "drafter", {"wall_s": round(wall, 1), "sets": sets, "load_before": load, "its_own_eval": own}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("drafter", type=Path, nargs="?", help="an exported drafter directory (a run's output_dir/drafter)")
    ap.add_argument("--train", action="store_true", help="train pipelines/dflash.yaml first and use its drafter")
    ap.add_argument("--set", action="append", default=[], help="with --train: an override of the default")
    ap.add_argument("--n", type=int, default=32, help="prompts")
    ap.add_argument("--seed", type=int, default=7, help="the corpus draw (the shipped dataset is seed 0)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "heldout_zlab.json")
    args = ap.parse_args(argv)
    trained = None
    if args.train:
        args.drafter, trained = train_default(args.set)
    elif args.drafter is None:
        ap.error("give a DRAFTER directory or --train")

    import dflash.model as zlab
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_flow.app.model_spec import resolve_target
    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.data.suites import template_ids

    if not torch.cuda.is_available():
        zlab._cuda_time = time.perf_counter  # its stats clock synchronises CUDA (as the tests do on CPU)
    torch.set_num_threads(1)
    target_dir = resolve_target("embedded")
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    config = json.loads((args.drafter / "config.json").read_text(encoding="utf-8"))
    cls = DFlash2DraftModel if "DFlash2" in " ".join(config.get("architectures", [])) else DFlashDraftModel
    drafter = cls.from_pretrained(args.drafter, dtype=torch.float32).eval()
    stops = stop_token_ids(tok)
    per_prompt, pooled, lossless = [], [], 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p in fresh_prompts(args.n, args.seed):
            ids = torch.tensor([template_ids(tok, p["conversations"], enable_thinking=False)])
            got = dflash_generate(drafter, target, ids, args.max_new_tokens, stops, return_stats=True)
            ref = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=stops,
                                  pad_token_id=stops[0])
            n = min(got.output_ids.shape[1], ref.shape[1])
            lossless += int(torch.equal(got.output_ids[0, ids.shape[1]:n], ref[0, ids.shape[1]:n]))
            per_prompt.append(statistics.mean(got.acceptance_lengths))
            pooled.extend(got.acceptance_lengths)
    result = {
        "drafter": str(args.drafter), "decoder": "dflash.model.dflash_generate (z-lab), greedy, batch size 1",
        "prompts": args.n, "seed": args.seed, "max_new_tokens": args.max_new_tokens,
        "acceptance_length": round(statistics.mean(per_prompt), 3),
        "tokens_per_step_pooled": round(statistics.mean(pooled), 3),
        "lossless": f"{lossless}/{args.n}", "seconds": round(time.perf_counter() - t0, 1),
    }
    if trained is not None:
        result["trained"] = trained
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=1))
    return 0 if lossless == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
