"""A resume into another output directory is a fork (issue 23.5): it starts an MLflow run of its own, tagged
with its parent's run id and checkpoint, and leaves the parent's run -- FINISHED here -- as it was: no
metric logged again, no artifact overwritten, status unchanged. Only a resume in place (a checkpoint of the
run's own checkpoint directory) continues the checkpoint's run (tests/reliability/test_resume.py). A real
sqlite store read back through MlflowClient; in-process runs of the tiny real training pipeline."""

from __future__ import annotations

import hashlib
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from reltools import train_pipeline, write_tokenized, write_yaml

from dflash_flow.app import run
from dflash_flow.app.runner import PARENT_CHECKPOINT_TAG, PARENT_RUN_TAG

pytestmark = pytest.mark.timeout(300)

METRIC = "train/loss"


def _artifacts(client, run_id: str) -> dict[str, str]:
    """sha256 of every artifact file of the run (a local artifact store)."""
    root = Path(unquote(urlparse(client.get_run(run_id).info.artifact_uri).path))
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def _history(client, run_id: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, METRIC))


@pytest.mark.slow
def test_a_resume_into_another_output_dir_forks_a_new_run_and_leaves_the_parent_alone(tmp_path):
    from mlflow import MlflowClient

    data = write_tokenized(tmp_path / "data.jsonl", 32, seed=3)
    parent_doc = train_pipeline(tmp_path, data=data, output_dir=tmp_path / "parent")
    parent_doc["checkpoint"]["keep_last"] = 50
    parent = run(write_yaml(tmp_path / "parent.yaml", parent_doc))
    assert parent.ok, parent.error
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    before = {"status": client.get_run(parent.mlflow_run_id).info.status,
              "history": _history(client, parent.mlflow_run_id), "artifacts": _artifacts(client, parent.mlflow_run_id)}
    assert before["status"] == "FINISHED" and before["history"] and "summary.json" in before["artifacts"]

    ckpt = tmp_path / "parent" / "checkpoints" / "step-00000006"
    fork_doc = train_pipeline(tmp_path, data=data, output_dir=tmp_path / "fork")
    fork = run(write_yaml(tmp_path / "fork.yaml", fork_doc), resume=str(ckpt))
    assert fork.ok, fork.error
    assert fork.mlflow_run_id and fork.mlflow_run_id != parent.mlflow_run_id

    # The parent: as it was.
    assert client.get_run(parent.mlflow_run_id).info.status == "FINISHED"
    assert _history(client, parent.mlflow_run_id) == before["history"], "the fork logged into its parent's run"
    assert _artifacts(client, parent.mlflow_run_id) == before["artifacts"], "the fork overwrote its parent's artifacts"
    # The fork: its own run, tagged with where it came from, holding the steps it trained.
    forked = client.get_run(fork.mlflow_run_id)
    assert forked.info.status == "FINISHED"
    assert forked.data.tags[PARENT_RUN_TAG] == parent.mlflow_run_id
    assert forked.data.tags[PARENT_CHECKPOINT_TAG] == str(ckpt.resolve())
    steps = [s for s, _ in _history(client, fork.mlflow_run_id)]
    assert steps and min(steps) > 6, steps
    assert "summary.json" in _artifacts(client, fork.mlflow_run_id)
    # Its checkpoints record its own run, so resuming the fork in place continues the fork.
    from dflash_flow.app.checkpoint import Checkpointer

    assert Checkpointer(tmp_path / "fork" / "checkpoints").load("latest", check_config=False).mlflow_run_id == fork.mlflow_run_id


def test_a_checkpoint_copied_into_another_directory_is_not_that_directorys_own(tmp_path):
    import shutil

    import torch

    from dflash_flow.app.checkpoint import Checkpointer

    ck = Checkpointer(tmp_path / "a", config_hash="h")
    ck.save(step=1, epoch=0, model_state={"w": torch.zeros(2)}, optimizer_state={"step": 1},
            data_position={"epoch": 0, "total": 1})
    assert ck.holds(ck.load("latest"))
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    b = Checkpointer(tmp_path / "b", config_hash="h")
    assert not b.holds(b.load("latest")), "a copied checkpoint would take over the original's MLflow run"
    assert not b.holds(ck.load("latest"))
