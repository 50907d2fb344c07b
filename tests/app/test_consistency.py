"""Cross-stage mismatches a new user made (issue 20): each is found by ``dflash-flow validate`` before anything
runs -- exit 2, the file and line of the value to change, no traceback -- in the old form (every stage names
the target and the drafter's depth) and the new one (``model:`` declares them once)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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


def test_the_new_form_validates_and_the_stages_get_the_model_section(tmp_path, data):
    doc = _pipeline(data, model={"target": TARGET, "num_draft_layers": 2, "block_size": 4, "mask_token_id": 511})
    code, text, _ = _validate(tmp_path, doc)
    assert code == 0, text
    import dflash_flow.app  # noqa: F401 - the model: section
    from dflash_flow.core import load_graph
    from dflash_flow.core.validate import validated

    v = validated(load_graph(tmp_path / "pipeline.yaml"), check_devices=False)
    assert v.configs["target"].target == v.configs["drafter"].target == v.configs["evaluate"].target == TARGET
    assert v.configs["target"].num_draft_layers == v.configs["drafter"].num_layers == 2
    assert (v.configs["drafter"].block_size, v.configs["drafter"].mask_token_id) == (4, 511)


def test_layer_count_mismatch(tmp_path, data):
    doc = _pipeline(data, target={"target": TARGET, "num_draft_layers": 3}, drafter={"target": TARGET, "num_layers": 2},
                    evaluate={"target": TARGET})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "num_layers: 2"), "emits target layers [1, 3, 5]", "fuses [1, 5]",
             "model.num_draft_layers")


def test_target_changed_in_one_stage_only(tmp_path, data):
    doc = _pipeline(data, target={"target": "tiny-qwen3-12l"}, drafter={"target": TARGET}, evaluate={"target": TARGET})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "target: tiny-qwen3-12l"), "uses target 'tiny-qwen3-12l'",
             "declare the target once, in model.target")
    assert "emits layers" not in text and "fuses" not in text  # no misleading layer message


def test_forgotten_evaluation_target(tmp_path, data):
    doc = _pipeline(data, target={"target": TARGET}, drafter={"target": TARGET}, evaluate={"target": "embedded"})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "target: embedded"), "stage 'evaluate' (SpecDecodeEval) uses target 'embedded'")


def test_a_stage_repeating_the_model_section_with_another_value(tmp_path, data):
    doc = _pipeline(data, model={"target": TARGET, "num_draft_layers": 2}, drafter={"num_layers": 3})
    code, text, file = _validate(tmp_path, doc)
    _located(code, text, file, _line_of(file, "num_layers: 3"), "declared once, in model.num_draft_layers")


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
                    evaluate={"target": "embedded"})
    file = tmp_path / "p.yaml"
    file.write_text(yaml.safe_dump(doc, sort_keys=False))
    proc = subprocess.run([sys.executable, "-m", "dflash_flow.cli", "validate", str(file)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and f"{file}:" in proc.stderr and "model.target" in proc.stderr
