"""Every composed metric name, made here and only here, from typed records when a run is exported:
``trained-T0_7`` (:func:`eval_label`), ``tau_h448`` (:func:`horizon_name`), ``accuracy_pos3``
(:func:`position_accuracy_name`). Nothing reads a name back (``tests/architecture/test_no_name_parsing.py``).
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
    return f"{report.name}-{temperature_tag(float(report.temperature))}" if report.sampled else report.name


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
        "max_new_tokens": report.max_new_tokens, "temperature": report.temperature, "top_p": report.top_p,
        "top_k": report.top_k, "lossless": report.lossless, "num_prompts": report.num_prompts,
        "num_conversations": report.num_conversations,
    }
    return {k: v for k, v in facts.items() if v is not None}


def eval_metrics(report: EvalReport) -> dict[str, float]:
    """What MLflow gets as metrics ``eval/<label>/<name>``: the measurements only, ``metrics`` as they are
    (the first horizon's), then ``<figure>_h<H>`` for every figure at every horizon; settings and facts
    (``max_new_tokens``, ``lossless``, ...) are tags (:func:`eval_tags`), never curves."""
    out = {k: float(v) for k, v in report.metrics.items()}
    out.update((horizon_name(k, h), float(v)) for h, figures in report.by_horizon.items() for k, v in figures.items())
    return out


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
