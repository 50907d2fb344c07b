"""The other commands and files a newcomer touches: the multi-GPU recipe validates without GPUs, the
examples run, `regenerate` and `eval` work from the command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str, cwd: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_flow.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_qwen3_8b_recipe_validates_without_gpus(tmp_path: Path) -> None:
    ok = _cli("validate", str(REPO / "pipelines" / "qwen3-8b.yaml"), "--no-device-check", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    # With device checks on, a machine without GPUs is told exactly which devices are missing.
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    bad = subprocess.run([sys.executable, "-m", "dflash_flow.cli", "validate", str(REPO / "pipelines" / "qwen3-8b.yaml")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 2
    assert "stage 'drafter', field 'devices': device cuda:6" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_two_ranks_per_node_recipe_validates_for_any_node_count(tmp_path: Path) -> None:
    recipe = str(REPO / "pipelines" / "qwen3-8b-2x4.yaml")
    assert _cli("validate", recipe, "--no-device-check", cwd=tmp_path).returncode == 0
    # 2 ranks on an 8-GPU node: each rank's cuda:0-3 are its own 4 GPUs (the file never names GPU 4-7)
    ok = _cli("validate", recipe, "--nproc", "2", "--gpus", "8", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    # 4 ranks on the same node would share GPUs: refused, located at the slice setting
    shared = _cli("validate", recipe, "--nproc", "4", "--gpus", "8", cwd=tmp_path)
    assert shared.returncode == 2 and "ranks would share GPUs" in shared.stderr
    assert "qwen3-8b-2x4.yaml:" in shared.stderr and "Traceback" not in shared.stderr
    # --gpus simulates the devices: the placement is checked even with --no-device-check
    again = _cli("validate", recipe, "--nproc", "4", "--gpus", "8", "--no-device-check", cwd=tmp_path)
    assert again.returncode == 2 and "ranks would share GPUs" in again.stderr


def test_default_pipeline_validates_and_draws(tmp_path: Path) -> None:
    assert _cli("validate", str(REPO / "pipelines" / "dflash.yaml"), cwd=tmp_path).returncode == 0
    mermaid = _cli("graph", str(REPO / "pipelines" / "dflash.yaml"), cwd=tmp_path).stdout
    assert "s_padder -->|round_robin cap 4| s_target" in mermaid


@pytest.mark.slow
def test_examples_run(tmp_path: Path) -> None:
    compose = subprocess.run([sys.executable, str(REPO / "examples" / "compose.py")], cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
    assert compose.returncode == 0, compose.stderr
    assert "work" in compose.stdout and "busy" in compose.stdout
    custom = subprocess.run([sys.executable, str(REPO / "examples" / "custom_stage" / "run.py")], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert custom.returncode == 0, custom.stderr
    assert "sink consumed 100 items" in custom.stdout


@pytest.mark.slow
def test_regenerate_and_eval_commands(tmp_path: Path) -> None:
    from dflash_flow.embedded import embedded_target_path
    from dflash_flow.embedded import write_eval_prompts as write_embedded_eval_prompts

    target = embedded_target_path()
    prompts = write_embedded_eval_prompts(tmp_path / "prompts.jsonl", 3)
    out = tmp_path / "regen.jsonl"
    proc = _cli("regenerate", str(prompts), "--target", target, "--out", str(out), "--batch-size", "2",
                "--max-new-tokens", "8", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 3
    assert all(r["conversations"][-1]["role"] == "assistant" and r["conversations"][-1]["content"] for r in rows)
    # A second call resumes: nothing left to generate, same file.
    before = out.read_bytes()
    again = _cli("regenerate", str(prompts), "--target", target, "--out", str(out), "--max-new-tokens", "8", cwd=tmp_path)
    assert again.returncode == 0 and out.read_bytes() == before

    # eval: an untrained drafter of the target's shape, exported, then measured against the target.
    import torch

    from dflash_flow.model.drafter import DFlashDrafter
    from dflash_flow.model.drafter_config import make_drafter_config
    from dflash_flow.model.export import save_drafter
    from dflash_flow.model.target import load_target

    model = load_target(target, dtype=torch.float32)
    torch.manual_seed(0)
    drafter = DFlashDrafter(make_drafter_config(model.config, num_layers=1, block_size=4, mask_token_id=0))
    save_drafter(drafter, tmp_path / "drafter")
    ev = _cli("eval", "--drafter", str(tmp_path / "drafter"), "--target", target, "--prompts", str(prompts),
              "--limit", "2", "--max-new-tokens", "8", cwd=tmp_path)
    assert ev.returncode == 0, ev.stderr
    assert "acceptance_length" in ev.stdout and "trained" in ev.stdout and "untrained" in ev.stdout
    missing = _cli("eval", "--drafter", str(tmp_path / "nope"), "--target", target, "--prompts", str(prompts), cwd=tmp_path)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
