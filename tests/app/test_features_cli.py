"""``dflash-flow features build PIPELINE`` and ``features check STORE [--pipeline P]`` (``app.features_commands``):
a real pipeline (pre-tokenized JSONL, the shipped 8-layer target), its sources run on the core runtime, the target
once over every sample; the store checked against the pipeline field by field, rows recomputed; refusals with
one line. The slow tests run the commands as a user does, and under torchrun with two ranks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dflash_flow.app.exits import EXIT_OK, EXIT_USER_ERROR
from dflash_flow.app.features_commands import check_store, features_build_command, prepare, target_backend
from dflash_flow.app.runner import load
from dflash_flow.model.feature_store import MANIFEST, FeatureStore, build_store

VOCAB = 512  # fits the shipped target (768) and the tiny presets (512)


def write_pipeline(tmp: Path, n: int = 16, seed: int = 0, **model) -> Path:
    data = tmp / "data.jsonl"
    if not data.exists():
        rng = np.random.default_rng(seed)
        with open(data, "w") as f:
            for _ in range(n):
                length = int(rng.integers(12, 48))
                prompt = int(rng.integers(2, length // 2))
                f.write(json.dumps({"input_ids": rng.integers(5, VOCAB, size=length).tolist(),
                                    "loss_mask": [0] * prompt + [1] * (length - prompt)}) + "\n")
    stages = [
        {"name": "source", "type": "TokenizedSource",
         "config": {"paths": [str(data)], "vocab_size": VOCAB, "max_length": 64, "cache_dir": str(tmp / "cache")}},
        {"name": "bucketer", "type": "Bucketer", "inputs": ["source"], "config": {"max_tokens": 256, "epochs": 2}},
        {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"]},
        {"name": "padder", "type": "Padder", "inputs": ["interleaver"]},
        {"name": "target", "type": "TargetForward", "inputs": ["padder"], "config": {"torch_threads": 1}},
        {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "ordered": True,
         "config": {"num_anchors": 4, "torch_threads": 1}},
    ]
    doc = {"name": "features", "seed": 1, "output_dir": str(tmp / "out"), "tracking": {"enabled": False},
           "model": {"target": "embedded", "num_draft_layers": 2, "block_size": 4, **model}, "stages": stages}
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A pipeline and the store ``features build`` wrote for it."""
    tmp = tmp_path_factory.mktemp("features")
    pipeline = write_pipeline(tmp)
    before = torch.get_num_threads()
    try:
        code = features_build_command(pipeline, None, store=str(tmp / "store"), dtype=None, shard_mb=0.02, wait=False,
                                      device="cpu", margin_mb=0)
    finally:
        torch.set_num_threads(before)
    assert code == EXIT_OK
    return tmp, pipeline, tmp / "store"


def test_build_writes_the_pipelines_samples_with_its_identity(built):
    tmp, pipeline, store = built
    m = json.loads((store / MANIFEST).read_text())
    assert m["complete"] and m["samples"] == 16 and m["dtype"] == "fp32" and len(m["shards"]) > 1
    ident = m["identity"]
    assert ident["layer_ids"] == [1, 5] and ident["target"]["weights"].startswith("files:")
    assert ident["target"]["config"] and ident["tokens"] and m["vocab_size"] == 768 and m["compute_dtype"] == "float32"
    pf = prepare(load(pipeline))
    assert pf.identity == {**ident, "tokens": pf.identity["tokens"]} and pf.identity["tokens"] == ident["tokens"]
    with FeatureStore(store) as s:  # the Bucketer's sample ids
        assert s.sample_ids().tolist() == sorted(pf.samples.sample_ids.tolist())


def test_a_second_build_computes_nothing_and_check_finds_the_store_is_the_pipelines(built, capsys):
    tmp, pipeline, store = built
    code = features_build_command(pipeline, None, store=str(store), dtype=None, shard_mb=0.02, wait=False,
                                  device="cpu", margin_mb=0)
    assert code == EXIT_OK and "computed 0, reused 16" in capsys.readouterr().err
    pf = prepare(load(pipeline))
    backend = target_backend(pf, "cpu")
    rep = check_store(store, pipeline=pf, backend=backend, recompute=4)
    backend.close()
    assert not rep.problems, rep.problems
    assert any("identity: matches the pipeline (target.config, target.weights, layer_ids, tokens)" in line
               for line in rep.lines)
    assert any(line.startswith("recomputed 4 row(s) with the target: largest difference 0 ") for line in rep.lines)


@pytest.mark.parametrize(("override", "fields"), [
    ("model.target_layer_ids=[1, 6]", ["layer_ids"]),
    ("model.target=tiny-qwen3-8l", ["target.config", "target.weights"]),
])
def test_check_names_each_field_where_the_pipeline_differs(built, override, fields):
    tmp, pipeline, store = built
    pf = prepare(load(pipeline, overrides=[override]))
    rep = check_store(store, pipeline=pf, backend=None)
    assert [p.split(":")[0] for p in rep.problems] == fields


def test_check_finds_nan_infinite_and_zero_rows(tmp_path):
    samples_ids = np.arange(6, dtype=np.int64)
    toks = [np.arange(1, 4 + i, dtype=np.int32) for i in range(6)]
    from dflash_flow.model.feature_store import SampleIndex

    def compute(batch):
        out = []
        for sid, t in batch:
            row = torch.ones(len(t), 8)
            if sid == 1:
                row[0, 3] = float("nan")
            if sid == 2:
                row[1] = float("inf")
            if sid == 3:
                row.zero_()
            if sid == 4:
                row[0] = 0  # one token all zeros (the hybrid-model engine bug's signature)
            out.append(row)
        return out

    build_store(tmp_path / "s", identity={"layer_ids": [0]}, dtype="fp16", width=8,
                samples=SampleIndex(samples_ids, np.asarray([len(t) for t in toks]), lambda i: toks[i]),
                compute=compute, margin_bytes=0)
    rep = check_store(tmp_path / "s")
    assert rep.problems == ["1 row(s) with nan: samples 1", "1 row(s) with inf: samples 2",
                            "1 row(s) with zero rows: samples 3", "1 row(s) with zero tokens (1 tokens): samples 4"]


def test_a_build_that_does_not_fit_is_refused_with_both_numbers_before_writing(tmp_path, capsys):
    pipeline = write_pipeline(tmp_path)
    before = torch.get_num_threads()
    try:
        code = features_build_command(pipeline, None, store=str(tmp_path / "store"), dtype="bf16", shard_mb=None,
                                      wait=False, device="cpu", margin_mb=1e12)
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert code == EXIT_USER_ERROR
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "needs" in line[0] and "bytes per token, bf16) but its filesystem has" in line[0]
    assert not list((tmp_path / "store" / "shards").iterdir())


def test_no_store_named_is_one_line(tmp_path, capsys):
    pipeline = write_pipeline(tmp_path)
    code = features_build_command(pipeline, None, store=None, dtype=None, shard_mb=None, wait=False, device="cpu",
                                  margin_mb=None)
    assert code == EXIT_USER_ERROR
    assert "no store to build: set model.features.path or pass --store DIR" in capsys.readouterr().err


# -- as a user runs it --------------------------------------------------------------------------------------

def _cli(args, cwd, timeout=600, torchrun: int = 0):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={torchrun}", "-m",
               "dflash_flow.cli", *args]
    else:
        cmd = [sys.executable, "-m", "dflash_flow.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_the_commands_build_resume_check_and_repair_a_damaged_shard(tmp_path):
    pipeline = write_pipeline(tmp_path, n=24)
    store = tmp_path / "store"
    r = _cli(["features", "build", str(pipeline), "--store", str(store), "--shard-mb", "0.02", "--dtype", "fp8"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bytes per token" in r.stderr and "GB free on" in r.stderr and "ETA" in r.stderr and "complete, 24 samples" in r.stderr
    r = _cli(["features", "check", str(store), "--pipeline", str(pipeline), "--digests"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tolerance 0.07 (fp8)" in r.stdout and r.stdout.strip().endswith(f"ok: {store}")
    m = json.loads((store / MANIFEST).read_text())
    shard = store / m["shards"][1]["file"]
    os.truncate(shard, shard.stat().st_size - 10)
    r = _cli(["features", "check", str(store)], tmp_path)
    assert r.returncode == 2 and f"problem: shard {m['shards'][1]['file']} has" in r.stdout
    assert "delete it and run `dflash-flow features build PIPELINE`" in r.stdout
    r = _cli(["features", "build", str(pipeline), "--store", str(store), "--shard-mb", "0.02", "--dtype", "fp8"], tmp_path)
    assert r.returncode == 0 and f"computed {m['shards'][1]['samples']}, reused {24 - m['shards'][1]['samples']}" in r.stderr
    assert _cli(["features", "check", str(store)], tmp_path).returncode == 0


@pytest.mark.slow
def test_two_torchrun_ranks_build_one_store_equal_to_one_process(tmp_path):
    pipeline = write_pipeline(tmp_path, n=30)
    one, two = tmp_path / "one", tmp_path / "two"
    r = _cli(["features", "build", str(pipeline), "--store", str(one), "--shard-mb", "0.02"], tmp_path)
    assert r.returncode == 0, r.stderr
    r = _cli(["features", "build", str(pipeline), "--store", str(two), "--shard-mb", "0.02"], tmp_path, torchrun=2)
    assert r.returncode == 0, r.stdout + r.stderr
    names = [p.name for p in (two / "shards").iterdir()]
    assert {n.split("-")[1] for n in names} == {"r00000", "r00001"}
    assert sorted(p.name for p in (two / "ranks").iterdir()) == ["g0000-r00000.json", "g0000-r00001.json"]
    assert json.loads((two / MANIFEST).read_text())["identity"] == json.loads((one / MANIFEST).read_text())["identity"]
    with FeatureStore(one) as a, FeatureStore(two) as b:
        assert a.sample_ids().tolist() == b.sample_ids().tolist()
        for sid in a.sample_ids().tolist():
            assert torch.equal(a.row(sid), b.row(sid))
    shutil.rmtree(one)


# -- training from the store --------------------------------------------------------------------------------

def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "drafter" / "model.safetensors"))


def _same_bits(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _train_pipeline(tmp: Path, n: int = 24) -> Path:
    """The small pipeline with what an exact resume needs: checkpoints, recorded batches, two epochs."""
    path = write_pipeline(tmp, n=n)
    doc = yaml.safe_load(path.read_text())
    doc["checkpoint"] = {"every_steps": 2, "keep_last": 2}
    for st in doc["stages"]:
        if st["type"] == "DrafterStep":
            st["config"]["record_batches"] = True
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


OFFLINE = ["--set", "stages.target.cache_features=false", "--set", "model.features.mode=offline"]


@pytest.mark.slow
def test_training_offline_or_hybrid_equals_online_bit_for_bit_and_a_store_of_other_layers_is_refused(tmp_path):
    pipeline = _train_pipeline(tmp_path)
    # online, each sample's features computed alone (the cache's rule: what the store holds)
    r = _cli(["run", str(pipeline), "--set", f"output_dir={tmp_path / 'online'}", "--set",
              "stages.target.cache_features=true"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(["features", "build", str(pipeline), "--store", str(tmp_path / "store"), "--dtype", "fp32"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(["run", str(pipeline), "--set", f"output_dir={tmp_path / 'offline'}", *OFFLINE, "--set",
              f"model.features.path={tmp_path / 'store'}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    r = _cli(["run", str(pipeline), "--set", f"output_dir={tmp_path / 'hybrid'}", "--set", "model.features.mode=hybrid",
              "--set", "stages.target.cache_features=false", "--set", f"model.features.path={tmp_path / 'hstore'}",
              "--set", "model.features.ram_budget_mb=0"], tmp_path)  # later epochs read the disk
    assert r.returncode == 0, r.stderr[-3000:]
    online = _weights(tmp_path / "online")
    assert _same_bits(online, _weights(tmp_path / "offline"))
    assert _same_bits(online, _weights(tmp_path / "hybrid"))
    with FeatureStore(tmp_path / "hstore", complete=False) as h, FeatureStore(tmp_path / "store") as s:
        assert h.sample_ids().tolist() == s.sample_ids().tolist()
        assert all(torch.equal(h.row(i), s.row(i)) for i in s.sample_ids().tolist())
    r = _cli(["run", str(pipeline), "--set", f"output_dir={tmp_path / 'other'}", *OFFLINE, "--set",
              f"model.features.path={tmp_path / 'store'}", "--set", "model.target_layer_ids=[1, 6]"], tmp_path)
    assert r.returncode == 2
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and "was built for another layer_ids (layer_ids: store [1, 5] vs this pipeline [1, 6])" in errors[0]


@pytest.mark.slow
def test_a_run_killed_mid_epoch_resumes_from_the_store_exactly(tmp_path):
    import signal
    import time

    pipeline = _train_pipeline(tmp_path, n=32)
    store = ["--set", f"model.features.path={tmp_path / 'store'}"]
    assert _cli(["features", "build", str(pipeline), "--store", str(tmp_path / "store")], tmp_path).returncode == 0
    ref = tmp_path / "ref"
    r = _cli(["run", str(pipeline), "--set", f"output_dir={ref}", *OFFLINE, *store], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (ref / "batches.jsonl").read_text().splitlines()
    out = tmp_path / "killed"
    kill_at = len(lines) // 2 - 1  # mid first epoch... or just past it: either way mid-run
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    args = [sys.executable, "-m", "dflash_flow.cli", "run", str(pipeline), "--set", f"output_dir={out}", *OFFLINE, *store]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            batches = out / "batches.jsonl"
            if batches.exists() and batches.read_text().count("\n") >= kill_at:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the run ended before the kill: " + (tmp_path / "first.log").read_text()[-2000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    r = _cli(["run", str(pipeline), "--set", f"output_dir={out}", *OFFLINE, *store, "--resume", "latest"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming from" in r.stdout + r.stderr
    assert _same_bits(_weights(ref), _weights(out))
