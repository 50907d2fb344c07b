"""Acceptance over time in a real run of the embedded default (shortened, in this process): the
trainer's held-out walk reaches MLflow as heldout/tau at the steps it was measured (first, every N,
last), with its wall time, and the run writes the acceptance-over-time plot and summary."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_flow.app import run

pytestmark = pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_heldout_walk_is_logged_over_steps_and_time(tmp_path: Path, monkeypatch) -> None:
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    report = run(REPO / "pipelines" / "dflash.yaml", overrides=[
        f"output_dir={tmp_path / 'out'}", f"tracking.tracking_uri={uri}", "tracking.system_metrics=false",
        "stages.interleaver.max_batches=10", "stages.drafter.heldout_limit=3", "stages.drafter.heldout_horizon=24",
        "stages.drafter.heldout_every_steps=4", "stages.drafter.heldout_every_s=null",
        "stages.evaluate.limit=1", "stages.evaluate.max_new_tokens=4", "stages.evaluate.temperatures=[0.0]",
        "stages.evaluate.walk_limit=3", "stages.evaluate.walk_horizons=[24]", "stages.monitor.interval_s=1",
    ])
    assert report.ok, report
    client = MlflowClient(tracking_uri=uri)
    (mlrun,) = client.search_runs([client.get_experiment_by_name("dflash-flow").experiment_id])
    rid = mlrun.info.run_id
    taus = client.get_metric_history(rid, "heldout/tau")
    assert [m.step for m in taus] == [1, 5, 9, 10]  # the first step, every 4 steps, the last one
    assert all(1.0 <= m.value <= 8.0 for m in taus)
    elapsed = [m.value for m in client.get_metric_history(rid, "heldout/elapsed_s")]
    assert elapsed == sorted(elapsed) and elapsed[0] > 0
    probe_s = [m.value for m in client.get_metric_history(rid, "heldout/probe_s")]
    assert len(probe_s) == 4 and all(p > 0 for p in probe_s)
    # The last measurement is the final evaluation's walk on the same conversations and horizon.
    assert taus[-1].value == pytest.approx(client.get_metric_history(rid, "eval/walk/tau_h24")[-1].value)
    out = tmp_path / "out"
    summary = json.loads((out / "monitor" / "summary.json").read_text())["heldout"]
    assert summary["tau"] == taus[-1].value and [c[0] for c in summary["curve"]] == [1, 5, 9, 10]
    assert (out / "monitor" / "plots" / "heldout_acceptance.png").stat().st_size > 1000
    arts = {a.path for a in client.list_artifacts(rid, "plots")}
    assert "plots/heldout_acceptance.png" in arts
