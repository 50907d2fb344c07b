"""Per-replica metrics, written by one thread, read without locks; a stage declares them as typed fields::

    @attrs.define
    class PadderMetrics:
        real_tokens: Counter = stage_metric("tokens", "Real tokens padded")
        seq_len: Summary = stage_metric("tokens", "Sequence lengths (mean, max)")

    def setup(self, ctx):
        self._m = ctx.metrics.declare(PadderMetrics)  # then self._m.real_tokens.inc(n)
"""

from __future__ import annotations

import math
from typing import Any, TypeVar

import attrs


@attrs.define(eq=False)
class Metric:
    name: str
    unit: str
    description: str
    kind = "metric"

    def read(self) -> Any:  # Counter, Gauge; the others override it
        return self.value


@attrs.define(eq=False)
class Counter(Metric):
    kind = "counter"
    value: float = 0

    def inc(self, n: float = 1) -> None:
        self.value += n


@attrs.define(eq=False)
class Gauge(Metric):
    kind = "gauge"
    value: float = math.nan

    def set(self, v: float) -> None:
        self.value = v


@attrs.define(eq=False)
class Summary(Metric):
    """Count, total, min and max of observed values (enough for mean and max without storing samples)."""

    kind = "summary"
    count: int = 0
    total: float = 0.0
    min: float = math.inf
    max: float = -math.inf

    def observe(self, v: float) -> None:
        self.count += 1
        self.total += v
        self.min, self.max = min(self.min, v), max(self.max, v)

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else math.nan

    def read(self) -> dict[str, float]:
        return {"count": self.count, "total": self.total, "min": self.min, "max": self.max, "mean": self.mean}


@attrs.define(eq=False)
class Labeled(Metric):
    """Counts per label (e.g. batches per bucket)."""

    kind = "labeled"
    values: dict[str, float] = attrs.field(factory=dict)

    def inc(self, label: object, n: float = 1) -> None:
        key = str(label)
        self.values[key] = self.values.get(key, 0) + n

    def read(self) -> dict[str, float]:
        return self.values.copy()  # dict.copy is atomic under the GIL


_DECLARED = "dflash_flow.stage_metric"
T = TypeVar("T")


def stage_metric(unit: str = "", description: str = "") -> Any:
    """A field of a stage's metrics class (see the module doc)."""
    return attrs.field(metadata={_DECLARED: (unit, description)})


def declared_metrics(cls: type) -> list[tuple[str, type[Metric], str, str]]:
    """(name, kind, unit, description) of every metric a metrics class declares (``dflash-flow stages`` lists them)."""
    attrs.resolve_types(cls)
    out = []
    for f in attrs.fields(cls):
        if _DECLARED not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with core.metrics.stage_metric(unit, description)")
        if not (isinstance(f.type, type) and issubclass(f.type, Metric) and f.type is not Metric):
            raise TypeError(f"{cls.__name__}.{f.name}: type it Counter, Gauge, Summary or Labeled, not {f.type!r}")
        out.append((f.name, f.type, *f.metadata[_DECLARED]))
    return out


class MetricSet:
    """The metrics of one stage replica."""

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def _declare(self, cls: type[Metric], name: str, unit: str, description: str) -> Any:
        metric = self._metrics.setdefault(name, cls(name=name, unit=unit, description=description))
        if type(metric) is not cls:
            raise ValueError(f"metric '{name}' already declared as {metric.kind}")
        return metric

    def counter(self, name: str, unit: str = "", description: str = "") -> Counter:
        return self._declare(Counter, name, unit, description)

    def summary(self, name: str, unit: str = "", description: str = "") -> Summary:
        return self._declare(Summary, name, unit, description)

    def labeled(self, name: str, unit: str = "", description: str = "") -> Labeled:
        return self._declare(Labeled, name, unit, description)

    def declare(self, cls: type[T]) -> T:
        """Declare every metric of a stage's metrics class and return an instance holding them."""
        return cls(**{name: self._declare(kind, name, unit, description)
                      for name, kind, unit, description in declared_metrics(cls)})

    def __iter__(self):
        return iter(list(self._metrics.values()))

    def read(self) -> dict[str, Any]:
        return {m.name: m.read() for m in list(self._metrics.values())}


def merge_values(kind: str, values: list[Any]) -> Any:
    """Aggregate one metric across replicas."""
    if not values:
        return None
    if kind == "counter":
        return sum(values)
    if kind == "gauge":
        finite = [v for v in values if not (isinstance(v, float) and math.isnan(v))]
        return finite[-1] if finite else math.nan
    if kind == "summary":
        count = sum(v["count"] for v in values)
        total = sum(v["total"] for v in values)
        return {"count": count, "total": total, "min": min(v["min"] for v in values),
                "max": max(v["max"] for v in values), "mean": total / count if count else math.nan}
    if kind == "labeled":
        out: dict[str, float] = {}
        for v in values:
            for k, n in v.items():
                out[k] = out.get(k, 0) + n
        return out
    raise ValueError(kind)
