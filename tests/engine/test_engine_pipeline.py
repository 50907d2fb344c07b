"""A real `dflash-flow run` fed by an engine (model.engine: a fake vLLM server in its own process serving the
tiny-qwen3-8l preset's real hidden states through our feature files) trains what the in-process run trains,
and, SIGKILLed mid-run and resumed, trains exactly the same batches to the same weights.

The pipeline is the reliability tests' (TokenizedSource -> ... -> TargetForward x2 -> DrafterStep -> Monitor,
checkpoints every 2 steps, every trained batch logged to OUTPUT/batches.jsonl)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "reliability"))
from reltools import (  # noqa: E402
    cli,
    count_complete_lines,
    finish,
    kill_hard,
    load_weights,
    read_lines,
    start_cli,
    train_pipeline,
    write_tokenized,
    write_yaml,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # three CLI runs: ~40 s idle, minutes on a busy box

N_SAMPLES = 24  # one epoch: about 7 batches


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine-run")
    features = root / "features"
    features.mkdir()
    port_file = root / "port"
    # tiny-qwen3-8l, one draft layer: our layer [4] is vLLM's 5; hidden size 64
    proc = subprocess.Popen([sys.executable, str(HERE / "fake_vllm_server.py"), "--port-file", str(port_file),
                             "--dir", str(features), "--layers", "5", "--hidden", "64", "--target", "tiny-qwen3-8l",
                             "--log", str(root / "fake.log")])
    deadline = time.monotonic() + 120
    while not port_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.02)
    data = write_tokenized(root / "data.jsonl", N_SAMPLES, seed=5)
    engine = {"engine": {"servers": [f"http://127.0.0.1:{port_file.read_text()}"], "features_dir": str(features),
                         "check_samples": 2}}
    yield {"root": root, "data": data, "engine": engine, "features": features}
    proc.kill()
    proc.wait(timeout=60)


def _pipeline(world, name: str, model: dict) -> tuple[Path, Path]:
    out = world["root"] / name
    doc = train_pipeline(world["root"], data=world["data"], output_dir=out, tracking=False, epochs=1, model=model)
    return out, write_yaml(world["root"] / f"{name}.yaml", doc)


def test_an_engine_fed_run_killed_and_resumed_trains_the_in_process_batches_and_weights(world):
    import torch

    root = world["root"]
    ref_out, ref_path = _pipeline(world, "inproc", {})
    res = cli(["run", ref_path], cwd=root, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    reference = read_lines(ref_out / "batches.jsonl")
    assert len(reference) >= 6

    out, path = _pipeline(world, "engine", world["engine"])
    proc = start_cli(["run", path], cwd=root, log=root / "first.log")
    deadline = time.monotonic() + 300
    while count_complete_lines(out / "batches.jsonl") < 3:  # killed after its first checkpoint (step 2)
        assert proc.poll() is None, (root / "first.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "the engine-fed run did not train 3 batches"
        time.sleep(0.005)
    kill_hard(proc)
    log = (root / "first.log").read_text()
    assert "engine features equal transformers' on 2 samples" in log, log[-3000:]
    before = read_lines(out / "batches.jsonl")
    ckdir = out / "checkpoints"
    state = json.loads((ckdir / (ckdir / "latest").read_text().strip() / "state.json").read_text())
    total = state["data_position"]["total"]
    assert 2 <= total <= len(before)

    proc = start_cli(["run", path, "--resume", "latest"], cwd=root, log=root / "resume.log")
    assert finish(proc, 300) == 0, (root / "resume.log").read_text()[-3000:]
    after = read_lines(out / "batches.jsonl")[len(before):]
    assert before[:total] + after == reference  # nothing skipped, nothing repeated, in the plan's order
    ref_w, got = load_weights(ref_out / "drafter" / "model.safetensors"), load_weights(out / "drafter" / "model.safetensors")
    assert set(ref_w) == set(got)
    for k in ref_w:  # the engine's features are the target's own (per sample, unpadded: within rounding)
        assert torch.allclose(got[k], ref_w[k], atol=1e-5, rtol=0), k
