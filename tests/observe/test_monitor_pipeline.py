"""The Monitor inside a real pipeline: a deliberately slow stage is named as the bottleneck, with the
replicas it would need; the run's structured record reaches a real MLflow store under the one schema;
the Monitor itself writes nothing at the end (the end-of-run report does)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import attrs
import pytest

from dflash_flow.core import Graph, Pipeline, Source, Stage, register_stage
from dflash_flow.items import EvalReport, StepReport
from dflash_flow.observe.record import RunRecord
from dflash_flow.observe.report import summary_table, write_run_report
from dflash_flow.services import RunServices
from dflash_flow.stages.generic import Delay, Range
from dflash_flow.stages.monitor import Monitor

POSITIONS = 3


@register_stage("TestStepReporter")
@attrs.define(kw_only=True, eq=False)
class StepReporter(Stage):
    """A stand-in trainer: a step report per item (with per-position accuracies), a counted metric,
    a labeled bucket count like the Interleaver's, and a final report naming an artifact."""

    count: int = 60
    output_type = object  # StepReport and, at the end, an EvalReport
    cardinality = "1:n"

    def setup(self, ctx) -> None:
        self._buckets = ctx.metrics.labeled("bucket_dispatch", "batches", "per bucket")
        self._tokens = ctx.metrics.counter("tokens", "tokens", "tokens")
        self._wait = ctx.metrics.summary("step_s", "s", "step time")

    def process(self, item: int):
        self._buckets.inc(128 if item % 3 else 512)
        self._tokens.inc(100)
        self._wait.observe(0.001 * (item % 5))
        metrics = {"loss": 1.0 / (item + 1), "tokens_per_s": 1000.0}
        out = [StepReport(step=item + 1, epoch=0, meta=None, metrics=metrics, position_accuracy=(0.5,) * POSITIONS,
                          total_steps=self.count)]
        if item + 1 == self.count:
            out.append(StepReport(step=item + 1, epoch=0, meta=None, final=True, artifacts={"drafter": "/tmp/drafter"}))
            out.append(EvalReport(name="val", metrics={"tau": 2.5, "val_loss": 0.7}))
        return out


def _graph(tmp_path: Path, names: tuple[str, str, str] = ("numbers", "fast", "slow")) -> Graph:
    src, fast, slow = names
    g = Graph(name="bottleneck", output_dir=str(tmp_path / "out"))
    g.add(src, Range(count=60, service_s=0.002))
    g.add(fast, Delay(service_s=0.002), inputs=src, replicas=2)
    g.add(slow, Delay(service_s=0.03), inputs=fast, ordered=True)  # the deliberately slow stage (in order: the last report is step 60)
    g.add("report", StepReporter(), inputs=slow)
    g.add("monitor", Monitor(interval_s=0.3, progress=False), inputs="report")
    return g


def test_slow_stage_is_named_the_bottleneck_and_nothing_written_at_teardown(tmp_path: Path) -> None:
    services = RunServices()
    Pipeline(_graph(tmp_path), services=services).run()
    assert not (tmp_path / "out" / "monitor").exists(), "the Monitor must leave the end of run to the application"
    record = services.record
    verdict = record.bottleneck
    # "slow" restores the plan order, so it cannot take replicas: the verdict advises what can change.
    assert verdict.stage == "slow" and not verdict.replicable and verdict.replicas_needed == 1
    assert "cannot be replicated" in verdict.sentence and "replicas it" not in verdict.sentence
    assert record.step == 60 and record.total_steps == 60 and record.artifacts == {"drafter": "/tmp/drafter"}
    assert list(record.evals) == ["val"] and record.evals["val"].metrics == {"tau": 2.5, "val_loss": 0.7}
    assert len(record.history.train) == 60 and "accuracy_pos1" not in record.history.train.columns
    assert record.positions == (0.5,) * POSITIONS and "total_steps" not in record.train  # a sequence, not names
    assert not any(k.startswith("accuracy") and k != "accuracy" for k in record.train)
    closing = record.history.samples[-1]
    assert closing.whole_run and not any(s.whole_run for s in record.history.samples[:-1])
    slow = closing.stages["slow"]
    assert slow.items_out == 60 and slow.busy > 0.5 and slow.per_replica[0].queue_capacity == 8
    assert closing.stages["fast"].replicas == 2 and len(closing.stages["fast"].per_replica) == 2
    report = closing.stages["report"]
    assert report.counters["tokens"] == 6000 and report.summaries["step_s"].count == 60
    assert closing.buckets["128"].dispatched == 40 and closing.buckets["512"].dispatched == 20
    windows = [s for s in record.history.samples if not s.whole_run]
    assert windows and all(s.positions in ((), (0.5,) * POSITIONS) for s in windows)

    files = write_run_report(record, output_dir=tmp_path / "out", plots=False)
    summary = json.loads(files.summary.read_text())
    assert summary["position_accuracy"] == {"last": [0.5] * POSITIONS, "epoch_mean": [0.5] * POSITIONS}
    assert summary["bottleneck"]["stage"] == "slow" and summary["artifacts"] == {"drafter": "/tmp/drafter"}
    assert summary["stage_load"]["slow"]["items_out"] == 60
    table = summary_table(record)
    assert "bottleneck: slow is the bottleneck" in " ".join(table.split())
    assert "val" in table and "/tmp/drafter" in table


@register_stage("TestOneShotReader")
@attrs.define(kw_only=True, eq=False)
class OneShotReader(Source):
    """A reader that is busy all its (short) life and ends before training does."""

    count: int = 30

    def produce(self):
        time.sleep(0.4)  # reading and tokenizing
        yield from range(self.count)


@register_stage("TestSlowReporter")
@attrs.define(kw_only=True, eq=False)
class SlowReporter(StepReporter):
    def process(self, item: int):
        time.sleep(0.02)  # the training step
        return super().process(item)


def test_run_verdict_is_the_steady_state_among_live_stages(tmp_path: Path) -> None:
    """A one-shot reader busy 100% of its short life finished before training: the run's verdict (and
    the summary, and the tag) names the trainer, judged over the training steady state."""
    services = RunServices()
    g = Graph(name="steady", output_dir=str(tmp_path / "out"))
    g.add("source", OneShotReader(count=30))
    g.add("report", SlowReporter(count=30), inputs="source", capacity=64)  # the reader never waits
    g.add("monitor", Monitor(interval_s=0.1, progress=False, plots=False), inputs="report")
    Pipeline(g, services=services).run()
    record = services.record
    closing = record.history.samples[-1]
    assert closing.whole_run and closing.window_s < closing.elapsed_s - 0.3  # the loading is not in it
    assert closing.window_label.startswith("training steady state")
    assert record.bottleneck.stage == "report" and record.bottleneck.is_sink, record.bottleneck.sentence
    assert "source" not in record.bottleneck.loads  # finished before the steady state: not judged
    # Windows taken while training ran never name the finished reader either.
    training = [s for s in record.history.samples[:-1] if s.step >= 2 and s.bottleneck is not None]
    assert training and all(s.bottleneck.stage == "report" for s in training)
    table = " ".join(summary_table(record).split())
    assert "bottleneck: report is the bottleneck" in table and "training steady state" in table


@pytest.mark.slow
def test_monitor_metrics_reach_mlflow_under_the_schema(tmp_path: Path) -> None:
    from mlflow import MlflowClient

    from dflash_flow.observe.tracking import Tracker

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker.start(tracking_uri=uri, experiment="monitor", run_name="m", params={"a": 1}, spool_dir=tmp_path / "spool")
    services = RunServices(tracker=tracker)
    Pipeline(_graph(tmp_path), services=services).run()
    files = write_run_report(services.record, output_dir=tmp_path / "out", tracker=tracker)
    tracker.end("FINISHED")
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    rid = run.info.run_id
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(rid, "train/loss")] == list(range(1, 61))
    keys = set(run.data.metrics)
    assert "train/total_steps" not in keys
    depth = client.get_metric_history(rid, "stage/slow/replica/0/queue_depth")
    assert depth and max(m.value for m in depth) <= 8  # bounded by the default capacity
    for key in (
        "stage/slow/busy_frac",
        "stage/slow/blocked_in_frac",
        "stage/fast/replica/1/busy_frac",
        "stage/slow/items_out",
        "stage/slow/items_out_per_s",
        "stage/report/metric/tokens",
        "stage/report/rate/tokens",
        "stage/report/metric/step_s/mean",
        "stage/report/metric/step_s/max",
        "stage/report/metric/bucket_dispatch/128",
        "stage/monitor/metric/samples",
        "bucket/128/dispatched",
        "bucket/512/share",
        "train/accuracy_pos1",
        "throughput/tokens_per_s",
        "bottleneck/busy",
        "bottleneck/replicas_needed",
        "eval/val/tau",
    ):
        assert key in keys, key
    pos = client.get_metric_history(rid, "train/accuracy_pos2")
    assert 1 <= len(pos) < 60  # windowed: one mean per sample, not one per step
    share = {m.step: m.value for m in client.get_metric_history(rid, "bucket/512/share")}
    assert all(0.0 <= v <= 1.0 for v in share.values())
    artifacts = {a.path for a in client.list_artifacts(rid, "plots")}
    assert {"plots/loss.png", "plots/queue_depths.png", "plots/bucket_mix.png"} <= artifacts
    assert set(files.plots) >= {"loss", "queue_depths", "bucket_mix", "throughput", "stage_load"}
    assert {a.path for a in client.list_artifacts(rid, "monitor")} == {"monitor/summary.json", "monitor/history.json"}
    assert run.data.tags["bottleneck"] == "slow"


def test_unicode_and_odd_stage_names_do_not_collide(tmp_path: Path) -> None:
    """Two non-ASCII stage names (which once both became ``_``) keep separate metrics in MLflow."""
    from mlflow import MlflowClient

    from dflash_flow.observe.tracking import Tracker

    names = ("données", "数据", "a-b_c")
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    tracker = Tracker.start(tracking_uri=uri, experiment="names", spool_dir=tmp_path / "spool", system_metrics=False)
    services = RunServices(tracker=tracker)
    Pipeline(_graph(tmp_path, names), services=services).run()
    tracker.end("FINISHED")
    client = MlflowClient(tracking_uri=uri)
    metrics = client.get_run(tracker.run_id).data.metrics
    for name in names:
        assert f"stage/{name}/items_out" in metrics, sorted(metrics)
    assert metrics["stage/données/items_out"] == 60
    assert metrics["stage/数据/replica/1/busy_frac"] >= 0.0  # two replicas, each its own series
    assert metrics["stage/a-b_c/items_out"] == 60
    assert services.record.bottleneck.stage == "a-b_c"
    assert not any(k.startswith("stage/_/") for k in metrics)


def test_monitor_in_a_pipeline_built_without_services(tmp_path: Path) -> None:
    """A pipeline built in Python without the application: the Monitor works on a record of its own."""
    g = Graph(name="plain", output_dir=str(tmp_path / "out"))
    g.add("numbers", Range(count=20, service_s=0.001))
    g.add("report", StepReporter(count=20), inputs="numbers")
    g.add("monitor", Monitor(interval_s=0.05, progress=False, plots=False), inputs="report")
    pipe = Pipeline(g)
    pipe.run()
    record = pipe.replicas["monitor"][0].stage._record
    assert isinstance(record, RunRecord) and record.step == 20 and not record.plots
    assert record.history.samples[-1].whole_run


def test_the_monitor_samples_during_a_stall(tmp_path: Path) -> None:
    """No report arrives for a second: the Monitor's samples (from the runtime's sampler) still come."""
    services = RunServices()
    g = Graph(name="stall", output_dir=str(tmp_path / "out"))
    g.add("numbers", Range(count=2))
    g.add("slow", Delay(service_s=0.8), inputs="numbers")
    g.add("report", StepReporter(count=2), inputs="slow")
    g.add("monitor", Monitor(interval_s=0.1, progress=False), inputs="report")
    Pipeline(g, services=services).run()
    windows = [s for s in services.record.history.samples if not s.whole_run]
    assert len(windows) >= 5, len(windows)
    stalled = [s for s in windows if s.step == 0]  # taken before the first report reached the Monitor
    assert stalled and all(s.stages["slow"].busy > 0.5 for s in stalled[1:])
