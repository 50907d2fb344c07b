"""Default MLflow run names (issue 40.22): runs of one pipeline file into different output directories are
told apart by the output directory's last part; tracking.run_name names a run outright. Real runs through
the Python runner into a real sqlite store, read back with MlflowClient."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_flow.app import run
from dflash_flow.observe.store import default_run_name

PIPELINE = """
name: quick
output_dir: {out}
tracking: {{tracking_uri: "{uri}", experiment: names, system_metrics: false}}
stages:
  - {{name: numbers, type: Range, config: {{count: 3}}}}
  - {{name: sink, type: Discard, inputs: [numbers]}}
"""


def test_default_run_name_rule():
    assert default_run_name("dflash-cpu", "runs/short") == "dflash-cpu-short"
    assert default_run_name("dflash-cpu", "runs/dflash-cpu") == "dflash-cpu"
    assert default_run_name("dflash-cpu", "runs/dflash-cpu-2") == "dflash-cpu-2"
    assert default_run_name("dflash-cpu", None) == "dflash-cpu"


@pytest.mark.slow
def test_runs_into_two_output_dirs_get_two_names_and_run_name_wins(tmp_path: Path):
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "p.yaml"
    path.write_text(PIPELINE.format(out=tmp_path / "runs" / "quick", uri=uri))
    names = []
    for overrides in ([], [f"output_dir={tmp_path / 'runs' / 'short'}"],
                      [f"output_dir={tmp_path / 'runs' / 'third'}", "tracking.run_name=my name"]):
        report = run(path, overrides=overrides)
        assert report.ok, report.error
        names.append(MlflowClient(tracking_uri=uri).get_run(report.mlflow_run_id).info.run_name)
    assert names == ["quick", "quick-short", "my name"]
