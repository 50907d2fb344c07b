"""Every composed metric name, made here and only here, from typed records, when a run is exported.

The program keeps its results typed (``items.EvalReport``: figures keyed by horizon, the temperature and
the run's facts as fields; ``items.StepReport.position_accuracy``: a sequence). MLflow wants flat keys,
so at the boundary -- the Monitor logging a report, the summary files, the printed tables -- the names
users see are made from those fields by the functions below: ``trained-T0_7`` (:func:`eval_label`),
``tau_h448`` (:func:`horizon_name`), ``accuracy_pos3`` (:func:`position_accuracy_name`). Nothing reads a
name back: a reader wants the typed record (``RunRecord.evals``) or ``monitor/summary.json`` written
from it (``tests/architecture/test_no_name_parsing.py`` holds app/ and observe/ to that).
"""

from __future__ import annotations

from typing import Any

from dflash_flow.items import EvalReport


def temperature_tag(temperature: float) -> str:
    """``T1``, ``T0_7``: a temperature in an evaluation's label, with only characters MLflow keys keep."""
    return "T" + f"{temperature:g}".replace(".", "_")


def eval_label(report: EvalReport) -> str:
    """The evaluation's label in keys and tables: its name (``trained``, ``walk``), and a sampled
    decoding's temperature after it (``trained-T0_7``)."""
    if report.sampled:
        return f"{report.name}-{temperature_tag(float(report.temperature))}"
    return report.name


def horizon_name(metric: str, horizon: int) -> str:
    """The name of ``metric`` measured at a new-token horizon: ``tau_h448``."""
    return f"{metric}_h{int(horizon)}"


def position_accuracy_name(k: int) -> str:
    """The name of block slot ``k``'s accuracy (``accuracy_pos<k>``, k from 1)."""
    return f"accuracy_pos{int(k)}"


def eval_facts(report: EvalReport) -> dict[str, Any]:
    """The evaluation's settings and facts (not measurements): how it decoded, how many prompts, whether
    the output was lossless. None where the evaluation has no such fact."""
    facts = {
        "max_new_tokens": report.max_new_tokens,
        "temperature": report.temperature,
        "top_p": report.top_p,
        "top_k": report.top_k,
        "lossless": report.lossless,
        "num_prompts": report.num_prompts,
        "num_conversations": report.num_conversations,
    }
    return {k: v for k, v in facts.items() if v is not None}


def eval_figures(report: EvalReport) -> dict[str, float]:
    """The evaluation's measurements as flat names: ``metrics`` as they are (the first horizon's), then
    ``<figure>_h<H>`` for every figure at every horizon."""
    out = {k: float(v) for k, v in report.metrics.items()}
    for h, figures in report.by_horizon.items():
        for k, v in figures.items():
            out[horizon_name(k, h)] = float(v)
    return out


def eval_metrics(report: EvalReport) -> dict[str, float]:
    """What MLflow gets as metrics ``eval/<label>/<name>``: the measurements (:func:`eval_figures`) only;
    settings and facts (``max_new_tokens``, ``lossless``, ...) are tags (:func:`eval_tags`), never curves."""
    return eval_figures(report)


def eval_tags(report: EvalReport) -> dict[str, Any]:
    """The evaluation's facts as MLflow tags ``eval/<label>/<fact>`` (``eval/trained/lossless``: True)."""
    from .schema import key_part

    label = key_part(eval_label(report))
    return {f"eval/{label}/{k}": v for k, v in eval_facts(report).items()}


def eval_json(report: EvalReport) -> dict[str, Any]:
    """The report as ``monitor/summary.json`` holds it: typed, horizons as keys (JSON strings)."""
    return {
        "name": report.name,
        **eval_facts(report),
        "metrics": dict(report.metrics),
        "by_horizon": {str(h): dict(f) for h, f in report.by_horizon.items()},
    }
