"""The feature store (issue 37, docs/features.md): how fast it reads against the disk it lies on, what it costs
per token in each dtype, that training from it is training online, and (``--tau``) what bf16 and fp8 stores
cost in acceptance on the embedded default.

Writes bench/results/feature_store.json (``--tau``: feature_store_tau.json). Figures:

* ``read_over_disk``: a store of ``--n`` samples (synthetic rows, bf16, 2,048 features per token, 256-1,024
  tokens each: about 2.6 MB per sample) read in a random sample order through ``FeatureStore.read_into``
  in batches of 8 (each batch's rows announced with ``posix_fadvise(WILLNEED)``, then each one ``pread``
  into the batch's tensor), against the disk's sequential rate on the same
  shard files in the same command: the better of a page-cache read in 8-MiB ``readinto`` calls (readahead
  widened by ``POSIX_FADV_SEQUENTIAL``) and an ``O_DIRECT`` read in 8-MiB aligned calls. Before every
  read each file's pages are dropped from the page cache with ``posix_fadvise(DONTNEED)`` (the files are
  clean: fsynced) and ``fincore`` (util-linux) reports what stayed resident. Alternating trials; the ratio
  of medians. Also: the same rows faulted in through ``mmap`` (``madvise(WILLNEED)``, then a copy), the
  reading the store used before, and the warm rate (from the page cache).
* ``bytes_per_token``: the features' bytes (F x itemsize, + 4 for fp8's scale) for the embedded default's
  width and for Qwen3-8B's 5 x 4096, and what a real build put on disk per token (index, alignment, trailers).
* ``offline_equals_online``: a small pipeline (the shipped target, pre-tokenized samples) trained online
  (each sample's features computed alone, the cache's rule) and offline from an fp32 store built by
  ``features build``: the drafter's weights bit for bit.
* ``two_rank_build``: a store of ``--build-n`` synthetic samples written by 2 torchrun ranks (rate, peak
  memory per rank, one manifest).
* ``--tau``: the embedded default (pipelines/dflash.yaml) online (today's in-memory cache), hybrid (store
  written in epoch 0, read after), and offline from fp32, bf16 and fp8 stores, each with ``--seeds``: wall
  time and acceptance (``fp8_tau_minus_fp32``, ``bf16_tau_minus_fp32``: the mean over seeds of the
  difference to fp32 with the same seed, greedy on 16 held-out prompts; also T = 1 and the walk; offline
  fp32 and hybrid weights vs online).

Usage: python bench/feature_store_bench.py [--n N] [--out FILE] [--tau]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common
import numpy as np

SCRATCH = common.SCRATCH / "feature_store"
READ_WIDTH = 2048
SEQ_CHUNK = 8 * 2**20
BATCH = 8  # samples per batch


# -- synthetic rows --------------------------------------------------------------------------------------

def synthetic_samples(n: int, lo: int, hi: int, seed: int = 0):
    from dflash_flow.model.feature_store import SampleIndex

    rng = np.random.default_rng(seed)
    lengths = rng.integers(lo, hi, size=n).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)])
    tokens = rng.integers(0, 50_000, size=int(starts[-1])).astype(np.int32)
    return SampleIndex(np.arange(n, dtype=np.int64), lengths, lambda i: tokens[starts[i] : starts[i + 1]])


def synthetic_compute(width: int, seed: int = 0):
    """Rows sliced from one random pool (cheap to make, not constant, so nothing compresses)."""
    import torch

    pool = torch.randn(2**22 + 4096 * width, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)

    def compute(batch):
        out = []
        for sid, toks in batch:
            n = len(toks) * width
            start = (int(sid) * 7919 * 64) % (pool.numel() - n)
            out.append(pool[start : start + n].view(len(toks), width))
        return out

    return compute


# -- read over disk ----------------------------------------------------------------------------------------

def drop_cache(files: list[Path]) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache (``fincore``), None where it is not installed."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    return sum(int(x) for x in out.stdout.split())


def sequential_read(files: list[Path]) -> tuple[int, float]:
    """The files in order through the page cache, 8-MiB ``readinto`` calls, readahead widened
    (``POSIX_FADV_SEQUENTIAL``)."""
    buf = bytearray(SEQ_CHUNK)
    view = memoryview(buf)
    total, t0 = 0, time.perf_counter()
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := fh.readinto(view):
                total += n
    return total, time.perf_counter() - t0


def direct_read(files: list[Path]) -> tuple[int, float] | None:
    """The files in order with ``O_DIRECT`` (the device's own rate, no page cache), 8-MiB aligned reads;
    None where the filesystem refuses O_DIRECT."""
    import mmap

    buf = mmap.mmap(-1, SEQ_CHUNK)  # page-aligned
    total, t0 = 0, time.perf_counter()
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            try:
                offset = 0
                while n := os.preadv(fd, [buf], offset):
                    total += n
                    offset += n
            finally:
                os.close(fd)
    except OSError:
        return None
    finally:
        buf.close()
    return total, time.perf_counter() - t0


def store_read(root: Path, order: np.ndarray, lengths: dict[int, int]) -> tuple[int, float]:
    import torch

    from dflash_flow.model.feature_store import FeatureStore

    total, t0 = 0, time.perf_counter()
    with FeatureStore(root) as store:
        out = torch.empty(max(lengths.values()), store.width, dtype=store.codec.default_out_dtype())
        order = order.tolist()
        for k in range(0, len(order), BATCH):  # as StoreBackend reads a batch: its rows announced, then copied
            batch = order[k : k + BATCH]
            store.prefetch(batch)
            for sid in batch:
                n = lengths[sid]
                store.read_into(out[:n], sid)
                total += n * store.codec.bytes_per_token(store.width)
    return total, time.perf_counter() - t0


def mmap_read(root: Path, order: np.ndarray, lengths: dict[int, int]) -> tuple[int, float]:
    """The same rows through ``mmap`` (each batch's rows ``madvise(WILLNEED)``, then copied out)."""
    import mmap

    import torch

    from dflash_flow.model.feature_store import FeatureStore

    maps: dict[Path, mmap.mmap] = {}
    total, t0 = 0, time.perf_counter()
    with FeatureStore(root) as store:
        out = torch.empty(max(lengths.values()), store.width, dtype=torch.bfloat16)
        order = order.tolist()
        for k in range(0, len(order), BATCH):
            locs = [store.locate(sid) for sid in order[k : k + BATCH]]
            for shard, offset, length, _, _ in locs:
                if shard.path not in maps:
                    with open(shard.path, "rb") as f:
                        maps[shard.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                start = offset - offset % mmap.PAGESIZE
                maps[shard.path].madvise(mmap.MADV_WILLNEED, start, offset + shard.row_bytes(length) - start)
            for shard, offset, length, _, _ in locs:
                src = np.frombuffer(maps[shard.path], dtype=np.int16, count=length * store.width, offset=offset)
                np.copyto(out[:length].view(torch.int16).numpy(), src.reshape(length, store.width))
                del src
                total += shard.row_bytes(length)
    for m in maps.values():
        m.close()
    return total, time.perf_counter() - t0


def read_over_disk(n: int, trials: int) -> dict[str, Any]:
    from dflash_flow.model.feature_store import build_store

    root = SCRATCH / "read"
    shutil.rmtree(root, ignore_errors=True)
    samples = synthetic_samples(n, 256, 1024)
    t0 = time.perf_counter()
    r = build_store(root, identity={"layer_ids": [0]}, dtype="bf16", width=READ_WIDTH, samples=samples,
                    compute=synthetic_compute(READ_WIDTH), shard_bytes=256 * 2**20, margin_bytes=2**30)
    build_s = time.perf_counter() - t0
    files = sorted((root / "shards").glob("*.dfs"))
    lengths = dict(zip(samples.sample_ids.tolist(), samples.lengths.tolist(), strict=True))
    rng = np.random.default_rng(1)
    seq, direct, rnd, mapped, residency = [], [], [], [], []
    for _ in range(trials):  # alternating, so drift on a shared machine hits every side
        drop_cache(files)
        residency.append(resident_bytes(files))
        nbytes, s = sequential_read(files)
        seq.append(nbytes / s)
        got = direct_read(files)
        if got is not None:
            direct.append(got[0] / got[1])
        drop_cache(files)
        residency.append(resident_bytes(files))
        nbytes, s = store_read(root, rng.permutation(samples.sample_ids), lengths)
        rnd.append(nbytes / s)
        drop_cache(files)
        nbytes, s = mmap_read(root, rng.permutation(samples.sample_ids), lengths)
        mapped.append(nbytes / s)
    nbytes, s = store_read(root, rng.permutation(samples.sample_ids), lengths)  # warm: from the page cache
    warm = nbytes / s
    shutil.rmtree(root, ignore_errors=True)
    return {
        "samples": n, "store_mb": round(r.bytes / 1e6, 1), "dtype": "bf16", "width": READ_WIDTH,
        "build_mb_per_s": round(r.bytes / 1e6 / build_s, 1),
        "sequential_mb_per_s": [round(x / 1e6, 1) for x in seq],
        "sequential_o_direct_mb_per_s": [round(x / 1e6, 1) for x in direct],
        "store_random_order_mb_per_s": [round(x / 1e6, 1) for x in rnd],
        "mmap_random_order_mb_per_s": [round(x / 1e6, 1) for x in mapped],
        "store_over_mmap": round(statistics.median(rnd) / statistics.median(mapped), 3),
        "read_over_buffered_sequential": round(statistics.median(rnd) / statistics.median(seq), 3),
        # The disk's sequential rate: the better of the page-cache and the O_DIRECT read (medians).
        "read_over_disk": round(statistics.median(rnd) / max(statistics.median(seq),
                                                              statistics.median(direct) if direct else 0.0), 3),
        "store_warm_mb_per_s": round(warm / 1e6, 1),
        "resident_bytes_after_drop": residency,
        "cache_dropped_by": "posix_fadvise(DONTNEED) on every shard file before each read (fsynced first)",
    }


# -- bytes per token -----------------------------------------------------------------------------------------

def bytes_per_token(embedded_width: int) -> dict[str, Any]:
    from dflash_flow.model.feature_store import CODECS, build_store

    samples = synthetic_samples(300, 32, 480, seed=2)  # the embedded data's lengths, about
    out: dict[str, Any] = {}
    for name, c in CODECS.items():
        root = SCRATCH / f"bpt-{name}"
        shutil.rmtree(root, ignore_errors=True)
        r = build_store(root, identity={"layer_ids": [0]}, dtype=name, width=embedded_width, samples=samples,
                        compute=synthetic_compute(embedded_width, seed=3), shard_bytes=64 * 2**20, margin_bytes=0)
        disk = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        out[name] = {"features_embedded": c.bytes_per_token(embedded_width),
                     "on_disk_embedded": round(disk / r.tokens, 1),
                     "features_qwen3_8b_5_layers": c.bytes_per_token(5 * 4096)}
        shutil.rmtree(root, ignore_errors=True)
    return out


# -- pipelines -------------------------------------------------------------------------------------------------

def cli(args: list[str], *, torchrun: int = 0, timeout: float = 3600) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    head = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}"] if torchrun \
        else [sys.executable]
    t0 = time.perf_counter()
    proc = subprocess.run([*head, "-m", "dflash_flow.cli", *args], cwd=common.ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc, wall


def weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


def same_bits(a: dict, b: dict) -> bool:
    import torch

    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def small_pipeline(root: Path) -> Path:
    import yaml

    rng = np.random.default_rng(0)
    data = root / "data.jsonl"
    with open(data, "w") as f:
        for _ in range(48):
            length = int(rng.integers(24, 96))
            prompt = int(rng.integers(4, length // 2))
            f.write(json.dumps({"input_ids": rng.integers(5, 768, size=length).tolist(),
                                "loss_mask": [0] * prompt + [1] * (length - prompt)}) + "\n")
    doc = {"name": "feature-store-bench", "seed": 3, "output_dir": str(root / "out"), "tracking": {"enabled": False},
           "checkpoint": {"every_steps": 0, "at_epoch_end": False},
           "model": {"target": "embedded", "num_draft_layers": 2, "block_size": 4},
           "stages": [
               {"name": "source", "type": "TokenizedSource",
                "config": {"paths": [str(data)], "vocab_size": 768, "max_length": 128, "cache_dir": str(root / "cache")}},
               {"name": "bucketer", "type": "Bucketer", "inputs": ["source"], "config": {"max_tokens": 512, "epochs": 3}},
               {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"]},
               {"name": "padder", "type": "Padder", "inputs": ["interleaver"]},
               {"name": "target", "type": "TargetForward", "inputs": ["padder"],
                "config": {"torch_threads": 1, "cache_features": True}},
               {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "ordered": True,
                "config": {"num_anchors": 8, "torch_threads": 1}}]}
    path = root / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def offline_equals_online() -> dict[str, Any]:
    root = SCRATCH / "equal"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    p = str(small_pipeline(root))
    _, online_s = cli(["run", p, "--set", f"output_dir={root / 'online'}"])
    _, build_s = cli(["features", "build", p, "--store", str(root / "store"), "--dtype", "fp32"])
    _, offline_s = cli(["run", p, "--set", f"output_dir={root / 'offline'}", "--set", "stages.target.cache_features=false",
                        "--set", "model.features.mode=offline", "--set", f"model.features.path={root / 'store'}"])
    equal = same_bits(weights(root / "online"), weights(root / "offline"))
    shutil.rmtree(root, ignore_errors=True)
    return {"offline_equals_online": equal, "pipeline": "48 pre-tokenized samples x 3 epochs, the shipped target",
            "online_s": round(online_s, 1), "build_s": round(build_s, 1), "offline_s": round(offline_s, 1)}


# -- two ranks -------------------------------------------------------------------------------------------------

def rank_worker(store: str, n: int, out: str) -> None:
    """One torchrun rank of ``two_rank_build``."""
    from dflash_flow.app import DistributedConfig
    from dflash_flow.app.distributed import init_distributed, shutdown_distributed
    from dflash_flow.model.feature_store import build_store

    dist = init_distributed(DistributedConfig(), use_cuda=False)
    samples = synthetic_samples(n, 16, 112, seed=4)
    t0 = time.perf_counter()
    r = build_store(store, identity={"layer_ids": [0]}, dtype="bf16", width=128, samples=samples, comm=dist,
                    compute=synthetic_compute(128, seed=5), shard_bytes=64 * 2**20, margin_bytes=0)
    seconds = time.perf_counter() - t0
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(out, f"rank{dist.rank}.json").write_text(json.dumps({"seconds": seconds, "peak_rss_mb": peak_mb,
                                                               "samples": r.samples, "complete": r.complete}))
    shutdown_distributed(dist, failed=False)


def two_rank_build(n: int) -> dict[str, Any]:
    root = SCRATCH / "ranks"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(Path(__file__)), "--rank-worker", str(root / "store"), "--build-n", str(n),
                           "--worker-out", str(root)], cwd=common.ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    ranks = [json.loads((root / f"rank{r}.json").read_text()) for r in range(2)]
    m = json.loads((root / "store" / "manifest.json").read_text())
    shards = {s["file"].split("-")[1] for s in m["shards"]}
    shutil.rmtree(root, ignore_errors=True)
    return {"samples": m["samples"], "tokens": m["tokens"], "store_mb": round(m["bytes"] / 1e6, 1),
            "complete": m["complete"], "shard_writers": sorted(shards),
            "build_s": round(max(r["seconds"] for r in ranks), 1), "wall_s_with_startup": round(wall, 1),
            "tokens_per_s": round(m["tokens"] / max(r["seconds"] for r in ranks)),
            "samples_per_s": round(m["samples"] / max(r["seconds"] for r in ranks)),
            "peak_rss_mb_per_rank": [round(r["peak_rss_mb"]) for r in ranks],
            "rows": "synthetic bf16, 128 features per token (the bookkeeping at scale, not a target)"}


# -- acceptance on the embedded default ----------------------------------------------------------------------

def run_embedded(out: Path, *extra: str) -> dict[str, Any]:
    """One run of the embedded default: wall time and acceptance (kept beside it in ``out.json``: a bench
    stopped midway reuses the runs it finished)."""
    done = out.with_suffix(".json")
    if done.is_file() and (out / "drafter" / "model.safetensors").is_file():
        return json.loads(done.read_text())
    shutil.rmtree(out, ignore_errors=True)
    args = ["run", str(common.DFLASH_YAML)]
    for o in common.embedded_overrides(out, *extra):
        args += ["--set", o]
    load_before = os.getloadavg()[0]
    _, wall = cli(args)
    summary = json.loads((out / "monitor" / "summary.json").read_text())
    evals = summary.get("eval") or {}
    res = {"wall_s": round(wall, 1), "load_avg_1min_before": round(load_before, 2),
           "tau": evals.get("trained", {}).get("metrics", {}).get("tau"),
           "tau_t1": evals.get("trained-T1", {}).get("metrics", {}).get("tau"),
           "walk_tau": evals.get("walk", {}).get("metrics", {}).get("tau"), "steps": summary.get("step")}
    done.write_text(json.dumps(res))
    return res


def convert_store(src: Path, dst: Path, dtype: str) -> float:
    """The fp32 store ``src`` of the embedded default written again in ``dtype`` (what ``features build --dtype``
    writes for a target that computes in fp32, without running it again); seconds taken."""
    from dflash_flow.app.features_commands import prepare
    from dflash_flow.app.runner import load
    from dflash_flow.model.feature_store import FeatureStore, build_store

    t0 = time.perf_counter()
    pf = prepare(load(common.DFLASH_YAML))
    with FeatureStore(src) as fp32:
        m = fp32.manifest
        build_store(dst, identity=pf.identity, dtype=dtype, width=fp32.width, samples=pf.samples,
                    compute=lambda batch: [fp32.row(sid) for sid, _ in batch], margin_bytes=0,
                    compute_dtype=m.get("compute_dtype"), vocab_size=m.get("vocab_size"))
    return time.perf_counter() - t0


def tau_figures(seeds: list[int]) -> dict[str, Any]:
    """Each store dtype trained with each seed (the drafter's initialisation and the data order): acceptance
    moves from seed to seed by more than a store's precision does, so a dtype's cost is the mean of its
    differences to fp32 with the same seed. Runs are kept in SCRATCH/tau and reused by a later call."""
    root = SCRATCH / "tau"
    root.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"online_cache": run_embedded(root / "online")}
    off = ("stages.target.cache_features=false",)
    res["hybrid"] = run_embedded(root / "hybrid", *off, "model.features.mode=hybrid",
                                 f"model.features.path={root / 'hybrid-store'}")
    stores: dict[str, Any] = {}
    for dtype in ("fp32", "bf16", "fp8"):
        store = root / f"store-{dtype}"
        built = store.with_suffix(".json")
        if built.is_file():
            build_s = json.loads(built.read_text())["build_s"]
        else:
            shutil.rmtree(store, ignore_errors=True)
            if dtype == "fp32":
                _, build_s = cli(["features", "build", str(common.DFLASH_YAML), "--store", str(store), "--dtype", dtype])
            else:  # the CPU target computes fp32: a bf16/fp8 build stores exactly these rows cast, so cast them
                build_s = convert_store(root / "store-fp32", store, dtype)
            built.write_text(json.dumps({"build_s": build_s}))
        m = json.loads((store / "manifest.json").read_text())
        stores[dtype] = {"build_s": round(build_s, 1), "store_mb": round(m["bytes"] / 1e6, 1),
                         "bytes_per_token_on_disk": round(m["bytes"] / m["tokens"], 1)}
        for seed in seeds:
            name = f"offline-{dtype}" if seed == seeds[0] else f"offline-{dtype}-s{seed}"
            res[name.replace("-", "_")] = run_embedded(root / name, *off, f"seed={seed}", "model.features.mode=offline",
                                                       f"model.features.path={store}")
    out: dict[str, Any] = {"seeds": seeds, "stores": stores, "runs": res,
                           "offline_equals_online_embedded": same_bits(weights(root / "online"),
                                                                       weights(root / "offline-fp32")),
                           "hybrid_equals_online_embedded": same_bits(weights(root / "online"), weights(root / "hybrid")),
                           "hybrid_wall_over_cache": round(res["hybrid"]["wall_s"] / res["online_cache"]["wall_s"], 3)}

    def run(dtype: str, seed: int) -> dict[str, Any]:
        return res[f"offline_{dtype}" if seed == seeds[0] else f"offline_{dtype}_s{seed}"]

    for dtype in ("bf16", "fp8"):
        for metric, key in (("tau", "tau"), ("tau_t1", "tau_t1"), ("walk_tau", "walk_tau")):
            diffs = [run(dtype, sd)[metric] - run("fp32", sd)[metric] for sd in seeds]
            out[f"{dtype}_{key}_minus_fp32"] = round(statistics.fmean(diffs), 4)
            out[f"{dtype}_{key}_minus_fp32_per_seed"] = [round(d, 4) for d in diffs]
    fp32_taus = [run("fp32", sd)["tau"] for sd in seeds]
    out["fp32_tau_by_seed"] = [round(t, 4) for t in fp32_taus]
    out["fp32_tau_seed_spread"] = round(max(fp32_taus) - min(fp32_taus), 4)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=500, help="samples of the read benchmark's store (~1.3 GB at 500)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--build-n", type=int, default=100_000, help="samples of the two-rank build")
    parser.add_argument("--tau", action="store_true", help="the acceptance of bf16/fp8 stores on the embedded default")
    parser.add_argument("--seeds", default="42,43,44", help="with --tau: the seeds each store dtype trains with")
    parser.add_argument("--out", default=None)
    parser.add_argument("--rank-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_worker:
        rank_worker(args.rank_worker, args.build_n, args.worker_out)
        return {}
    SCRATCH.mkdir(parents=True, exist_ok=True)
    if args.tau:
        data = {"bench": "feature_store_tau", "machine": common.machine(),
                **tau_figures([int(x) for x in args.seeds.split(",")])}
        return common.write_result(Path(args.out or common.RESULTS / "feature_store_tau.json"), data)
    from dflash_flow.model.facts import target_facts

    facts = target_facts(str(common.ROOT / "dflash_flow" / "embedded" / "assets" / "target"))
    width = 2 * facts.hidden_size  # the embedded default fuses 2 layers
    data = {"bench": "feature_store", "machine": common.machine()}
    data["read"] = read_over_disk(args.n, args.trials)
    data["read_over_disk"] = data["read"]["read_over_disk"]
    data["bytes_per_token"] = bytes_per_token(width)
    data["equal"] = offline_equals_online()
    data["offline_equals_online"] = data["equal"]["offline_equals_online"]
    data["two_rank_build"] = two_rank_build(args.build_n)
    data["fp8_tau_minus_fp32"] = data["bf16_tau_minus_fp32"] = "see feature_store_tau.json (--tau: the embedded default)"
    return common.write_result(Path(args.out or common.RESULTS / "feature_store.json"), data)


if __name__ == "__main__":
    main()
