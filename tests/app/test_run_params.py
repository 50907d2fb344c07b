"""MLflow runs you can compare: params keyed by stage name with every default written out, the same in the
resolved YAML artifact, and a pointer to the headline metrics; a real run of a YAML pipeline through the
Python runner into a real sqlite store, read back with MlflowClient."""

from __future__ import annotations

from pathlib import Path

import yaml

from dflash_flow.app import run

PIPELINE = """
name: compare
seed: 5
output_dir: {out}
tracking: {{tracking_uri: "{uri}", experiment: compare, system_metrics: false}}
stages:
  - name: numbers
    type: Range
    config: {{count: 12}}
  - name: slow
    type: Delay
    inputs: [numbers]
  - name: sink
    type: Discard
    inputs: [slow]
"""


def test_params_are_keyed_by_stage_name_with_every_default(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from dflash_flow.observe.schema import HEADLINE_METRICS

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "pipeline.yaml"
    path.write_text(PIPELINE.format(out=tmp_path / "out", uri=uri))
    report = run(path)
    assert report.ok, report.error
    mlflow_run = MlflowClient(tracking_uri=uri).get_run(report.mlflow_run_id)
    params = mlflow_run.data.params
    assert params["stages.numbers.count"] == "12" and params["stages.numbers.type"] == "Range"
    assert params["stages.slow.service_s"] == "0.0"  # a default the YAML never wrote
    assert params["stages.slow.inputs"] == '["numbers"]' and params["seed"] == "5"
    assert not any(k.startswith(("stages.0.", "stages.1.")) for k in params), sorted(params)
    assert not any(".config." in k for k in params), sorted(params)
    assert mlflow_run.data.tags["headline_metrics"] == ", ".join(HEADLINE_METRICS)

    resolved = yaml.safe_load((tmp_path / "out" / "pipeline.resolved.yaml").read_text())
    slow = next(s for s in resolved["stages"] if s["name"] == "slow")
    assert slow["config"] == {"service_s": 0.0, "jitter_s": 0.0}  # the defaults, written out
    # ... and it loads back: the resolved file is a pipeline of its own.
    again = run(tmp_path / "out" / "pipeline.resolved.yaml", overrides=[f"output_dir={tmp_path / 'again'}",
                                                                        "tracking.enabled=false"])
    assert again.ok, again.error
