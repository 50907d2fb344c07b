"""Monitor overhead: the same pipeline with MLflow tracking on and off, in one process.

Writes bench/results/monitor.json. The pipeline is GIL-free work (sleeps) feeding a stand-in trainer (a
20 ms step) that emits one training report per step into the Monitor, which samples the whole runtime every `interval_s` and,
with tracking on, logs every sample (flattened by the one metric schema, docs/metrics.md) to a real
sqlite MLflow store with `log_batch` on the tracker's writer thread. Runs alternate (off, on, off, on,
...) so drift on a shared machine hits both sides alike. Also measured: the end-of-run report
(`write_run_report`: summary, history, plots, uploads), which runs after the pipeline, not per step.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs

from dflash_flow.core import Graph, Pipeline, Stage, register_stage
from dflash_flow.items import StepReport
from dflash_flow.services import RunServices
from dflash_flow.stages.generic import Delay, Range
from dflash_flow.stages.monitor import Monitor

ITEMS = 120
SERVICE_S = 0.004  # data-side work, 2 replicas
STEP_S = 0.05  # a training step, the bottleneck: 20 steps/s, faster than any real DFlash step
TRIALS = 3


@register_stage("BenchReporter")
@attrs.define(kw_only=True, eq=False)
class BenchReporter(Stage):
    """A stand-in trainer: a GIL-free step of STEP_S, then a report with ~20 metrics."""

    output_type = StepReport

    def setup(self, ctx) -> None:
        self.times: list[float] = []

    def process(self, item: int):
        time.sleep(STEP_S)
        self.times.append(time.perf_counter())
        metrics = {"loss": 1.0 / (item + 1), "accuracy": 0.5, "tokens_per_s": 1000.0, "samples_per_s": 10.0}
        return (StepReport(step=item + 1, epoch=0, meta=None, metrics=metrics, position_accuracy=(0.5,) * 15),)


def run_once(tracking: bool, root: Path, trial: int) -> tuple[float, float]:
    """(steady-state steps per second, seconds of the end-of-run report)."""
    from dflash_flow.observe.report import write_run_report
    from dflash_flow.observe.tracking import Tracker

    g = Graph(name="monitor-bench", seed=0, output_dir=str(root / f"out-{trial}-{tracking}"))
    g.add("numbers", Range(count=ITEMS))
    g.add("work", Delay(service_s=SERVICE_S), inputs="numbers", replicas=2)
    trainer = BenchReporter()
    g.add("report", trainer, inputs="work")
    g.add("monitor", Monitor(interval_s=1.0, progress=False), inputs="report")
    tracker = Tracker.start(
        enabled=tracking,
        tracking_uri=f"sqlite:///{root}/mlflow.db",
        experiment="monitor-bench",
        run_name=f"trial-{trial}",
        params=g.to_dict(),
        spool_dir=root / "spool",
    )
    services = RunServices(tracker=tracker if tracking else None)
    Pipeline(g, services=services).run()
    t0 = time.perf_counter()
    write_run_report(services.record, output_dir=root / f"out-{trial}-{tracking}", tracker=services.tracker)
    report_s = time.perf_counter() - t0
    tracker.end("FINISHED")
    # Steady-state throughput: steps per second between the first and the last step (start-up and
    # the end-of-run report are one-off costs, not overhead per step).
    t = trainer.times
    return (len(t) - 1) / (t[-1] - t[0]), report_s


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run_once(True, root, -1)  # warm-up: creates the sqlite schema, imports mlflow
        on, off, report = [], [], []
        for trial in range(TRIALS):
            off.append(run_once(False, root, trial)[0])
            rate, report_s = run_once(True, root, trial)
            on.append(rate)
            report.append(report_s)
    result = {
        "items": ITEMS,
        "trials": TRIALS,
        "throughput_tracking_off": statistics.median(off),
        "throughput_tracking_on": statistics.median(on),
        "overhead": 1.0 - statistics.median(on) / statistics.median(off),
        "target_overhead_max": 0.01,
        "end_of_run_report_s": statistics.median(report),
        "per_trial_off": off,
        "per_trial_on": on,
    }
    out = Path(__file__).parent / "results" / "monitor.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    json.dump(result, sys.stdout, indent=2)
    print()
    return result


if __name__ == "__main__":
    main()
