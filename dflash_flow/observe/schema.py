"""The metric schema: metrics declared once as typed attrs fields (:func:`metric`, with their reduction across
ranks), exported to MLflow keys mechanically (:func:`mlflow_metrics`): ``/<key>`` per field,
``/<key_part(name)>`` per mapping entry, ``/<position>`` per element; None, NaN and infinities give no point.
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
    "train/loss", "train_epoch/sim_accept_len", "heldout/tau", "eval/trained/tau",
    "eval/trained/speedup_forwards", "eval/walk/tau", "train/tokens_per_s", "train/lr", "bottleneck/busy",
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
    """A name as one MLflow key segment, injectively: letters, digits, ``_`` and ``-`` kept (stage names
    appear verbatim), every other character, ``.`` included, ``.`` plus two hex digits per UTF-8 byte
    (``"a b"`` -> ``a.20b``, ``"a.20b"`` -> ``a.2e20b``)."""
    out = [ch if ch.isalnum() or ch in "_-" else "".join(f".{b:02x}" for b in ch.encode("utf-8")) for ch in str(name)]
    return "".join(out) or ".00"  # the empty name still needs a segment (and "\0" is never a real name)


def _walk(value: Any, path: str, spec: MetricSpec | None, leaf: str | None) -> Iterator[MetricPoint]:
    if value is None:
        return
    if attrs.has(type(value)):
        for f in attrs.fields(type(value)):
            if (inner := f.metadata.get(_SPEC)) is not None:
                yield from _walk(getattr(value, f.name), f"{path}/{inner.key}" if path else inner.key, inner, None)
    elif spec is None:
        return
    elif isinstance(value, Mapping):
        for name, v in value.items():
            yield from _walk(v, f"{path}/{key_part(name)}", spec, str(name) if leaf is None else leaf)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}/{spec.element(i) if spec.element is not None else i}", spec, leaf)
    elif isinstance(value, (int, float)) and math.isfinite(x := float(value)):
        yield MetricPoint(path, x, spec.reduce(leaf or "") if callable(spec.reduce) else spec.reduce)


def metric_points(obj: Any) -> list[MetricPoint]:
    """Every declared number of ``obj`` (an attrs instance) as a keyed point with its reduction."""
    return list(_walk(obj, "", None, None))


def mlflow_metrics(obj: Any, *, rank: int | None = None) -> dict[str, float]:
    """The MLflow boundary: ``obj`` as ``{"a/b/c": value}``; with ``rank``, under ``rank<r>/``."""
    prefix = "" if rank is None else f"rank{int(rank)}/"
    return {prefix + p.key: p.value for p in metric_points(obj)}


def reduce_ranks(per_rank: Sequence[Sequence[MetricPoint]]) -> dict[str, float]:
    """Combine the points of several ranks key by key with each point's declared reduction (a key missing
    on some ranks: over the ranks that have it)."""
    groups: dict[str, tuple[str, list[float]]] = {}
    for points in per_rank:
        for p in points:
            groups.setdefault(p.key, (p.reduce, []))[1].append(p.value)
    how_to = {"sum": math.fsum, "mean": lambda v: math.fsum(v) / len(v), "max": max, "min": min}
    last = lambda v: v[-1]  # noqa: E731 - "last": the highest rank's value
    return {key: how_to.get(how, last)(values) for key, (how, values) in groups.items()}


def train_reduction(name: str) -> str:
    """How a trainer metric combines over ranks (``items.TRAIN_METRIC_REDUCTIONS``; else the mean)."""
    return TRAIN_METRIC_REDUCTIONS.get(name, "mean")
