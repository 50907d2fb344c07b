"""The end of a run's observability, from the RunRecord: :func:`write_run_report` (files, plots, uploads),
called by the application once the pipeline has ended however it ended, and :func:`summary_table`.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.util import atomic_write_text

from .console import pct, render, table
from .names import eval_facts, horizon_name
from .record import RunRecord
from .sample import data_quality

log = logging.getLogger(__name__)


@attrs.frozen
class RunReportFiles:
    """Where the report went: ``dir`` is ``<output_dir>/monitor``."""

    dir: Path
    summary: Path
    history: Path
    plots: dict[str, Path]


def _write_json(path: Path, data: Any) -> Path:
    return atomic_write_text(path, json.dumps(data, indent=1, ensure_ascii=False, allow_nan=False))


def write_run_report(record: RunRecord, *, output_dir: str | os.PathLike, tracker: Any = None,
                     plots: bool | None = None) -> RunReportFiles:
    """Write ``monitor/summary.json``, ``history.json`` and (``plots``, default ``record.plots``) PNG plots (a
    failing plot is logged, never failing a finished run); upload them, tag the run with the bottleneck."""
    out = Path(output_dir) / "monitor"
    out.mkdir(parents=True, exist_ok=True)
    summary = _write_json(out / "summary.json", record.summary())
    history = _write_json(out / "history.json", record.history.to_json())
    made: dict[str, Path] = {}
    if (record.plots if plots is None else plots) and (len(record.history.train) or record.history.samples):
        from .plots import write_plots

        try:
            made = write_plots(record.history, out / "plots")
        except Exception as exc:  # noqa: BLE001 - plotting is a convenience, the run's data is on disk
            log.warning("could not draw the run's plots: %s", exc)
    if tracker is not None:
        tracker.log_artifact(summary, "monitor")
        tracker.log_artifact(history, "monitor")
        for path in made.values():
            tracker.log_artifact(path, "plots")
        if record.bottleneck is not None:
            tracker.set_tags({"bottleneck": record.bottleneck.stage, "bottleneck_sentence": record.bottleneck.sentence})
    return RunReportFiles(dir=out, summary=summary, history=history, plots=made)


_TRAIN_SHOWN = ("loss", "accuracy", "sim_accept_len", "grad_norm", "lr", "tokens_per_s", "samples_per_s",
                "allreduce_wait_s", "allreduce_wait_frac")  # the last two: multi-rank DDP runs only


def _acceptance(record: RunRecord, mean: dict[str, float]) -> tuple[list[list[Any]], list[str]] | None:
    """Every acceptance figure side by side: the trainer's simulated one (the last epoch's mean), then each
    evaluation's ``tau`` and its ``tau`` at every horizon it measured."""
    evals = {label: r for label, r in record.evals.items() if "tau" in r.metrics}
    horizons = sorted({h for r in evals.values() for h in r.horizons})
    rows: list[list[Any]] = []
    if "sim_accept_len" in mean and evals:
        rows.append(["training (simulated, epoch mean)", mean["sim_accept_len"]] + [None] * len(horizons))
    rows += [[label, r.metrics["tau"]] + [r.at(h) for h in horizons] for label, r in evals.items()]
    return (rows, ["source", "tau"] + [f"{h} new tokens" for h in horizons]) if rows else None


def _eval_shown(r: Any, tau_shown: bool) -> list[tuple[str, Any]]:
    """An evaluation's rows of the summary, each figure once: the first horizon's are ``metrics`` themselves,
    and ``tau`` is in the acceptance table when there is one (``tau_shown``)."""
    out = list(eval_facts(r).items()) + [(k, v) for k, v in r.metrics.items() if not (k == "tau" and tau_shown)]
    return out + [(horizon_name(k, h), v) for h, figures in r.by_horizon.items() for k, v in figures.items()
                  if not ((h == r.max_new_tokens and r.metrics.get(k) == v) or (k == "tau" and tau_shown))]


def summary_table(record: RunRecord, *, width: int = 100) -> str:
    """The run summary as plain text: trainer metrics, evaluations, stage load, bottleneck and artifacts."""
    from rich.text import Text

    parts: list[Any] = []
    steps = f"{record.step}/{record.total_steps}" if record.total_steps else str(record.step)
    head = f"run summary: step {steps}" + (f", epoch {record.epoch}" if record.epoch is not None else "")
    mean = record.epoch_mean()
    names = [k for k in _TRAIN_SHOWN if k in record.train or k in mean]
    mean_title = f"epoch {record.epoch} mean" if record.epoch is not None else "mean"
    parts.append(table([[k, record.train.get(k), mean.get(k)] for k in names], ["metric", "last", mean_title],
                       title=head) if names else Text(head))
    if (acceptance := _acceptance(record, mean)) is not None:
        parts.append(table(*acceptance, title="acceptance length (tokens per target step)"))
    if evals := [[label, k, v] for label, r in record.evals.items() for k, v in _eval_shown(r, acceptance is not None)]:
        parts.append(table(evals, ["evaluation", "metric", "value"], title="evaluations"))
    last = record.last_sample
    if last is not None and last.stages:
        rows = [[name, st.replicas, pct(st.busy), pct(st.blocked_in), pct(st.blocked_out), st.items_out]
                for name, st in last.stages.items()]
        parts.append(table(rows, ["stage", "replicas", "busy", "starved", "blocked out", "items out"],
                           title=f"stage load ({last.window_label})"))
    if quality := data_quality(last):
        parts.append(table(quality, ["stage", "records", "what happened"], title="data: records not trained as read (see the log for file:line)"))
    if record.bottleneck is not None:
        parts.append(Text(f"bottleneck: {record.bottleneck.sentence}"))
    if record.artifacts:
        parts.append(table([[k, v] for k, v in record.artifacts.items()], ["artifact", "path"], title="artifacts"))
    return render(*parts, width=width)
