"""Security: YAML parsed safely, stage types only from the registry, trust_remote_code off unless asked,
checkpoints never unpickle code, and no path in a YAML makes the run write outside its output directory."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs
import pytest

from dflash_flow.core import ConfigError, load_graph_text, registry
from dflash_flow.core.errors import CheckpointError
from dflash_flow.core.validate import validate

EVIL_YAML = """
name: evil
seed: !!python/object/apply:os.system ["touch {marker}"]
stages:
  - {{name: source, type: Range}}
  - {{name: sink, type: Discard, inputs: [source]}}
"""


def test_yaml_python_tags_are_rejected_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(ConfigError) as info:
        load_graph_text(EVIL_YAML.format(marker=marker), "evil.yaml")
    assert "YAML tags that build Python objects are not allowed" in str(info.value)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["os:system", "os.path:join", "dflash_flow.stages.generic:Range", "builtins.eval"])
def test_a_yaml_cannot_name_a_module_as_stage_type(name):
    with pytest.raises(registry.UnknownStageType):
        registry.resolve(name)
    g = load_graph_text(f"stages:\n  - {{name: s, type: '{name}'}}\n", "x.yaml")
    assert any("unknown stage type" in p.message for p in validate(g, check_devices=False))


def test_trust_remote_code_is_off_by_default_everywhere():
    import dflash_flow.app  # noqa: F401 - registers the model: section
    from dflash_flow.core.graph import registered_sections
    from dflash_flow.model.spec import ModelSpec

    # Declared once, in model: (and the spec every stage reads); no stage has a copy of it.
    assert attrs.fields_dict(registered_sections()["model"])["trust_remote_code"].default is False
    assert ModelSpec().trust_remote_code is False
    for name in registry.available():
        cls = registry.resolve(name)
        for f in attrs.fields(cls):
            if f.name == "trust_remote_code":
                assert f.default is False, f"{name}.trust_remote_code defaults to {f.default!r}"
    # And no library call in the package turns it on by itself.
    root = Path(__file__).resolve().parents[2] / "dflash_flow"
    offenders = [str(p) for p in root.rglob("*.py")
                 if "trust_remote_code=True" in p.read_text().replace("``trust_remote_code=True``", "")]
    assert offenders == []


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['DFLASH_EXPLOIT_MARKER']}",))


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_a_checkpoint_with_a_malicious_pickle_is_refused_not_executed(tmp_path, monkeypatch):
    import pickle

    import torch
    from safetensors.torch import save_file

    from dflash_flow.app.checkpoint_format import Expected, load_checkpoint

    marker = tmp_path / "pwned"
    monkeypatch.setenv("DFLASH_EXPLOIT_MARKER", str(marker))
    d = tmp_path / "step-00000001"
    d.mkdir()
    save_file({"w": torch.zeros(1)}, str(d / "model.safetensors"))
    with open(d / "optimizer.pt", "wb") as f:  # a pickle that runs a command when unpickled
        pickle.dump({"optimizer": _Exploit(), "scheduler": {}}, f, protocol=2)
    (d / "state.json").write_text(json.dumps({"format_version": 1, "step": 1, "epoch": 0, "config_hash": "x",
                                              "stage_states": {}}))
    (d / "MANIFEST.json").write_text(json.dumps({n: _sha(d / n) for n in ("model.safetensors", "optimizer.pt", "state.json")}))
    ck = load_checkpoint(d, expected=Expected("x"))  # the checksums are right: the content is hostile
    assert set(ck.model_state()) == {"w"}  # safetensors: tensors only
    with pytest.raises(CheckpointError) as info:
        ck.optimizer_state()  # torch.load(weights_only=True) refuses arbitrary globals
    # One line naming the checkpoint and the file (a resume ends with it, exit 2), not an unpickling traceback.
    assert str(info.value).startswith(f"not a valid checkpoint: {d}: optimizer.pt cannot be loaded safely")
    assert not marker.exists()


@pytest.mark.parametrize("value", ["../../etc", "/etc/dflash", "~/drafter", "a/../../b", ""])
def test_export_dir_cannot_leave_the_output_directory(value):
    text = f"""
stages:
  - {{name: source, type: TokenizedSource, config: {{paths: [d.jsonl]}}}}
  - {{name: bucketer, type: Bucketer, inputs: [source]}}
  - {{name: interleaver, type: Interleaver, inputs: [bucketer]}}
  - {{name: padder, type: Padder, inputs: [interleaver]}}
  - {{name: target, type: TargetForward, inputs: [padder]}}
  - {{name: drafter, type: DrafterStep, inputs: [target], config: {{export_dir: '{value}'}}}}
model: {{target: tiny-qwen3-8l}}
"""
    problems = validate(load_graph_text(text, "p.yaml"), check_devices=False)
    assert [p.field for p in problems] == ["export_dir"], [p.format() for p in problems]
    assert "inside output_dir" in problems[0].message


@pytest.mark.parametrize("value", ["drafter", "export/final", "./drafter"])
def test_export_dir_inside_the_output_directory_is_fine(value):
    text = f"""
stages:
  - {{name: source, type: TokenizedSource, config: {{paths: [d.jsonl]}}}}
  - {{name: bucketer, type: Bucketer, inputs: [source]}}
  - {{name: interleaver, type: Interleaver, inputs: [bucketer]}}
  - {{name: padder, type: Padder, inputs: [interleaver]}}
  - {{name: target, type: TargetForward, inputs: [padder]}}
  - {{name: drafter, type: DrafterStep, inputs: [target], config: {{export_dir: '{value}'}}}}
model: {{target: tiny-qwen3-8l}}
"""
    assert validate(load_graph_text(text, "p.yaml"), check_devices=False) == []


def test_stage_names_cannot_carry_paths():
    # Stage names become file and directory names (monitor output, metrics): no separators, no '..'.
    with pytest.raises(ConfigError) as info:
        load_graph_text("stages:\n  - {name: '../x', type: Range}\n", "p.yaml")
    assert "may contain only letters, digits" in str(info.value)
