"""The whole pipeline over a large corpus (issue 21, item 7): ``data_scale_bench.py --pipeline N``.

N pre-tokenized conversations (lengths from the lengths file, random ids of the tiny target's vocabulary)
are written once as an Arrow file and read once into the token store (the cold build, timed); then the
real pipeline runs warm under torchrun with 2 ranks and the tiny target for ``STEPS`` steps, twice:

* a reference run, uninterrupted;
* a run SIGKILLed (the whole process group) after about half its steps, then ``--resume latest``.

Reported: time from the command's start to each rank's first trained batch, peak resident memory per rank
(private and file-backed), and whether the killed-and-resumed run trained exactly the reference's batches
(the splice rule of tests/reliability/test_resume.py: ``before[:total] + after == reference`` per rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import common
import numpy as np
import yaml

VOCAB = 512  # the tiny-qwen3-8l preset; the last id is the drafter's mask token
STEPS = 100
MAX_LENGTH = 2048


def write_corpus(path: Path, lengths: np.ndarray, n: int) -> dict:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    meta = path.with_suffix(".json")
    if path.exists() and meta.exists():
        return json.loads(meta.read_text())
    rng = np.random.default_rng(21)
    lens = np.clip(lengths[np.arange(n) % lengths.size], 8, MAX_LENGTH)
    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
    tmp = path.with_name(path.name + ".tmp")
    t0 = time.perf_counter()
    with ipc.new_file(str(tmp), schema) as w:
        for a in range(0, n, 20_000):
            ln = lens[a : a + 20_000]
            off = np.concatenate([[0], np.cumsum(ln)]).astype(np.int32)
            ids = rng.integers(4, VOCAB - 1, int(off[-1]), dtype=np.int32)
            pos = np.arange(int(off[-1])) - np.repeat(off[:-1], ln)
            mask = (pos >= np.repeat(ln // 4, ln)).astype(np.uint8)
            w.write_batch(pa.record_batch([pa.ListArray.from_arrays(off, ids), pa.ListArray.from_arrays(off, mask)],
                                          schema=schema))
    tmp.rename(path)
    info = {"conversations": n, "tokens": int(lens.sum()), "write_s": time.perf_counter() - t0, "bytes": path.stat().st_size}
    meta.write_text(json.dumps(info))
    return info


def pipeline(data: Path, cache: Path, out: Path, db: Path) -> dict:
    return {
        "name": "data-scale", "seed": 21, "output_dir": str(out),
        "runtime": {"capacity": 4, "stall_timeout_s": 900},
        "tracking": {"enabled": True, "tracking_uri": str(db), "experiment": "data-scale", "system_metrics": False},
        "checkpoint": {"every_steps": 10, "keep_last": 2},
        "distributed": {"timeout_s": 900},
        "model": {"target": "tiny-qwen3-8l", "num_draft_layers": 1, "block_size": 4, "mask_token_id": VOCAB - 1},
        "stages": [
            {"name": "source", "type": "TokenizedSource",
             "config": {"paths": [str(data)], "max_length": MAX_LENGTH, "cache_dir": str(cache), "vocab_size": VOCAB}},
            {"name": "bucketer", "type": "Bucketer", "inputs": ["source"],
             "config": {"max_tokens": 8192, "num_buckets": 6, "epochs": 1}},
            {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"], "config": {"max_batches": STEPS}},
            {"name": "padder", "type": "Padder", "inputs": ["interleaver"]},
            {"name": "target", "type": "TargetForward", "inputs": ["padder"],
             "config": {"torch_threads": 1}},
            {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "ordered": True,
             "config": {"num_anchors": 16, "record_batches": True, "torch_threads": 1}},
            {"name": "monitor", "type": "Monitor", "inputs": ["drafter"], "config": {"interval_s": 5.0, "plots": False}},
        ],
    }


def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("RssAnon:", "RssFile:", "VmRSS:")):
                    k, v = line.split(":")
                    out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((line for line in f if line.startswith("State:")), "").lower()
    except OSError:
        return "zombie"


def _ranks(pid: int) -> list[int]:
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for k in kids:
        try:
            env = k.environ()
        except psutil.Error:
            continue
        if "RANK" in env and "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env:
            found.append((int(env["RANK"]), k.pid))
    return [p for _r, p in sorted(found)]


def launch(yaml_path: Path, out: Path, *extra: str, kill_after: int | None = None) -> dict:
    """Run the pipeline with 2 ranks; watch each rank's memory and first batch; optionally SIGKILL it."""
    cmd = [sys.executable, "-m", "dflash_flow", "run", str(yaml_path), "--nproc", "2", *extra]
    log = (out.parent / f"{out.name}{'-killed' if kill_after else ''}{'-resumed' if extra else ''}.log").open("w")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=out.parent)
    peaks: dict[int, dict[str, int]] = {}
    first: dict[int, float] = {}
    logs = [out / f"batches.rank{r}.jsonl" for r in range(2)]
    already = [len(_lines(f)) for f in logs]  # a resumed run appends to what the killed one kept
    killed = False
    while proc.poll() is None:
        for r, pid in enumerate(_ranks(proc.pid)):
            st = _status(pid)
            peak = peaks.setdefault(r, {})
            for k, v in st.items():
                peak[k] = max(peak.get(k, 0), v)
        for r, f in enumerate(logs):
            if r not in first and f.exists() and len(_lines(f)) > already[r]:
                first[r] = time.monotonic() - t0
        if kill_after is not None and not killed and logs[0].exists():
            if sum(1 for _ in logs[0].open()) >= kill_after:
                victims = _ranks(proc.pid)  # torchrun starts each rank in a session of its own
                os.killpg(proc.pid, signal.SIGKILL)
                for pid in victims:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                for pid in victims:
                    while os.path.exists(f"/proc/{pid}") and "zombie" not in _state(pid):
                        time.sleep(0.05)
                killed = True
        time.sleep(0.1)
    log.close()
    return {"returncode": proc.returncode, "wall_s": time.monotonic() - t0, "first_batch_s": first,
            "peak_rss": peaks, "killed": killed}


def _lines(path: Path) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []


def run(n: int, lengths: np.ndarray, work: Path) -> dict:
    work = work / f"pipeline-{n}"
    work.mkdir(parents=True, exist_ok=True)
    data = work / f"tokens-{n}.arrow"
    corpus = write_corpus(data, lengths, n)
    cache = work / "cache"
    from dflash_flow.data.records import ReadOptions, read_records

    t0 = time.perf_counter()
    tf = read_records(data, kind="tokens", options=ReadOptions(cache_dir=cache, max_length=MAX_LENGTH, vocab_size=VOCAB))
    build_s = time.perf_counter() - t0
    result = {"conversations": n, "corpus": corpus, "store_build_s": build_s, "store_from_cache": tf.report.from_cache,
              "samples": len(tf), "tokens": int(tf.report.tokens), "steps": STEPS}
    del tf
    runs = {}
    for name in ("reference", "killed"):
        out = work / name
        if out.exists():
            import shutil

            shutil.rmtree(out)
        out.mkdir()
        y = work / f"{name}.yaml"
        y.write_text(yaml.safe_dump(pipeline(data, cache, out, work / f"{name}.db")))
        if name == "reference":
            runs[name] = launch(y, out)
        else:
            runs["killed"] = launch(y, out, kill_after=STEPS // 2)
            before = [_lines(out / f"batches.rank{r}.jsonl") for r in range(2)]
            ckpts = sorted((out / "checkpoints").glob("step-*"))
            state = json.loads((ckpts[-1] / "state.json").read_text())
            totals = [int(p["total"]) for p in state["extra"]["data_positions"]]
            for r in range(2):  # what the resumed run appends to
                (out / f"batches.rank{r}.jsonl").write_text("".join(x + "\n" for x in before[r][: totals[r]]))
            runs["resumed"] = launch(y, out, "--resume", "latest")
            after = [_lines(out / f"batches.rank{r}.jsonl")[totals[r]:] for r in range(2)]
            ref = [_lines(work / "reference" / f"batches.rank{r}.jsonl") for r in range(2)]
            spliced = [before[r][: totals[r]] + after[r] for r in range(2)]
            runs["exact"] = {
                "killed_at_batches": [len(b) for b in before], "checkpoint_total": totals,
                "exactly_once": all(spliced[r] == ref[r] for r in range(2)),
                "reference_batches": [len(x) for x in ref], "distinct_samples": len({
                    i for r in range(2) for line in spliced[r] for i in json.loads(line).get("sample_ids", [])}),
            }
    result["runs"] = runs
    return result


if __name__ == "__main__":
    common.write_result(Path(sys.argv[3]) if len(sys.argv) > 3 else common.RESULTS / "data_scale_pipeline.json",
                        run(int(sys.argv[1]), np.loadtxt(sys.argv[2], dtype=np.int64), common.SCRATCH))
