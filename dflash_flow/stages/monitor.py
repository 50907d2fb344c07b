"""Monitor: samples the whole pipeline every `interval_s`, logs to MLflow, shows progress, names the
bottleneck, and at the end writes plots and a summary."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core import Stage, cfg, register_stage
from dflash_flow.items import EvalReport, StepReport


@register_stage
@attrs.define(kw_only=True, eq=False)
class Monitor(Stage):
    """Samples metrics, queue depths and stage load; logs to MLflow; prints progress and a summary."""

    input_type = object  # StepReport and EvalReport
    output_type = None
    singleton = True

    interval_s: float = cfg(30.0, gt=0, doc="Seconds between samples of the whole pipeline.")
    progress: bool = cfg(True, doc="Show live progress on the console.")
    progress_interval_s: float | None = cfg(None, gt=0, doc="Seconds between plain progress lines when not a terminal (default: interval_s).")
    total_steps: int | None = cfg(None, ge=1, doc="Steps expected (for the ETA); default: from the reports.")
    plots: bool = cfg(True, doc="Write PNG plots at the end (and log them to MLflow).")
    sinks: list[str] = cfg(factory=list, doc="Stages for which being the bottleneck is the goal (default: the trainer feeding this monitor).")

    def setup(self, ctx) -> None:
        from dflash_flow.observe.progress import ProgressPrinter

        self._ctx = ctx
        self._tracker = ctx.services.get("tracker")
        self._history: dict[str, list[tuple[float, float]]] = {}
        self._last_sample = time.monotonic()
        self._prev_times: dict[str, list[dict[str, float]]] = {}
        self._prev_counters: dict[str, float] = {}
        self._prev_time = time.monotonic()
        self._step = 0
        self._epoch: int | None = None
        self._last_metrics: dict[str, float] = {}
        self._eval: dict[str, dict[str, float]] = {}
        self._bottleneck = None
        self._total = self.total_steps
        self._printer = (
            ProgressPrinter(sys.stderr, total_steps=self._total, interval_s=self.progress_interval_s or self.interval_s)
            if self.progress
            else None
        )
        graph = ctx.runtime.graph if ctx.runtime is not None else None
        self._edges: dict[str, list[str]] = {}
        self._sinks = set(self.sinks)
        if graph is not None:
            for s in graph.stages:
                for i in s.inputs:
                    self._edges.setdefault(i.stage, []).append(s.name)
            if not self._sinks:
                mine = graph.stage(ctx.name)
                self._sinks = {i.stage for i in mine.inputs}
            self._exclude = {ctx.name}
        else:
            self._exclude = {ctx.name}
        self._samples = ctx.metrics.counter("samples", "samples", "Monitor samples taken")
        self._window: dict[str, list[float]] = {}
        self._start = time.monotonic()

    def process(self, item: Any):
        if isinstance(item, StepReport):
            self._step = item.step
            self._epoch = item.epoch
            if item.metrics:  # the final report carries artifacts, not metrics
                self._last_metrics = dict(item.metrics)
            total = item.metrics.get("total_steps")
            if total and self._printer is not None and not self.total_steps:
                self._printer.total_steps = int(total)
            metrics = {}
            for k, v in item.metrics.items():
                if k == "total_steps":
                    continue
                if k.startswith(_WINDOWED_PREFIXES):
                    # Per-position accuracies are noisy per step and B-1 series long: log their mean
                    # over each sampling window instead of every step.
                    acc = self._window.setdefault(k, [0.0, 0])
                    acc[0] += v
                    acc[1] += 1
                else:
                    metrics[f"train/{k}"] = v
            if self._tracker is not None:
                self._tracker.log_metrics(metrics, step=item.step)
            _append(self._history, metrics, item.step)
        elif isinstance(item, EvalReport):
            self._eval[item.name] = dict(item.metrics)
            metrics = {f"eval/{item.name}/{k}": v for k, v in item.metrics.items()}
            if self._tracker is not None:
                self._tracker.log_metrics(metrics, step=self._step)
                self._tracker.flush_async()
            if self._printer is not None:
                self._printer.message(
                    f"eval {item.name}: " + ", ".join(f"{k} {v:.4g}" for k, v in item.metrics.items())
                )
        now = time.monotonic()
        if now - self._last_sample >= self.interval_s:
            self._sample(now)
        if self._printer is not None and isinstance(item, StepReport):
            m = self._last_metrics
            self._printer.update(
                self._step,
                epoch=self._epoch,
                tokens_per_s=m.get("tokens_per_s"),
                samples_per_s=m.get("samples_per_s"),
                loss=m.get("loss"),
                bottleneck=self._bottleneck.stage if self._bottleneck is not None else None,
                extra={"accept": m["sim_accept_len"]} if "sim_accept_len" in m else None,
            )
        return None

    # -- sampling ---------------------------------------------------------------------------------
    def _sample(self, now: float, whole_run: bool = False) -> None:
        from dflash_flow.observe.bottleneck import find_bottleneck, window_fractions

        runtime = self._ctx.runtime
        if runtime is None:
            return
        snap = runtime.snapshot()
        dt = max(now - self._prev_time, 1e-9)
        times = {
            name: [{"busy_s": r.busy_s, "blocked_in_s": r.blocked_in_s, "blocked_out_s": r.blocked_out_s} for r in st.replicas]
            for name, st in snap.stages.items()
            if name not in self._exclude
        }
        if whole_run:
            # The closing verdict covers the whole run, not the last few seconds of wind-down.
            fractions = window_fractions({}, times, max(now - self._start, 1e-9))
        else:
            fractions = window_fractions(self._prev_times, times, dt)
        self._prev_times = times
        metrics: dict[str, float] = {}
        for name, f in fractions.items():
            for k in ("busy", "blocked_in", "blocked_out"):
                metrics[f"stage/{name}/{k}_frac"] = f[k]
        for name, st in snap.stages.items():
            for r in st.replicas:
                if r.channel is not None:
                    metrics[f"queue/{name}/{r.replica}/depth"] = r.channel.depth
            metrics[f"stage/{name}/items_out"] = sum(r.items_out for r in st.replicas)
            for mname, kind in st.metric_kinds.items():
                value = st.metric(mname)
                if kind == "labeled" and mname == "bucket_dispatch":
                    for label, n in value.items():
                        metrics[f"bucket/{label}/dispatched"] = n
                elif kind == "labeled":
                    for label, n in value.items():
                        metrics[f"{name}/{mname}/{label}"] = n
                elif kind == "summary":
                    if value["count"]:
                        metrics[f"{name}/{mname}/mean"] = value["mean"]
                        metrics[f"{name}/{mname}/max"] = value["max"]
                elif value is not None and not (isinstance(value, float) and math.isnan(value)):
                    metrics[f"{name}/{mname}"] = float(value)
                    if kind == "counter":
                        key = f"{name}/{mname}"
                        prev = self._prev_counters.get(key, 0.0)
                        metrics[f"rate/{name}/{mname}_per_s"] = (float(value) - prev) / dt
                        self._prev_counters[key] = float(value)
        for k, (total, n) in self._window.items():
            metrics[f"train/{k}"] = total / n
        self._window = {}
        for key in ("tokens_per_s", "samples_per_s"):
            if key in self._last_metrics:
                metrics[f"throughput/{key}"] = self._last_metrics[key]
        if fractions:
            self._bottleneck = find_bottleneck(fractions, sinks=self._sinks, edges=self._edges)
            if self._bottleneck is not None:
                metrics.update(self._bottleneck.as_metrics())
        if self._tracker is not None:
            self._tracker.log_metrics(metrics, step=self._step)
            self._tracker.flush_async()  # store writes happen on the tracker's writer thread
        _append(self._history, metrics, self._step)
        self._samples.inc()
        self._last_sample = now
        self._prev_time = now

    def finish(self):
        self._sample(time.monotonic(), whole_run=True)
        return None

    def teardown(self) -> None:
        if not hasattr(self, "_ctx"):
            return
        if self._printer is not None:
            self._printer.close()
        out = Path(self._ctx.output_dir) / "monitor"
        out.mkdir(parents=True, exist_ok=True)
        summary = self._summary()
        (out / "summary.json").write_text(json.dumps(summary, indent=1, default=_jsonable))
        (out / "history.json").write_text(json.dumps(self._history))
        if self._tracker is not None:
            self._tracker.log_artifact(out / "summary.json", "monitor")
        if self.plots and self._history:
            from dflash_flow.observe.plots import write_plots

            made = write_plots(self._history, out / "plots")
            if self._tracker is not None:
                for path in made.values():
                    self._tracker.log_artifact(path, "plots")
        print(self._table(summary), file=sys.stderr)

    def _summary(self) -> dict[str, Any]:
        b = self._bottleneck
        return {
            "step": self._step,
            "epoch": self._epoch,
            "last_train_metrics": self._last_metrics,
            "eval": self._eval,
            "bottleneck": None
            if b is None
            else {"stage": b.stage, "busy": b.busy, "replicas": b.replicas, "replicas_needed": b.replicas_needed, "sentence": b.sentence},
            "stage_load": {name: dict(load.__dict__) for name, load in (b.loads.items() if b is not None else [])},
        }

    def _table(self, summary: dict[str, Any]) -> str:
        from dflash_flow.observe.progress import summary_table

        rows = [("step", summary["step"]), ("epoch", summary["epoch"])]
        for k in ("loss", "accuracy", "sim_accept_len", "tokens_per_s", "samples_per_s"):
            if k in self._last_metrics:
                rows.append((k, self._last_metrics[k]))
        for name, m in self._eval.items():
            for k, v in m.items():
                rows.append((f"eval {name} {k}", v))
        if summary["bottleneck"]:
            rows.append(("bottleneck", summary["bottleneck"]["sentence"]))
        return summary_table([list(r) for r in rows], columns=["metric", "value"], title="run summary")


_WINDOWED_PREFIXES = ("accuracy_pos",)


def _append(history: dict[str, list[tuple[float, float]]], metrics: dict[str, float], step: int) -> None:
    for k, v in metrics.items():
        try:
            history.setdefault(k, []).append((step, float(v)))
        except (TypeError, ValueError):
            continue


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return str(obj)
