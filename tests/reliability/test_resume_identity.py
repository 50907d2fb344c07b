"""What a resume must match (issue 23.14, 22.6): only the settings that can change the trained weights or
the data order. A resume onto fewer target replicas (a GPU lost), with other thread counts, queue sizes or
Monitor settings, is accepted and trains bit for bit what the uninterrupted run trained; a changed learning
rate is refused, naming the field with both values. (Other intra-op thread counts are accepted too: the
same computation, rounded differently inside a kernel.) In-process runs of the real training pipeline
(tiny-qwen3-8l, 32 samples, 2 epochs: 19 steps, a checkpoint every 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from reltools import load_weights, read_lines, train_pipeline, write_tokenized, write_yaml

from dflash_flow.app import run

pytestmark = pytest.mark.timeout(300)

RESUME_AT = "step-00000006"


def _doc(root: Path, data: Path, out: Path, **kw) -> dict:
    doc = train_pipeline(root, data=data, output_dir=out, tracking=False, **kw)
    doc["checkpoint"]["keep_last"] = 50  # every checkpoint of the reference stays: resume points
    return doc


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("identity")
    data = write_tokenized(root / "data.jsonl", 32, seed=3)
    out = root / "reference"
    report = run(write_yaml(root / "reference.yaml", _doc(root, data, out)))
    assert report.ok, report.error
    assert (out / "checkpoints" / RESUME_AT).is_dir()
    return {"root": root, "data": data, "out": out, "batches": read_lines(out / "batches.jsonl")}


def _stage(doc: dict, name: str) -> dict:
    return next(s for s in doc["stages"] if s["name"] == name)


def _resume(reference, out: Path, doc: dict) -> dict:
    ckpt = reference["out"] / "checkpoints" / RESUME_AT
    report = run(write_yaml(out.parent / f"{out.name}.yaml", doc), resume=str(ckpt))
    assert report.ok, report.error
    total = json.loads((ckpt / "state.json").read_text())["data_position"]["total"]
    assert read_lines(out / "batches.jsonl") == reference["batches"][total:], "the resumed run trained other batches"
    ref, got = load_weights(reference["out"] / "drafter" / "model.safetensors"), load_weights(out / "drafter" / "model.safetensors")
    assert set(ref) == set(got)
    return {k: (ref[k], got[k]) for k in ref}


def test_a_resume_onto_fewer_replicas_other_queues_and_monitor_is_accepted_and_bit_exact(reference, tmp_path):
    import torch

    out = tmp_path / "resumed"
    doc = _doc(reference["root"], reference["data"], out)
    doc["runtime"]["capacity"] = 5
    _stage(doc, "target")["replicas"] = 1  # a GPU lost
    _stage(doc, "target")["capacity"] = 1
    _stage(doc, "padder")["replicas"] = 1
    _stage(doc, "monitor")["config"].update(interval_s=0.2, progress=True, progress_interval_s=0.3)
    doc["checkpoint"]["every_steps"] = 3
    for k, (ref, got) in _resume(reference, out, doc).items():
        assert torch.equal(ref, got), f"weight {k} differs after the resume"


def test_a_resume_with_other_thread_counts_is_accepted(reference, tmp_path):
    """The same computation; only the order of float additions inside a kernel changes with the number of
    intra-op threads (about 1e-8 here): equal up to that rounding, not bit for bit."""
    import torch

    out = tmp_path / "threads"
    doc = _doc(reference["root"], reference["data"], out)
    _stage(doc, "target")["config"]["torch_threads"] = 2
    _stage(doc, "drafter")["config"]["torch_threads"] = 2
    for k, (ref, got) in _resume(reference, out, doc).items():
        assert torch.allclose(ref, got, rtol=0, atol=1e-6), f"weight {k} differs after the resume"


def test_a_changed_learning_rate_or_seed_is_refused_naming_each_field_with_both_values(reference, tmp_path, capsys):
    out = tmp_path / "refused"
    doc = _doc(reference["root"], reference["data"], out, overrides={"drafter": {"lr": 1e-3}})
    doc["seed"] = 8
    report = run(write_yaml(tmp_path / "lr.yaml", doc), resume=str(reference["out"] / "checkpoints"))
    assert report.exit_code == 2 and report.status == "FAILED"
    assert "seed: 7 in the checkpoint, 8 now; stages.drafter.lr: 0.0006 in the checkpoint, 0.001 now" in report.error
    assert "drop --resume" in report.error
    assert "torch_threads" not in report.error and "capacity" not in report.error
    assert not (out / "batches.jsonl").exists(), "nothing may train from a refused checkpoint"
    err = capsys.readouterr().err
    assert "stages.drafter.lr: 0.0006 in the checkpoint, 0.001 now" in err and "Traceback" not in err


def test_a_checkpoint_without_recorded_settings_resumes_when_its_hash_matches_and_else_says_why(reference, tmp_path):
    """A checkpoint written before they recorded their settings carries only the old hash."""
    import shutil

    from dflash_flow.app.checkpoint import Checkpointer
    from dflash_flow.app.prepare import legacy_config_hash
    from dflash_flow.app.runner import load
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.util import sha256_file

    old = tmp_path / "old" / RESUME_AT
    shutil.copytree(reference["out"] / "checkpoints" / RESUME_AT, old)
    state = json.loads((old / "state.json").read_text())
    del state["settings"]
    v = load(reference["root"] / "reference.yaml")
    state["config_hash"] = legacy_config_hash(v.graph)
    (old / "state.json").write_text(json.dumps(state))
    manifest = json.loads((old / "MANIFEST.json").read_text())
    manifest["state.json"] = sha256_file(old / "state.json")
    (old / "MANIFEST.json").write_text(json.dumps(manifest))

    from dflash_flow.app.prepare import resume_config_hash
    from dflash_flow.core.identity import result_settings

    same = Checkpointer(tmp_path / "x", config_hash=resume_config_hash(v.graph), settings=result_settings(v.graph),
                        legacy_hash=legacy_config_hash(v.graph))
    assert same.load(old).step == 6
    other = load(reference["root"] / "reference.yaml", overrides=["stages.drafter.lr=0.001"]).graph
    ck = Checkpointer(tmp_path / "x", config_hash=resume_config_hash(other), settings=result_settings(other),
                      legacy_hash=legacy_config_hash(other))
    with pytest.raises(CheckpointError, match="predates checkpoints that record their settings.*drop --resume"):
        ck.load(old)
