"""`dflash-flow run` end to end through the CLI: the MLflow run read back with MlflowClient, the
checkpoint, the export inference engines load, the printed acceptance length."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

pytestmark = pytest.mark.slow

VOCAB = 768  # the shipped target's vocabulary


def _write_tokenized(path: Path, n: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            length = int(rng.integers(24, 96))
            ids = rng.integers(5, VOCAB, size=length).tolist()
            prompt = int(rng.integers(4, length // 2))
            mask = [0] * prompt + [1] * (length - prompt)
            f.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")


def _pipeline(tmp: Path, *, fail_stage: bool = False) -> Path:
    data = tmp / "data.jsonl"
    _write_tokenized(data, 48)
    stages = [
        {"name": "source", "type": "TokenizedSource", "config": {"paths": [str(data)], "vocab_size": VOCAB, "max_length": 128, "cache_dir": str(tmp / "cache")}},
        {"name": "bucketer", "type": "Bucketer", "inputs": ["source"], "config": {"max_tokens": 1024, "num_buckets": 2, "epochs": 2}},
        {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"]},
        {"name": "padder", "type": "Padder", "inputs": ["interleaver"], "replicas": 2},
        {"name": "target", "type": "TargetForward", "inputs": ["padder"], "replicas": 2,
         "config": {"torch_threads": 1}},
        {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "ordered": True,
         "config": {"num_anchors": 16, "lr": 3e-3,
                    "torch_threads": 1, "record_batches": True}},
        {"name": "evaluate", "type": "SpecDecodeEval", "inputs": ["drafter"],
         "config": {"prompts": "embedded", "limit": 2, "max_new_tokens": 12,
                    "baseline": True}},
        {"name": "monitor", "type": "Monitor", "inputs": ["drafter", "evaluate"], "config": {"interval_s": 0.5, "progress": True}},
    ]
    if fail_stage:
        # A failure mid-stream in the drafter's own work (the real stage, a fault raised after its third batch;
        # tests/reliability/faulty_stages.py). The layer mismatch this test used to provoke is now refused by
        # validation before anything runs (tests/app/test_model_spec.py).
        stages[5]["type"] = "FaultyDrafterStep"
        stages[5]["config"].update(fault_phase="process", fault_at=2)
    doc = {
        "name": "app-e2e",
        "seed": 3,
        "output_dir": str(tmp / "out"),
        "tracking": {"tracking_uri": f"sqlite:///{tmp}/mlflow.db", "experiment": "e2e"},
        "checkpoint": {"every_steps": 3, "keep_last": 2},
        "model": {"target": "embedded", "num_draft_layers": 1, "block_size": 4},
        "stages": stages,
    }
    path = tmp / "pipeline.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _run(args: list[str], cwd: Path, timeout: int = 300, *, faulty: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # With the test-only Faulty<Type> stages registered: tests/reliability/launch.py == dflash-flow.
    cmd = [str(Path(__file__).resolve().parents[1] / "reliability" / "launch.py")] if faulty else ["-m", "dflash_flow.cli"]
    return subprocess.run([sys.executable, *cmd, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def _client(tmp: Path):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{tmp}/mlflow.db")


def test_run_writes_mlflow_checkpoint_export_and_eval(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path)
    proc = _run(["run", str(pipeline)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "acceptance length" in proc.stderr  # printed by the evaluation
    # ... and how to serve the export: num_speculative_tokens = B - 1 for vLLM, B draft tokens for SGLang
    assert '"num_speculative_tokens": 3}' in proc.stderr and "--speculative-num-draft-tokens 4" in proc.stderr

    out = tmp_path / "out"
    # the export inference engines load
    config = json.loads((out / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] >= 0
    assert (out / "drafter" / "model.safetensors").is_file()
    # checkpoints: the last two kept, each complete
    ckpts = sorted((out / "checkpoints").glob("step-*"))
    assert 1 <= len(ckpts) <= 2
    assert all((c / "MANIFEST.json").is_file() for c in ckpts)
    # Each records the run's lineage (what it may prune) and the sha256 of the data it trained on.
    import hashlib

    states = [json.loads((c / "state.json").read_text()) for c in ckpts]
    data = tmp_path / "data.jsonl"
    assert all(st["data_files"] == {str(data): hashlib.sha256(data.read_bytes()).hexdigest()} for st in states)
    assert len({st["run_uid"] for st in states}) == 1 and states[0]["run_uid"]
    # The run lock is released: another run on this output directory could start now.
    import fcntl

    with open(out / ".dflash-flow.lock", "rb+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)

    client = _client(tmp_path)
    exp = client.get_experiment_by_name("e2e")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["stages.padder.type"] == "Padder"  # keyed by stage name, not position
    assert run.data.params["stages.padder.pad_to_multiple"] == "1"  # a default the pipeline never wrote
    assert run.data.params["stages.evaluate.max_new_tokens"] == "12"
    assert run.data.params["seed"] == "3"
    assert {"git_commit", "config_hash", "world_size", "device_summary"} <= set(run.data.tags) or "config_hash" in run.data.tags
    steps_logged = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    n_batches = len((out / "batches.jsonl").read_text().splitlines())
    assert steps_logged == list(range(1, n_batches + 1))
    # Every trained step's length bucket, and the lengths each bucket holds (the bucket-mix plot's legend).
    history = json.loads((out / "monitor" / "history.json").read_text())
    assert [s for s, _ in history["trained_buckets"]] == steps_logged
    assert set(history["bucket_ranges"]) == {str(b) for _, b in history["trained_buckets"]}
    assert all(1 <= lo <= hi <= 128 for lo, hi in history["bucket_ranges"].values())
    for key in ("eval/trained/tau", "eval/untrained/tau"):
        assert client.get_metric_history(run.info.run_id, key), key
    # Settings and facts are tags, never curves: no metric named after one.
    assert not [k for k in run.data.metrics if k.rsplit("/", 1)[-1] in ("lossless", "max_new_tokens", "num_prompts")]
    assert run.data.tags["eval/trained/lossless"] == "True" and run.data.tags["eval/trained/max_new_tokens"] == "12"
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config", "dag", "plots", "drafter", "summary.json", "monitor"} <= names
    plots = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/loss.png" in plots and "plots/queue_depths.png" in plots

    # `dflash-flow export` turns the latest training checkpoint into the same layout
    exported = tmp_path / "exported"
    proc = _run(["export", str(out / "checkpoints"), str(exported)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "vllm serve " in proc.stdout and "TARGET" not in proc.stdout  # the run's target, from its YAML
    from dflash_flow.model.export import load_drafter

    drafter = load_drafter(exported)
    assert drafter.block_size == 4


def test_failed_stage_marks_run_failed_and_names_stage(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, fail_stage=True)
    proc = _run(["run", str(pipeline)], tmp_path, faulty=True)
    assert proc.returncode == 1
    assert "stage 'drafter' replica 0 failed" in proc.stderr
    assert "Original traceback" in proc.stderr
    run = _client(tmp_path).search_runs([_client(tmp_path).get_experiment_by_name("e2e").experiment_id])[0]
    assert run.info.status == "FAILED"
