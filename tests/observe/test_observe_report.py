"""The end-of-run report from a RunRecord: files, plots, uploads to a real sqlite MLflow store read back
with MlflowClient, and the summary table rendered with rich."""

from __future__ import annotations

import json
import math

import attrs
import pytest
from samples_for_tests import full_sample

from dflash_flow.items import EvalReport
from dflash_flow.observe.record import RunRecord
from dflash_flow.observe.report import summary_table, write_run_report
from dflash_flow.observe.sample import EvalPoint, TrainPoint


def filled_record() -> RunRecord:
    r = RunRecord(total_steps=40)
    for step in range(1, 41):
        epoch = 0 if step <= 20 else 1
        r.add_train(TrainPoint(step, epoch, {"loss": 4.0 / step, "accuracy": step / 40, "tokens_per_s": 1000.0 + step}))
        if step % 10 == 0:
            r.add_sample(full_sample(step))
    r.add_eval(EvalPoint(40, (EvalReport("val", {"tau": 3.25, "val_loss": 0.5}),)))
    r.add_sample(attrs.evolve(full_sample(40), whole_run=True))
    r.add_train(TrainPoint(40, 1, {}))  # the trainer's final report: artifacts, no metrics
    r.artifacts["drafter"] = "/runs/x/drafter"
    return r


def test_record_keeps_last_and_epoch_means():
    r = filled_record()
    assert r.step == 40 and r.epoch == 1 and len(r.history.train) == 40
    assert r.train["loss"] == pytest.approx(0.1)
    assert r.epoch_mean()["accuracy"] == pytest.approx(sum(s / 40 for s in range(21, 41)) / 20)
    assert r.epoch_mean(0)["accuracy"] == pytest.approx(sum(s / 40 for s in range(1, 21)) / 20)
    assert list(r.evals) == ["val"] and r.evals["val"].metrics == {"tau": 3.25, "val_loss": 0.5}
    assert r.bottleneck is r.history.samples[-1].bottleneck and r.last_sample.whole_run
    assert bool(r.history) and not RunRecord().history


@pytest.mark.slow
def test_write_run_report_files_and_uploads(sqlite_uri, tmp_path):
    from mlflow import MlflowClient

    from dflash_flow.observe.tracking import Tracker

    record = filled_record()
    tracker = Tracker.start(tracking_uri=sqlite_uri, experiment="report", spool_dir=tmp_path / "spool", system_metrics=False)
    files = write_run_report(record, output_dir=tmp_path / "out", tracker=tracker)
    tracker.end("FINISHED")
    assert files.dir == tmp_path / "out" / "monitor"
    summary = json.loads(files.summary.read_text())
    assert summary["step"] == 40 and summary["total_steps"] == 40
    assert summary["last_train_metrics"]["loss"] == pytest.approx(0.1)
    assert summary["eval"] == {"val": {"name": "val", "metrics": {"tau": 3.25, "val_loss": 0.5}, "by_horizon": {}}}
    assert summary["artifacts"] == {"drafter": "/runs/x/drafter"}
    assert summary["bottleneck"]["stage"] == record.bottleneck.stage and summary["bottleneck"]["sentence"]
    assert summary["stage_load"]["padder"]["replicas"] == 2 and summary["stage_load_window"] == "training steady state, 5 s"
    history = json.loads(files.history.read_text())
    assert history["train"]["step"] == list(range(1, 41)) and len(history["train"]["loss"]) == 40
    assert len(history["samples"]) == 5 and history["samples"][0]["stages"]["padder"]["per_replica"][1]["busy"] == 0.7
    assert history["evals"] == [{"step": 40, "results": {"val": {"name": "val", "metrics": {"tau": 3.25, "val_loss": 0.5}, "by_horizon": {}}}}]
    assert set(files.plots) == {"loss", "throughput", "queue_depths", "bucket_mix", "stage_load"}

    c = MlflowClient(tracking_uri=sqlite_uri)
    rid = tracker.run_id
    assert {a.path for a in c.list_artifacts(rid, "monitor")} == {"monitor/summary.json", "monitor/history.json"}
    assert {a.path for a in c.list_artifacts(rid, "plots")} == {f"plots/{n}.png" for n in files.plots}
    got = c.download_artifacts(rid, "monitor/summary.json", str(tmp_path / "dl"))
    assert json.loads(open(got).read()) == summary
    tags = c.get_run(rid).data.tags
    assert tags["bottleneck"] == record.bottleneck.stage and tags["bottleneck_sentence"] == record.bottleneck.sentence


def test_report_without_plots_and_of_an_empty_record(tmp_path):
    record = filled_record()
    record.plots = False
    files = write_run_report(record, output_dir=tmp_path)
    assert files.plots == {} and not (tmp_path / "monitor" / "plots").exists()
    assert set(write_run_report(record, output_dir=tmp_path, plots=True).plots) >= {"loss"}  # the caller decides
    empty = write_run_report(RunRecord(), output_dir=tmp_path / "empty")
    assert json.loads(empty.summary.read_text())["bottleneck"] is None and empty.plots == {}


def test_non_finite_values_become_null_in_json(tmp_path):
    record = RunRecord()
    record.add_train(TrainPoint(1, 0, {"loss": math.nan, "grad_norm": math.inf}))
    files = write_run_report(record, output_dir=tmp_path, plots=False)
    summary = json.loads(files.summary.read_text())
    assert summary["last_train_metrics"] == {"loss": None, "grad_norm": None}
    assert json.loads(files.history.read_text())["train"]["loss"] == [None]


def test_summary_table_shows_what_the_run_ended_with():
    record = filled_record()
    text = summary_table(record, width=120)
    lines = text.splitlines()
    assert lines[0] == "run summary: step 40/40, epoch 1"
    loss = next(ln for ln in lines if ln.startswith("loss"))
    assert loss.split() == ["loss", "0.1", f"{sum(4.0 / s for s in range(21, 41)) / 20:.4g}"]
    assert any(ln.split() == ["val", "3.25"] for ln in lines)  # tau: in the acceptance table, once
    assert any(ln.split() == ["val", "val_loss", "0.5"] for ln in lines)
    assert any(ln.split()[:3] == ["padder", "2", "80%"] for ln in lines), text
    assert f"bottleneck: {record.bottleneck.sentence}" in " ".join(text.split())  # wrapped, whole
    assert any(ln.split() == ["drafter", "/runs/x/drafter"] for ln in lines)
    assert "\x1b" not in text and all(ln == ln.rstrip() for ln in lines)
    assert summary_table(RunRecord()) == "run summary: step 0"
