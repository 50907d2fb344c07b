"""Every composed metric name (``trained-T0_7``, ``tau_h448``, ``accuracy_pos3``), made here only, from typed
records at export; nothing reads a name back."""

from __future__ import annotations

from typing import Any

from dflash_flow.items import EvalReport

from .schema import key_part


def eval_label(report: EvalReport) -> str:
    """The evaluation's label in keys and tables: its name (``trained``, ``walk``), and a sampled decoding's
    temperature after it, with only characters MLflow keys keep (``trained-T0_7``)."""
    if not report.sampled:
        return report.name
    return f"{report.name}-T" + f"{float(report.temperature):g}".replace(".", "_")


def horizon_name(metric: str, horizon: int) -> str:
    """The name of ``metric`` measured at a new-token horizon: ``tau_h448``."""
    return f"{metric}_h{int(horizon)}"


def position_accuracy_name(k: int) -> str:
    """The name of block slot ``k``'s accuracy (``accuracy_pos<k>``, k from 1)."""
    return f"accuracy_pos{int(k)}"


def eval_facts(report: EvalReport) -> dict[str, Any]:
    """The evaluation's settings and facts (not measurements), left out where the evaluation has none."""
    facts = {
        "max_new_tokens": report.max_new_tokens, "temperature": report.temperature, "top_p": report.top_p,
        "top_k": report.top_k, "lossless": report.lossless, "num_prompts": report.num_prompts,
        "num_conversations": report.num_conversations,
    }
    return {k: v for k, v in facts.items() if v is not None}


def eval_metrics(report: EvalReport) -> dict[str, float]:
    """MLflow's metrics ``eval/<label>/<name>``: the measurements only, ``metrics`` as they are (the first
    horizon's), then ``<figure>_h<H>`` for every figure at every horizon; facts are tags (:func:`eval_tags`)."""
    out = {k: float(v) for k, v in report.metrics.items()}
    out.update((horizon_name(k, h), float(v)) for h, figures in report.by_horizon.items() for k, v in figures.items())
    return out


def eval_tags(report: EvalReport) -> dict[str, Any]:
    """The evaluation's facts as MLflow tags ``eval/<label>/<fact>`` (``eval/trained/lossless``: True)."""
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
