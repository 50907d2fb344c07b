"""The model facts are declared once (``model:``), resolved into one ``ModelSpec`` every stage reads, and checked
before anything runs: exit 2, the file and line of the value to change, no traceback. An old pipeline that still
sets a moved field in a stage gets one message per field saying where it moved (issue 35, item 1)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import yaml
from typer.testing import CliRunner

from dflash_flow.cli import app

TARGET = "tiny-qwen3-8l"  # 8 layers, hidden 64, vocabulary 512
TIMES: dict[str, float] = {}


def _pipeline(data: Path, *, model: dict | None = None, target: dict | None = None, drafter: dict | None = None,
              evaluate: dict | None = None, source: dict | None = None) -> dict:
    doc = {"name": "mismatch", "output_dir": "out", "tracking": {"enabled": False}, "stages": [
        {"name": "source", "type": "TokenizedSource", "config": {"paths": [str(data)], **(source or {})}},
        {"name": "bucketer", "type": "Bucketer", "inputs": ["source"], "config": {"max_tokens": 4096}},
        {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"]},
        {"name": "padder", "type": "Padder", "inputs": ["interleaver"]},
        {"name": "target", "type": "TargetForward", "inputs": ["padder"], "config": dict(target or {})},
        {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "config": dict(drafter or {})},
        {"name": "evaluate", "type": "SpecDecodeEval", "inputs": ["drafter"],
         "config": {"prompts": str(data), "limit": 1, **(evaluate or {})}},
    ]}
    if model is not None:
        doc["model"] = model
    return doc


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "tokens.jsonl"
    path.write_text(json.dumps({"input_ids": list(range(1, 17)), "loss_mask": [0] * 4 + [1] * 12}) + "\n")
    return path


def _validate(tmp_path: Path, doc: dict, *args: str):
    file = tmp_path / "pipeline.yaml"
    file.write_text(yaml.safe_dump(doc, sort_keys=False))
    t0 = time.perf_counter()
    result = CliRunner().invoke(app, ["validate", str(file), *args])
    TIMES[doc["name"]] = time.perf_counter() - t0
    text = result.output + (result.stderr if result.stderr_bytes is not None else "")
    return result.exit_code, text, file


def _line_of(file: Path, needle: str, after: str | None = None) -> int:
    lines = file.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line) if after else 0
    return next(i for i, line in enumerate(lines) if i >= start and needle in line) + 1


def _located(code: int, text: str, file: Path, line: int, *needles: str) -> None:
    assert code == 2, text
    assert "Traceback" not in text, text
    assert f"{file}:{line}," in text, text
    for n in needles:
        assert n in text, text


def test_the_model_section_resolves_into_one_spec_the_stages_read(tmp_path, data):
    doc = _pipeline(data, model={"target": TARGET, "num_draft_layers": 2, "block_size": 4, "mask_token_id": 511})
    code, text, _ = _validate(tmp_path, doc)
    assert code == 0, text
    from dflash_flow.app import load, model_services

    v = load(tmp_path / "pipeline.yaml", check_devices=False)
    spec = model_services(v).model
    assert (spec.target, spec.num_draft_layers, spec.block_size, spec.mask_token_id) == (TARGET, 2, 4, 511)
    assert spec.layer_ids() == [1, 5] and (spec.facts.depth, spec.facts.hidden_size) == (8, 64)
    for name in ("target", "drafter", "evaluate"):  # no stage keeps a copy of a model fact
        assert not {"target", "num_layers", "num_draft_layers", "block_size"} & set(attrs.asdict(v.configs[name]))


def test_an_old_pipeline_gets_one_message_per_moved_field(tmp_path, data):
    doc = _pipeline(data, target={"target": TARGET, "num_draft_layers": 3}, drafter={"target": TARGET, "num_layers": 2},
                    evaluate={"target": TARGET})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "num_layers: 2"), "'num_layers' moved to model.num_draft_layers")
    for needle, path in (("num_draft_layers: 3", "model.num_draft_layers"), ("target: tiny-qwen3-8l", "model.target")):
        assert f"{file}:{_line_of(file, needle)}," in text and f"moved to {path}" in text, text
    assert len({line for line in text.splitlines() if "moved to model.target" in line}) == 3, text  # each stage named
    assert "unknown" not in text  # the moved field is not also reported as unknown


def test_target_split_wider_than_its_layers_is_found_from_the_spec(tmp_path, data):
    doc = _pipeline(data, model={"target": TARGET, "target_layer_ids": [0, 1]})
    doc["stages"][4]["devices"] = [["cpu", "cpu", "cpu"]]
    code, text, file = _validate(tmp_path, doc, "--no-path-check")
    _located(code, text, file, _line_of(file, "devices"), "a replica spans 3 devices but the target runs only 2")


def test_a_stage_that_needs_the_target_when_none_is_declared(tmp_path, data):
    code, text, file = _validate(tmp_path, _pipeline(data))
    assert code == 2 and "Traceback" not in text, text
    for stage in ("target", "drafter", "evaluate"):
        assert f"stage '{stage}', field 'model.target'" in text, text
    assert "set model.target" in text


def test_layer_ids_beyond_the_target_depth(tmp_path, data):
    doc = _pipeline(data, model={"target": TARGET, "target_layer_ids": [1, 9]})
    code, text, file = _validate(tmp_path, doc, "--no-path-check")
    # The value lives in the model: section, so that is the line to change.
    _located(code, text, file, _line_of(file, "target_layer_ids"), "target layer 9 does not exist", "8 decoder layers")


def test_mask_token_and_source_vocabulary_outside_the_target_vocabulary(tmp_path, data):
    doc = _pipeline(data, model={"target": TARGET, "mask_token_id": 600}, source={"vocab_size": 1000})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "mask_token_id: 600"), "outside the target's vocabulary of 512")
    assert f"{file}:{_line_of(file, 'vocab_size: 1000')}," in text and "vocab_size 1000 admits token ids" in text


def test_drafter_to_start_from_made_for_another_target(tmp_path, data):
    init = tmp_path / "old-drafter"
    init.mkdir()
    (init / "config.json").write_text(json.dumps({"hidden_size": 96, "dflash_config": {"block_size": 8}}))
    doc = _pipeline(data, model={"target": TARGET, "block_size": 4}, drafter={"init_from": str(init)})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "init_from"), "has hidden_size 96, the target 64")
    assert f"{file}:{_line_of(file, 'block_size: 4')}," in text and "made with block_size 8" in text


def test_missing_files_and_directories_unless_validating_elsewhere(tmp_path, data):
    doc = _pipeline(data, model={"target": str(tmp_path / "no-such-model")}, source={"paths": [str(tmp_path / "gone.jsonl")]})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "gone.jsonl"), "gone.jsonl: no such file")
    assert f"{file}:{_line_of(file, 'no-such-model')}," in text and "is not a directory here" in text
    for opt in ("--no-path-check", "--no-device-check"):
        assert _validate(tmp_path, doc, opt)[0] == 0


def test_through_the_real_cli_one_line_per_problem_no_traceback(tmp_path, data):
    doc = _pipeline(data, target={"target": TARGET, "num_draft_layers": 3}, drafter={"target": TARGET, "num_layers": 2},
                    evaluate={"target": "embedded"})  # an old pipeline: where each field moved
    file = tmp_path / "p.yaml"
    file.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "dflash_flow.cli", "validate", str(file)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"{file}:" in proc.stderr and "model.target" in proc.stderr


def test_a_checkpoint_written_before_the_move_reads_its_settings_as_todays(tmp_path, data):
    """Settings recorded by a checkpoint when the stages still held the model facts (``stages.drafter.target``,
    ``stages.drafter.num_layers``, ...) compare as ``model.*`` today: the same run resumes, another is named."""
    from dflash_flow.app import load
    from dflash_flow.core.identity import (
        moved_setting_keys,
        recorded_as_today,
        result_settings,
        settings_differences,
    )

    doc = _pipeline(data, model={"target": TARGET, "num_draft_layers": 2, "block_size": 4})
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    graph = load(tmp_path / "p.yaml", check_devices=False).graph
    now = result_settings(graph)
    assert now["model.target"] == TARGET and now["model.num_draft_layers"] == 2 and "model.trust_remote_code" not in now
    old = {k: v for k, v in now.items() if not k.startswith("model.")}
    old.update({"stages.target.target": TARGET, "stages.target.num_draft_layers": 2, "stages.target.trust_remote_code":
                False, "stages.drafter.target": TARGET, "stages.drafter.num_layers": 2, "stages.drafter.block_size": 4,
                "stages.drafter.mask_token_id": None, "stages.drafter.target_layer_ids": None,
                "stages.drafter.tokenizer": None, "stages.evaluate.target": TARGET})
    moved = moved_setting_keys(graph)
    assert moved["stages.drafter.num_layers"] == "model.num_draft_layers"
    assert settings_differences(recorded_as_today(old, moved, now), now) == []
    other = {**old, "stages.drafter.block_size": 8}
    assert settings_differences(recorded_as_today(other, moved, now), now) == [
        "model.block_size: 8 in the checkpoint, 4 now"]


def test_the_engine_and_feature_sections_are_checked_with_the_spec_at_their_lines(tmp_path, data):
    """model.engine without servers, the last layer (vLLM's id for it is the state before the final norm) and
    an offline store without a path: each one line at its key, before anything runs."""
    doc = _pipeline(data, model={"target": TARGET, "target_layer_ids": [1, 7], "engine": {"concurrency": 4},
                                 "features": {"mode": "offline"}})
    code, text, file = _validate(tmp_path, doc, "--no-path-check")
    assert code == 2 and "Traceback" not in text, text
    for needle, field, words in (("engine:", "model.engine.servers", "needs servers"),
                                 ("target_layer_ids", "model.target_layer_ids", "is the target's last layer"),
                                 ("features:", "model.features.path", "mode offline reads a store")):
        line = _line_of(file, needle)
        assert any(f"{file}:{line}, field '{field}'" in x and words in x for x in text.splitlines()), (field, text)
