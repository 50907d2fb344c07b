"""What the supervisor reports about a running pipeline: plain attrs objects, built once per
``Pipeline.snapshot()`` and read by the Monitor, the bottleneck analysis and the end-of-run report."""

from __future__ import annotations

from typing import Any

import attrs

from .channel import ChannelStats
from .metrics import merge_values


@attrs.define
class ReplicaSnapshot:
    replica: int
    device: str
    state: str
    items_in: int
    items_out: int
    busy_s: float
    blocked_in_s: float
    blocked_out_s: float
    alive_s: float
    metrics: dict[str, Any]
    channel: ChannelStats | None


@attrs.define
class StageSnapshot:
    name: str
    type: str
    replicas: list[ReplicaSnapshot]
    metric_kinds: dict[str, str]

    def metric(self, name: str) -> Any:
        values = [r.metrics[name] for r in self.replicas if name in r.metrics]
        return merge_values(self.metric_kinds.get(name, "gauge"), values)

    def fractions(self) -> dict[str, float]:
        alive = sum(r.alive_s for r in self.replicas) or 1e-9
        return {
            "busy": sum(r.busy_s for r in self.replicas) / alive,
            "blocked_in": sum(r.blocked_in_s for r in self.replicas) / alive,
            "blocked_out": sum(r.blocked_out_s for r in self.replicas) / alive,
        }


@attrs.define
class RuntimeSnapshot:
    time: float
    elapsed_s: float
    stages: dict[str, StageSnapshot]

    def flat(self) -> dict[str, float]:
        """Every number, keyed ``stage/NAME/...`` (for logging)."""
        out: dict[str, float] = {}
        for name, st in self.stages.items():
            p = f"stage/{name}"
            for k, v in st.fractions().items():
                out[f"{p}/{k}_frac"] = v
            out[f"{p}/items_out"] = sum(r.items_out for r in st.replicas)
            out[f"{p}/items_in"] = sum(r.items_in for r in st.replicas)
            for r in st.replicas:
                if r.channel is not None:
                    out[f"queue/{name}/{r.replica}/depth"] = r.channel.depth
            for mname in st.metric_kinds:
                v = st.metric(mname)
                _flatten_metric(out, f"{p}/{mname}", v)
        return out


def _flatten_metric(out: dict[str, float], key: str, value: Any) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten_metric(out, f"{key}/{k}", v)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[key] = float(value)


