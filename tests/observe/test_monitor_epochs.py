"""Epoch means: the Monitor logs, at each epoch's end, the epoch's mean of every trainer metric under
``train_epoch/<metric>`` (a real pipeline, a real sqlite MLflow store read back with MlflowClient), and the
end-of-run summary shows the last epoch's mean of the simulated acceptance beside the evaluations'."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from dflash_flow.core import Graph, Pipeline, Stage, register_stage
from dflash_flow.items import EvalReport, StepReport
from dflash_flow.observe.record import RunRecord
from dflash_flow.observe.report import summary_table
from dflash_flow.observe.sample import EvalPoint, TrainPoint
from dflash_flow.services import RunServices
from dflash_flow.stages.generic import Range
from dflash_flow.stages.monitor import Monitor

STEPS_PER_EPOCH = 5
EPOCHS = 3


def _accept(step: int) -> float:
    return 1.0 + (step % 4)  # swings from batch to batch, as the trainer's does


@register_stage("TestEpochReporter")
@attrs.define(kw_only=True, eq=False)
class EpochReporter(Stage):
    """A stand-in trainer over several epochs, then its final report and an evaluation."""

    output_type = object
    cardinality = "1:n"

    def process(self, item: int):
        step = item + 1
        epoch = item // STEPS_PER_EPOCH
        out = [StepReport(step=step, epoch=epoch, meta=None,
                          metrics={"loss": 1.0 / step, "sim_accept_len": _accept(step)}, position_accuracy=(0.5,))]
        if step == STEPS_PER_EPOCH * EPOCHS:
            out.append(StepReport(step=step, epoch=epoch, meta=None, final=True, artifacts={"drafter": "/tmp/d"}))
            out.append(EvalReport(name="trained", metrics={"tau": 1.7}, by_horizon={64: {"tau": 1.7}, 448: {"tau": 1.8}},
                                  temperature=0.0, lossless=True, num_prompts=16))
            out.append(EvalReport(name="walk", metrics={"tau": 1.69}, by_horizon={64: {"tau": 1.69}, 448: {"tau": 1.79}}))
        return out


def _mean(epoch: int, f) -> float:
    steps = range(epoch * STEPS_PER_EPOCH + 1, (epoch + 1) * STEPS_PER_EPOCH + 1)
    return sum(f(s) for s in steps) / STEPS_PER_EPOCH


def test_epoch_means_reach_mlflow_at_each_epochs_end(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from dflash_flow.observe.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker.start(tracking_uri=uri, experiment="epochs", run_name="e", spool_dir=tmp_path / "spool",
                            system_metrics=False)
    g = Graph(name="epochs", output_dir=str(tmp_path / "out"))
    g.add("steps", Range(count=STEPS_PER_EPOCH * EPOCHS))
    g.add("report", EpochReporter(), inputs="steps")
    g.add("monitor", Monitor(interval_s=30.0, progress=False, plots=False), inputs="report")
    services = RunServices(tracker=tracker)
    Pipeline(g, services=services).run()
    tracker.end("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    rid = tracker.run_id
    accept = client.get_metric_history(rid, "train_epoch/sim_accept_len")
    assert [m.step for m in sorted(accept, key=lambda m: m.step)] == [5, 10, 15]  # each epoch's last step
    for m in accept:
        assert m.value == pytest.approx(_mean(m.step // STEPS_PER_EPOCH - 1, _accept))
    loss = {m.step: m.value for m in client.get_metric_history(rid, "train_epoch/loss")}
    assert loss[10] == pytest.approx(_mean(1, lambda s: 1.0 / s))
    assert {m.step for m in client.get_metric_history(rid, "train_epoch/accuracy_pos1")} == {5, 10, 15}
    assert len(client.get_metric_history(rid, "train/sim_accept_len")) == STEPS_PER_EPOCH * EPOCHS
    # An evaluation's measurements are curves; its settings and facts are tags, never metrics.
    got = client.get_run(rid).data
    assert got.metrics["eval/trained/tau_h448"] == pytest.approx(1.8) and got.metrics["eval/walk/tau"] == 1.69
    assert not {"eval/trained/lossless", "eval/trained/max_new_tokens", "eval/trained/num_prompts"} & set(got.metrics)
    assert (got.tags["eval/trained/lossless"], got.tags["eval/trained/max_new_tokens"]) == ("True", "64")
    assert got.tags["eval/trained/num_prompts"] == "16" and got.tags["eval/walk/max_new_tokens"] == "64"

    table = summary_table(services.record, width=120)
    row = next(ln for ln in table.splitlines() if ln.startswith("training (simulated, epoch mean)"))
    assert row.split()[-1] == f"{_mean(EPOCHS - 1, _accept):.4g}"  # the epoch's mean, not the last batch's 4
    walk = next(ln for ln in table.splitlines() if ln.startswith("walk "))
    assert walk.split() == ["walk", "1.69", "1.69", "1.79"]


def test_acceptance_table_only_when_there_is_an_acceptance_to_show():
    r = RunRecord()
    r.add_train(TrainPoint(1, 0, {"loss": 1.0, "sim_accept_len": 2.0}))
    assert "acceptance length" not in summary_table(r)  # a simulated figure alone has nothing to sit beside
    r.add_eval(EvalPoint(1, (EvalReport("trained", {"tau": 1.5}),)))
    lines = summary_table(r, width=120).splitlines()
    assert any(ln.split() == ["trained", "1.5"] for ln in lines)
    assert any(ln.split() == ["training", "(simulated,", "epoch", "mean)", "2"] for ln in lines)
