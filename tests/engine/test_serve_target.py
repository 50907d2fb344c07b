"""`dflash-flow serve-target PIPELINE`: one line on stdout, the exact vLLM server command for the pipeline's
target (its layers mapped, chunked prefill off, our connector writing into model.engine.features_dir); a target
that cannot be served is one error line. (interop/engine_target_check.py starts a real vLLM from this line.)"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import yaml
from typer.testing import CliRunner

from dflash_flow.cli import app

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str):
    return CliRunner().invoke(app, ["serve-target", *args])


def _argv(line: str) -> tuple[dict, list[str]]:
    words = shlex.split(line)
    env = {}
    while "=" in words[0] and not words[0].startswith("-"):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return env, words


def _opt(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_printed_line_is_the_whole_server_command(tmp_path):
    res = run(str(ROOT / "pipelines" / "dflash1.yaml"), "--tp", "2", "--port", "8001", "--python", "/opt/vllm/bin/python")
    assert res.exit_code == 0, res.output
    lines = res.stdout.strip().splitlines()
    assert len(lines) == 1  # notes go to stderr: `$(dflash-flow serve-target p.yaml)` is the command
    env, argv = _argv(lines[0])
    assert argv[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert Path(env["PYTHONPATH"], "dflash_flow", "engine", "vllm_connector.py").is_file()
    assert _opt(argv, "--model").endswith("embedded/assets/target")
    assert _opt(argv, "--tensor-parallel-size") == "2" and _opt(argv, "--port") == "8001"
    assert "--no-enable-chunked-prefill" in argv and "--no-enable-prefix-caching" in argv
    spec = json.loads(_opt(argv, "--speculative-config"))
    assert spec["method"] == "extract_hidden_states"
    # dflash1.yaml: 2 draft layers over the embedded target's 8 -> ours [1, 5] -> vLLM [2, 6]
    assert spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 6]
    kv = json.loads(_opt(argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "DFlashHiddenStatesConnector"
    assert kv["kv_connector_module_path"] == "dflash_flow.engine.vllm_connector"
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/dev/shm/dflash-flow-features"
    assert "ours) -> vLLM [2, 6]" in res.stderr


def _pipeline(tmp_path: Path, model: dict) -> Path:
    doc = yaml.safe_load((ROOT / "pipelines" / "dflash1.yaml").read_text())
    doc["model"].update(model)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def test_the_engine_section_sets_the_directory_dtype_and_key_but_never_prints_a_secret(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_VLLM_KEY", "s3cret-value")
    path = _pipeline(tmp_path, {"engine": {"servers": ["http://gpu1:8000"], "features_dir": "/mnt/feats/run1",
                                           "path_map": {"/shared": "/mnt"}, "api_key_env": "MY_VLLM_KEY",
                                           "prefix_caching": True, "launch": {"dtype": "bfloat16"}}})
    res = run(str(path))
    assert res.exit_code == 0, res.output
    line = res.stdout.strip()
    assert "s3cret" not in res.output
    assert 'VLLM_API_KEY="${MY_VLLM_KEY}"' in line
    _, argv = _argv(line)
    kv = json.loads(_opt(argv, "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"]["shared_storage_path"] == "/shared/feats/run1"  # as the servers see it
    assert _opt(argv, "--dtype") == "bfloat16" and "--enable-prefix-caching" in argv


def test_a_preset_or_the_last_layer_is_one_error_line(tmp_path):
    import sys

    sys.path.insert(0, str(ROOT / "tests" / "reliability"))
    from reltools import train_pipeline, write_tokenized, write_yaml

    data = write_tokenized(tmp_path / "d.jsonl", 4)
    preset = write_yaml(tmp_path / "preset.yaml", train_pipeline(tmp_path, data=data, output_dir=tmp_path / "o"))
    res = run(str(preset))
    assert res.exit_code == 2 and "is a preset" in res.stderr and res.stdout == ""
    res = run(str(_pipeline(tmp_path, {"target_layer_ids": [1, 7], "num_draft_layers": 2})))
    assert res.exit_code == 2
    assert "last layer" in res.stderr and len(res.stderr.strip().splitlines()) == 1
