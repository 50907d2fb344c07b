"""Data at scale: the reader against the tokenizer's own batch encode, ranks on one cold cache, warm start,
resident memory per token, the plan for a large corpus; optionally the `datasets` path and the whole
pipeline over a million conversations (2 ranks, SIGKILL + resume).

    python bench/data_scale_bench.py --lengths bench/data/lengths-chat-100k.txt --n 20000 \\
        --out bench/results/data_scale.json [--compare-datasets] [--pipeline 1000000]

The corpus: ``n`` synthetic chat conversations whose token lengths (embedded tokenizer) follow the
lengths file, text cut from the embedded corpus (user ~1/4, assistant the rest). Figures:

* ``reader_over_raw``: records per second of the cold reader (one process as a rank would run it: JSON,
  chat template, loss mask, store writes, on every core) over those of ``tokenizer(texts,
  return_offsets_mapping=True)`` on the same rendered texts (rayon on every core), measured in this command
  (raw before and after the reader; their mean).
* ``cold_2ranks_over_1rank``: CPU seconds (processes and their workers) of two "ranks" started together on
  one empty cache / one rank alone; plus both wall times.
* ``warm_start_s``: a fresh process mapping the warm entry and building the source's table; ``plan_s``:
  the epoch plan over every sample (pack + order for 2 ranks).
* ``resident_data_bytes_per_token``: the growth of the process's private resident memory (RssAnon)
  over the warm start, per corpus token (file-backed pages are the page cache's: one copy per node).
* peak RSS per rank (``ru_maxrss`` of the rank and of its workers).

``--pipeline N`` (item 7 of issue 21, not part of `just bench`): N conversations pre-tokenized once into
the store (warm cache), the tiny target, 2 ranks under torchrun, 100 steps; a reference run, then a run
SIGKILLed mid-way and resumed: time to the first step, RSS per rank, and whether every batch was trained
exactly once (``bench/data_scale_pipeline.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common
import numpy as np

SEED = 0
MAX_LENGTH = 8192  # no truncation: both sides tokenize whole texts


def rss() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(common.ROOT / "dflash_flow" / "embedded" / "assets" / "target"))


def make_corpus(path: Path, lengths: np.ndarray, n: int, tok) -> dict:
    """``n`` conversations whose token lengths follow ``lengths`` (cycled); written once, reused."""
    meta = path.with_suffix(".json")
    if path.exists() and meta.exists():
        return json.loads(meta.read_text())
    from dflash_flow.embedded.corpus import make_split

    train, _ = make_split(4000, 0, seed=SEED)
    pool = "\n".join(ex.prompt + "\n" + ex.answer for ex in train)
    sample = pool[:200_000]
    cpt = len(sample) / len(tok(sample, add_special_tokens=False)["input_ids"])
    rng = np.random.default_rng(SEED)
    pool2 = pool * 4
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as f:
        for i in range(n):
            nch = max(32, int(int(lengths[i % lengths.size]) * cpt))
            u = max(8, nch // 4)
            a = max(8, nch - u)
            s = int(rng.integers(0, len(pool2) - u - a - 1))
            f.write(json.dumps({"conversations": [{"role": "user", "content": pool2[s : s + u]},
                                                  {"role": "assistant", "content": pool2[s + u : s + u + a]}]}) + "\n")
    tmp.rename(path)
    info = {"conversations": n, "chars_per_token": cpt, "bytes": path.stat().st_size}
    meta.write_text(json.dumps(info))
    return info


def rendered(path: Path, tok) -> list[str]:
    from dflash_flow.data.chat import parse_conversation, render_chat

    texts = []
    for line in path.open("rb"):
        try:  # a corpus of your own may hold bad records: the reader skips them, and so does the baseline
            msgs = parse_conversation(json.loads(line))[0]
            if msgs is not None:
                texts.append(render_chat(tok, msgs))
        except Exception:  # noqa: BLE001
            continue
    return texts


def raw_encode_s(tok, texts: list[str]) -> tuple[float, int]:
    t = time.perf_counter()
    n = 0
    for i in range(0, len(texts), 512):
        enc = tok(texts[i : i + 512], add_special_tokens=False, return_offsets_mapping=True)
        n += sum(len(x) for x in enc["input_ids"])
    return time.perf_counter() - t, n


# -- one "rank" (a subprocess) ---------------------------------------------------------------------

def rank_main(args) -> None:
    """Read the corpus into the cache as a rank's source does; report times, CPU and memory as JSON."""
    from dflash_flow.data.records import ReadOptions, read_records

    tok = tokenizer()
    while time.time() < args.start_at:
        time.sleep(0.002)
    before = rss()
    r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    states = set()
    tf = read_records(args.rank, tokenizer=tok, kind="chat",
                      options=ReadOptions(cache_dir=args.cache, max_length=MAX_LENGTH),
                      progress=lambda p: states.add(p.state))
    from dflash_flow.data.plan import file_table

    table = file_table("source", [tf])
    load_s = time.perf_counter() - t0
    r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    after = rss()
    t1 = time.perf_counter()
    from dflash_flow.data.epoch import order_packed
    from dflash_flow.data.packing import PlanConfig
    from dflash_flow.data.plan import BatchPlanner

    plan = order_packed(BatchPlanner(table.lengths, PlanConfig(max_tokens=16384), seed=1).pack(0), world_size=2)
    plan.state_dict(len(plan) // 2)
    plan_s = time.perf_counter() - t1
    cpu = lambda a, b: (b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)  # noqa: E731
    print(json.dumps({
        "built": not tf.report.from_cache, "states": sorted(states), "load_s": load_s, "plan_s": plan_s,
        "batches": len(plan), "samples": len(table), "tokens": table.tokens,
        "cpu_s": cpu(r0, r1) + cpu(c0, c1), "cpu_self_s": cpu(r0, r1), "cpu_workers_s": cpu(c0, c1),
        "rss_before": before, "rss_after": after, "peak_rss_bytes": r1.ru_maxrss * 1024,
        "peak_rss_workers_bytes": c1.ru_maxrss * 1024,
    }))


def ranks(corpus: Path, cache: Path, count: int) -> list[dict]:
    start = time.time() + 4.0  # every rank has imported before they start together
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(corpus), "--cache", str(cache),
                               "--start-at", str(start)], stdout=subprocess.PIPE, text=True) for _ in range(count)]
    out = []
    for p in procs:
        stdout, _ = p.communicate(timeout=7200)
        if p.returncode != 0:
            raise SystemExit(f"a rank failed with exit code {p.returncode}")
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


# -- the datasets path, for the comparison docs/architecture.md reports ----------------------------

def datasets_main(args) -> None:
    """One process: load_dataset(json) + map(num_proc) with the same rendering and masking, cached."""
    import datasets

    from dflash_flow.data.chat import (
        parse_conversation,
        probe_template,
        render_chat,
        supervised_spans,
        token_mask,
    )

    tok = tokenizer()
    info = probe_template(tok)

    def encode(batch):
        ids, masks = [], []
        for turns in batch["conversations"]:
            msgs = parse_conversation({"conversations": turns})[0]
            text = render_chat(tok, msgs)
            spans = supervised_spans(text, msgs, info)
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids.append(enc["input_ids"])
            masks.append(token_mask(np.asarray(enc["offset_mapping"]), spans).tolist())
        return {"input_ids": ids, "loss_mask": masks}

    before = rss()
    r0, c0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    ds = datasets.load_dataset("json", data_files=str(args.datasets), cache_dir=str(args.cache), split="train")
    out = ds.map(encode, batched=True, batch_size=256, num_proc=os.cpu_count(), remove_columns=ds.column_names)
    lengths = np.asarray([len(x) for x in out["input_ids"]], dtype=np.int64) if args.lengths_pass else None
    load_s = time.perf_counter() - t0
    r1, c1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = lambda a, b: (b.ru_utime + b.ru_stime) - (a.ru_utime + a.ru_stime)  # noqa: E731
    print(json.dumps({"load_s": load_s, "cpu_s": cpu(r0, r1) + cpu(c0, c1), "rows": len(out),
                      "lengths_pass": lengths is not None, "rss_before": before, "rss_after": rss(),
                      "peak_rss_bytes": r1.ru_maxrss * 1024}))


def run_datasets(corpus: Path, cache: Path, *, lengths_pass: bool) -> dict:
    cmd = [sys.executable, __file__, "--datasets", str(corpus), "--cache", str(cache)]
    if lengths_pass:
        cmd.append("--lengths-pass")
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=7200)
    if p.returncode != 0:
        raise SystemExit("the datasets run failed")
    return json.loads(p.stdout.strip().splitlines()[-1])


def plan_at_scale(lengths: np.ndarray, n: int) -> dict:
    """The plan (Bucketer's pack, Interleaver's order for 2 ranks, a resume state) over ``n`` samples whose
    lengths follow the file: what a million-conversation run builds before its first step."""
    import json as _json

    from dflash_flow.data.epoch import order_packed
    from dflash_flow.data.packing import PlanConfig
    from dflash_flow.data.plan import BatchPlanner

    lens = np.clip(lengths[np.arange(n) % lengths.size], 1, 8192)
    t0 = time.perf_counter()
    packed = BatchPlanner(lens, PlanConfig(max_tokens=16384), seed=1).pack(0)
    t1 = time.perf_counter()
    plan = order_packed(packed, world_size=2)
    t2 = time.perf_counter()
    state = plan.state_dict(len(plan) // 2)
    t3 = time.perf_counter()
    return {"samples": n, "batches": len(plan), "pack_s": t1 - t0, "order_s": t2 - t1, "state_s": t3 - t2,
            "total_s": t3 - t0, "state_bytes": len(_json.dumps(state))}


# -- the command ------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=Path, default=common.ROOT / "bench" / "data" / "lengths-chat-100k.txt")
    ap.add_argument("--n", type=int, default=20_000)
    ap.add_argument("--out", type=Path, default=common.RESULTS / "data_scale.json")
    ap.add_argument("--workdir", type=Path, default=None, help="where the corpus and caches go (default: a temp dir)")
    ap.add_argument("--corpus", type=Path, default=None,
                    help="a chat JSONL of your own instead of the synthetic corpus (--lengths and --n are then unused)")
    ap.add_argument("--compare-datasets", action="store_true", help="also time datasets' load_dataset + map(num_proc)")
    ap.add_argument("--pipeline", type=int, default=0, metavar="N",
                    help="also run the pipeline over N pre-tokenized conversations (2 ranks, SIGKILL + resume)")
    ap.add_argument("--plan-samples", type=int, default=1_000_000, help="samples of the plan-at-scale figure")
    ap.add_argument("--rank", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--datasets", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--lengths-pass", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cache", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank:
        return rank_main(args)
    if args.datasets:
        return datasets_main(args)

    work = args.workdir or Path(tempfile.mkdtemp(prefix="data-scale-", dir=common.SCRATCH.parent))
    work.mkdir(parents=True, exist_ok=True)
    lengths = np.loadtxt(args.lengths, dtype=np.int64)
    import shutil

    for old in ("cache-1rank", "cache-2ranks", "hf-cache"):  # every run measures cold starts
        shutil.rmtree(work / old, ignore_errors=True)
    tok = tokenizer()
    tok.model_max_length = 10**9  # no "longer than the model" warnings: we only tokenize
    if args.corpus is not None:
        corpus = args.corpus
        info = {"conversations": sum(1 for line in corpus.open("rb") if line.strip()), "bytes": corpus.stat().st_size,
                "file": str(corpus)}
    else:
        corpus = work / f"chat-{args.n}.jsonl"
        info = make_corpus(corpus, lengths, args.n, tok)
    texts = rendered(corpus, tok)
    raw1, raw_tokens = raw_encode_s(tok, texts)
    one = ranks(corpus, work / "cache-1rank", 1)[0]
    raw2, _ = raw_encode_s(tok, texts)
    del texts
    two = ranks(corpus, work / "cache-2ranks", 2)
    warm = ranks(corpus, work / "cache-1rank", 1)[0]
    assert one["built"] and not warm["built"] and sorted(r["built"] for r in two) == [False, True]
    raw_s = (raw1 + raw2) / 2
    tokens = warm["tokens"]
    result = {
        "command": " ".join(["python", "bench/data_scale_bench.py", "--lengths", str(args.lengths), "--n", str(args.n)]
                            + (["--corpus", str(args.corpus)] if args.corpus else [])),
        "machine": common.machine(),
        "corpus": {**info, "tokens": tokens, "mean_tokens": tokens / max(warm["samples"], 1), "raw_tokens": raw_tokens},
        "raw_encode_s": [raw1, raw2],
        "reader_cold_s": one["load_s"],
        "reader_over_raw": raw_s / one["load_s"],
        "raw_tokens_per_s": raw_tokens / raw_s,
        "reader_tokens_per_s": tokens / one["load_s"],
        "cold_1rank": {"wall_s": one["load_s"], "cpu_s": one["cpu_s"], "peak_rss_bytes": one["peak_rss_bytes"],
                       "peak_rss_workers_bytes": one["peak_rss_workers_bytes"]},
        "cold_2ranks": [{"built": r["built"], "wall_s": r["load_s"], "cpu_s": r["cpu_s"], "states": r["states"],
                         "peak_rss_bytes": r["peak_rss_bytes"], "peak_rss_workers_bytes": r["peak_rss_workers_bytes"]}
                        for r in two],
        "cold_2ranks_over_1rank": sum(r["cpu_s"] for r in two) / one["cpu_s"],
        "cold_2ranks_wall_over_1rank": max(r["load_s"] for r in two) / one["load_s"],
        "warm_start_s": warm["load_s"],
        "plan_s": warm["plan_s"],
        "plan_batches": warm["batches"],
        "resident_data_bytes_per_token": (warm["rss_after"]["RssAnon"] - warm["rss_before"]["RssAnon"]) / tokens,
        "resident_file_bytes_per_token": (warm["rss_after"]["RssFile"] - warm["rss_before"]["RssFile"]) / tokens,
        "peak_rss_per_rank_bytes": [r["peak_rss_bytes"] for r in two],
        "rss_before_load_bytes": warm["rss_before"]["VmRSS"],
        "warm_peak_rss_bytes": warm["peak_rss_bytes"],
        "load_avg_at_end": [round(x, 2) for x in os.getloadavg()],
    }
    result["plan_1m"] = plan_at_scale(lengths, args.plan_samples)
    if args.compare_datasets:
        cold = run_datasets(corpus, work / "hf-cache", lengths_pass=False)
        again = run_datasets(corpus, work / "hf-cache", lengths_pass=True)
        result["datasets"] = {"cold_s": cold["load_s"], "cold_cpu_s": cold["cpu_s"], "cold_over_reader": cold["load_s"] / one["load_s"],
                              "warm_with_lengths_s": again["load_s"], "warm_rss_after": again["rss_after"],
                              "warm_peak_rss_bytes": again["peak_rss_bytes"], "cold_peak_rss_bytes": cold["peak_rss_bytes"]}
    if args.pipeline:
        import data_scale_pipeline

        result["pipeline"] = data_scale_pipeline.run(args.pipeline, lengths, work)
    return common.write_result(args.out, result)


if __name__ == "__main__":
    main()
