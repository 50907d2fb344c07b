"""The metric schema: metrics declared once, as typed attrs fields, and exported to MLflow mechanically.

Why: the Monitor, the plots, the bottleneck analysis and the end-of-run report all read the same
structured objects (``observe.sample``, ``observe.record``); nothing builds ``"a/b/c"`` strings to parse
them back later. Keys exist only at the MLflow boundary, made by :func:`metric_points` /
:func:`mlflow_metrics` from the field declarations (Ray Data's ``metric_field`` idea, at our scale).
``docs/metrics.md`` lists every key.

Declaring: a field made with :func:`metric` is exported under ``key``, with the reduction that combines
its values across ranks (``sum`` for counts, tokens and throughput, ``mean`` for fractions, loss and
acceptance, ``max`` for times and depths). Fields made without it (names, states, sentences) are data,
not metrics.

Walking (one rule per value type, applied recursively from the object passed in):

- an attrs instance: each declared field adds ``/<key>`` to the path;
- a mapping: each entry adds ``/<key_part(name)>`` (stage names, metric names, labels, buckets);
- a list/tuple: each element adds ``/<position>`` (replicas);
- a number (a bool counts 0/1): one point at the path; None, NaN and infinities: no point.

Ranks: a scale-out run reduces each rank's :class:`MetricPoint` list with :func:`reduce_ranks` (the
reduction travels with every point) and may log each rank's own values under ``rank<r>/`` with
``mlflow_metrics(obj, rank=r)`` -- same keys, one schema.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from dflash_flow.items import TRAIN_METRIC_REDUCTIONS

REDUCTIONS = frozenset({"sum", "mean", "max", "min", "last"})

#: The metrics a person charts first, in that order (docs/metrics.md "Chart these first" lists the same; a
#: run carries them in its ``headline_metrics`` tag). The rest are grouped by their first key segment.
HEADLINE_METRICS: tuple[str, ...] = (
    "train/loss",
    "train_epoch/sim_accept_len",
    "heldout/tau",
    "eval/trained/tau",
    "eval/trained/speedup_forwards",
    "eval/walk/tau",
    "train/tokens_per_s",
    "train/lr",
    "bottleneck/busy",
)
_SPEC = "dflash_flow.metric"

Reduce = str | Callable[[str], str]  # a reduction, or one per mapping key (train metrics)


@attrs.frozen
class MetricSpec:
    key: str
    reduce: Reduce
    doc: str
    element: Callable[[int], str] | None = None  # the segment of a sequence's element i (default: str(i))


def metric(key: str, *, reduce: Reduce = "mean", doc: str = "", element: Callable[[int], str] | None = None,
           **field_kwargs: Any) -> Any:
    """An attrs field exported as ``<path>/<key>`` (``key`` is a constant of ours, never user input);
    ``element`` names a sequence's elements (``observe.names.position_accuracy_name``: slot accuracies)."""
    if isinstance(reduce, str) and reduce not in REDUCTIONS:
        raise ValueError(f"reduce must be one of {sorted(REDUCTIONS)}, got {reduce!r}")
    return attrs.field(metadata={_SPEC: MetricSpec(key, reduce, doc, element)}, **field_kwargs)


def declared(cls: type) -> list[tuple[str, MetricSpec]]:
    """``(field name, spec)`` of the exported fields of an attrs class, in declaration order."""
    return [(f.name, f.metadata[_SPEC]) for f in attrs.fields(cls) if _SPEC in f.metadata]


@attrs.frozen
class MetricPoint:
    key: str
    value: float
    reduce: str


# Our own escaping: urllib.parse.quote keeps "~" and uses "%", neither of which MLflow accepts in a key.
def key_part(name: object) -> str:
    """A name as one MLflow key segment, injectively.

    Unicode letters and digits, ``_`` and ``-`` are kept (MLflow accepts them, and they are all a stage
    name may hold, so stage names appear verbatim); every other character, ``.`` and ``/`` included,
    becomes ``.`` plus two hex digits per UTF-8 byte. ``.`` never survives unescaped, so two different
    names always give two different segments (``"a b"`` -> ``a.20b``, ``"a.20b"`` -> ``a.2e20b``).
    """
    text = str(name)
    out = []
    for ch in text:
        if ch.isalnum() or ch in "_-":
            out.append(ch)
        else:
            out.append("".join(f".{b:02x}" for b in ch.encode("utf-8")))
    return "".join(out) or ".00"  # the empty name still needs a segment (and "\0" is never a real name)


def _reduction(spec: MetricSpec, name: str | None) -> str:
    if callable(spec.reduce):
        return spec.reduce(name or "")
    return spec.reduce


def _walk(value: Any, path: str, spec: MetricSpec | None, leaf: str | None) -> Iterator[MetricPoint]:
    if value is None:
        return
    if attrs.has(type(value)):
        for f in attrs.fields(type(value)):
            inner = f.metadata.get(_SPEC)
            if inner is not None:
                yield from _walk(getattr(value, f.name), f"{path}/{inner.key}" if path else inner.key, inner, None)
        return
    if spec is None:
        return
    if isinstance(value, Mapping):
        for name, v in value.items():
            yield from _walk(v, f"{path}/{key_part(name)}", spec, str(name) if leaf is None else leaf)
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            part = spec.element(i) if spec.element is not None else str(i)
            yield from _walk(v, f"{path}/{part}", spec, leaf)
        return
    if isinstance(value, (int, float)):
        x = float(value)
        if math.isfinite(x):
            yield MetricPoint(path, x, _reduction(spec, leaf))


def metric_points(obj: Any) -> list[MetricPoint]:
    """Every declared number of ``obj`` (an attrs instance) as a keyed point with its reduction."""
    return list(_walk(obj, "", None, None))


def rank_prefix(rank: int) -> str:
    return f"rank{int(rank)}"


def mlflow_metrics(obj: Any, *, rank: int | None = None) -> dict[str, float]:
    """The MLflow boundary: ``obj`` as ``{"a/b/c": value}``; with ``rank``, under ``rank<r>/``."""
    prefix = "" if rank is None else rank_prefix(rank) + "/"
    return {prefix + p.key: p.value for p in metric_points(obj)}


def reduce_ranks(per_rank: Sequence[Sequence[MetricPoint]]) -> dict[str, float]:
    """Combine the points of several ranks key by key with each point's declared reduction.

    A key missing on some ranks is reduced over the ranks that have it (a stage may run on rank 0 only).
    """
    groups: dict[str, tuple[str, list[float]]] = {}
    for points in per_rank:
        for p in points:
            groups.setdefault(p.key, (p.reduce, []))[1].append(p.value)
    out = {}
    for key, (how, values) in groups.items():
        if how == "sum":
            out[key] = math.fsum(values)
        elif how == "mean":
            out[key] = math.fsum(values) / len(values)
        elif how == "max":
            out[key] = max(values)
        elif how == "min":
            out[key] = min(values)
        else:  # "last": the highest rank's value
            out[key] = values[-1]
    return out


# -------------------------------------------------------------------------- train metric reductions


def train_reduction(name: str) -> str:
    """How a trainer metric combines over ranks, as ``items.TRAIN_METRIC_REDUCTIONS`` declares it: sums for
    tokens and samples (and their rates), max for times (the slowest rank sets the step time), means for
    the rest (loss, accuracies, acceptance length, learning rate, a variant's terms)."""
    return TRAIN_METRIC_REDUCTIONS.get(name, "mean")
