"""The embedded DFlash recipe as a newcomer runs it: `dflash-flow run pipelines/dflash1.yaml`, shortened
with overrides (the default, pipelines/dflash.yaml, a DFlash 2 drafter: tests/model/test_dflash2.py). Checks the checkpoint, the MLflow run, the printed acceptance length, and that z-lab's
inference code loads the exported drafter and decodes exactly what ours does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_default_pipeline_shortened(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "dflash_flow.cli", "run", str(REPO / "pipelines" / "dflash1.yaml"),
        "--set", f"output_dir={out}",
        "--set", f"tracking.tracking_uri=sqlite:///{tmp_path}/mlflow.db",
        "--set", "stages.interleaver.max_batches=12",
        "--set", "stages.evaluate.limit=4",
        "--set", "stages.evaluate.max_new_tokens=24",
        "--set", "stages.evaluate.temperatures=[0.0]",
        "--set", "stages.evaluate.baseline=true",
        "--set", "stages.evaluate.walk_limit=4",
        "--set", "stages.evaluate.walk_horizons=[24,96]",
        "--set", "stages.monitor.interval_s=1",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    accept = re.findall(r"speculative decoding \((trained|untrained) drafter\): acceptance length ([0-9.]+)", proc.stderr)
    assert {name for name, _ in accept} == {"trained", "untrained"}
    assert all(float(v) >= 1.0 for _, v in accept)

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = client.get_experiment_by_name("dflash-flow")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["stages.padder.replicas"] == "2"  # the Padder's two workers, keyed by stage name
    assert len(client.get_metric_history(run.info.run_id, "train/loss")) == 12
    assert run.data.tags["eval/trained/lossless"] == "True" and "eval/trained/lossless" not in run.data.metrics
    assert (out / "checkpoints" / "latest").is_file()
    # The walk at its own horizons (longer than real decoding's, which is the expensive one).
    metrics = run.data.metrics
    assert {"eval/walk/tau_h24", "eval/walk/tau_h96"} <= set(metrics), sorted(metrics)
    assert "eval/trained/tau_h96" not in metrics

    # z-lab's inference code loads the export and decodes exactly what our speculative decoder does.
    from dflash.model import DFlashDraftModel
    from transformers import AutoTokenizer

    from dflash_flow.data.chat import stop_token_ids as stop_ids
    from dflash_flow.embedded import embedded_target_path
    from dflash_flow.model.evaluation import read_prompt_ids
    from dflash_flow.model.generation import spec_generate
    from dflash_flow.model.target import load_target

    target_dir = embedded_target_path()
    target = load_target(target_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    theirs = DFlashDraftModel.from_pretrained(out / "drafter", dtype=torch.float32).eval()
    from dflash_flow.model.export import load_drafter

    ours = load_drafter(out / "drafter").eval()
    for prompt in read_prompt_ids(out / "eval_prompts.jsonl", tok, 2):
        ids = torch.tensor([prompt])
        want = spec_generate(target, ours, ids, max_new_tokens=24, stop_token_ids=stop_ids(tok)).output_ids
        got = theirs.spec_generate(target, ids, max_new_tokens=24, stop_token_ids=stop_ids(tok))
        assert torch.equal(got[:, : want.shape[1]], want)
