"""The Monitor inside a real pipeline: a deliberately slow stage is named as the bottleneck, with the
replicas it would need, and the run's metrics reach a real MLflow store."""

from __future__ import annotations

import json
from pathlib import Path

import attrs

from dflash_flow.core import Graph, Pipeline, Stage, register_stage
from dflash_flow.items import StepReport
from dflash_flow.stages.generic import Delay, Range
from dflash_flow.stages.monitor import Monitor


@register_stage("TestStepReporter")
@attrs.define(kw_only=True, eq=False)
class StepReporter(Stage):
    output_type = StepReport

    def process(self, item: int):
        return (StepReport(step=item + 1, epoch=0, meta=None, metrics={"loss": 1.0 / (item + 1)}),)


def _graph(tmp_path: Path) -> Graph:
    g = Graph(name="bottleneck", output_dir=str(tmp_path / "out"))
    g.add("numbers", Range(count=60, service_s=0.002))
    g.add("fast", Delay(service_s=0.002), inputs="numbers", replicas=2)
    g.add("slow", Delay(service_s=0.03), inputs="fast")  # the deliberately slow stage
    g.add("report", StepReporter(), inputs="slow")
    g.add("monitor", Monitor(interval_s=0.3, progress=False), inputs="report")
    return g


def test_slow_stage_is_named_the_bottleneck(tmp_path: Path) -> None:
    Pipeline(_graph(tmp_path)).run()
    summary = json.loads((tmp_path / "out" / "monitor" / "summary.json").read_text())
    verdict = summary["bottleneck"]
    assert verdict["stage"] == "slow"
    assert verdict["replicas_needed"] >= 2
    assert "slow" in verdict["sentence"]


def test_monitor_metrics_reach_mlflow(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from dflash_flow.observe.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker.start(tracking_uri=uri, experiment="monitor", run_name="m", params={"a": 1}, spool_dir=tmp_path / "spool")
    Pipeline(_graph(tmp_path), services={"tracker": tracker}).run()
    tracker.end("FINISHED")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == list(range(1, 61))
    depth = client.get_metric_history(run.info.run_id, "queue/slow/0/depth")
    assert depth and max(m.value for m in depth) <= 8  # bounded by the default capacity
    assert client.get_metric_history(run.info.run_id, "stage/slow/busy_frac")
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/loss.png" in artifacts
