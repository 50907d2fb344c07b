"""Which stage is holding the others back, and how many replicas would fix it. Pure functions.

Inputs are per-stage fractions of wall time over a sampling window, averaged over the stage's
replicas (each in [0, 1]):

- ``busy``        the replica was running its own work (``process``/``next``);
- ``blocked_in``  it waited for an input item (starved by upstream);
- ``blocked_out`` it waited to put an output item (back-pressured by downstream).

Model. In steady state every stage passes the same items per second ``X``. A stage with ``r``
replicas and per-item service time ``t`` is busy ``u = X * t / r`` of the time, so the stage with the
highest busy fraction is the one that saturates first as ``X`` grows: it is the bottleneck. Stages
upstream of it show ``blocked_out`` (they wait for it to take their output), stages downstream show
``blocked_in`` (they wait for its output). When busy fractions are within ``tie_tolerance`` of each
other, that waiting is the evidence used to break the tie (given the DAG ``edges``, the stage whose
producers are blocked on output and whose consumers are blocked on input wins); then the stage that is
itself less blocked on output; then a sink.

Replicas needed. The bottleneck's work is ``r * u`` replica-equivalents at the current throughput.
Spread over ``r'`` replicas its busy fraction becomes ``r * u / r'``. It stops being the bottleneck
when that is no more than the next-busiest stage's busy fraction ``u2`` (which is then the new
bottleneck), so::

    replicas_needed = max(r + 1, ceil(r * u / max(u2, min_util)))

``min_util`` (default 0.05) keeps the answer finite when every other stage is nearly idle. The number
assumes replicas scale linearly (work that releases the GIL, or a device per replica); for a sink
(the trainer) the sentence says the pipeline is doing what it should: keeping the trainer fed.

Only what the user can change is advised. A stage named in ``fixed`` cannot take more replicas (a
singleton such as the trainer, an ``ordered`` stage, a source that does not shard): its
``replicas_needed`` is its replica count and the sentence names the lever that exists instead (more
data-parallel ranks for the trainer, a cheaper stage otherwise).

Which stages are judged is the caller's choice (``observe.sample``): the run's verdict is taken over the
steady state (first to last training step), among the stages alive for most of it, so a one-shot reader
that finished before training started is never named.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs

from .schema import metric


@attrs.frozen
class StageLoad:
    """One stage's load over a window (fractions averaged over its replicas)."""

    name: str
    replicas: int
    busy: float
    blocked_in: float = 0.0
    blocked_out: float = 0.0

    @property
    def idle(self) -> float:
        return max(0.0, 1.0 - self.busy - self.blocked_in - self.blocked_out)


@attrs.frozen
class Bottleneck:
    """The verdict: ``stage`` is the bottleneck; see the module docstring for the definitions.

    The numbers are exported as ``bottleneck/*`` metrics (``observe.schema``); the stage's name and the
    sentence are text, for the run summary and the ``bottleneck`` tag."""

    stage: str
    busy: float = metric("busy", reduce="max", doc="Busy fraction of the bottleneck stage")
    replicas: int = metric("replicas", reduce="max", doc="Its replicas")
    replicas_needed: int = metric("replicas_needed", reduce="max", doc="Replicas that would make it stop being the bottleneck")
    next_stage: str | None = None
    next_busy: float = metric("next_busy", reduce="max", default=0.0, doc="Busy fraction of the next-busiest stage")
    is_sink: bool = False
    replicable: bool = metric("replicable", reduce="min", default=True, doc="1 when more replicas of it are possible (0: a singleton, ordered or non-sharding source; grow it by ranks or make it cheaper)")
    saturated: bool = metric("saturated", reduce="max", default=False, doc="1 when its busy fraction is at least `saturation`")
    sentence: str = ""
    loads: dict[str, StageLoad] = attrs.field(factory=dict, repr=False)


def _clip(x: float) -> float:
    x = float(x)
    if math.isnan(x):
        return 0.0
    return min(1.0, max(0.0, x))


def to_loads(stages: Mapping[str, Mapping[str, float]]) -> dict[str, StageLoad]:
    """``{stage: {"replicas", "busy", "blocked_in", "blocked_out"}}`` -> ``{stage: StageLoad}``."""
    out = {}
    for name, d in stages.items():
        out[name] = StageLoad(
            name=name,
            replicas=max(1, int(d.get("replicas", 1))),
            busy=_clip(d.get("busy", 0.0)),
            blocked_in=_clip(d.get("blocked_in", 0.0)),
            blocked_out=_clip(d.get("blocked_out", 0.0)),
        )
    return out


def _waiting_evidence(
    name: str, loads: Mapping[str, StageLoad], edges: Mapping[str, Sequence[str]] | None
) -> float:
    """How much its neighbours wait for ``name``: producers blocked on output + consumers blocked on input."""
    if not edges:
        return 0.0
    consumers = [c for c in edges.get(name, ()) if c in loads]
    producers = [p for p, cs in edges.items() if name in cs and p in loads]
    ev = 0.0
    if consumers:
        ev += sum(loads[c].blocked_in for c in consumers) / len(consumers)
    if producers:
        ev += sum(loads[p].blocked_out for p in producers) / len(producers)
    return ev


def replicas_needed(replicas: int, busy: float, next_busy: float, *, min_util: float = 0.05) -> int:
    """``max(r + 1, ceil(r * busy / max(next_busy, min_util)))`` -- see the module docstring."""
    r = max(1, int(replicas))
    target = max(float(next_busy), float(min_util))
    # The small epsilon keeps float noise (0.9 / 0.45 = 2.0000000000000004) from adding a replica.
    return max(r + 1, math.ceil(r * float(busy) / target - 1e-9))


def find_bottleneck(
    stages: Mapping[str, Mapping[str, float]] | Mapping[str, StageLoad],
    sinks: Iterable[str] = (),
    *,
    edges: Mapping[str, Sequence[str]] | None = None,
    tie_tolerance: float = 0.02,
    saturation: float = 0.8,
    min_util: float = 0.05,
    fixed: Iterable[str] = (),
) -> Bottleneck | None:
    """Name the bottleneck stage, the replicas it needs to stop being one, and a sentence.

    ``stages``: ``{stage: {"replicas": r, "busy": f, "blocked_in": f, "blocked_out": f}}`` (or
    ``StageLoad`` values). ``sinks``: stages that end the pipeline (the trainer), for which being the
    bottleneck is the goal. ``edges``: optional ``{stage: [downstream stages]}`` used as tie-break
    evidence. ``fixed``: stages that cannot take more replicas (see the module docstring). Returns None
    for an empty mapping.
    """
    if not stages:
        return None
    first = next(iter(stages.values()))
    loads = dict(stages) if isinstance(first, StageLoad) else to_loads(stages)  # type: ignore[arg-type]
    sinks = set(sinks)
    top = max(ld.busy for ld in loads.values())
    contenders = [ld for ld in loads.values() if ld.busy >= top - tie_tolerance]

    def rank(ld: StageLoad):
        return (_waiting_evidence(ld.name, loads, edges), -ld.blocked_out, ld.name in sinks, ld.busy)

    best = max(contenders, key=rank)
    others = [ld for ld in loads.values() if ld.name != best.name]
    nxt = max(others, key=lambda ld: ld.busy) if others else None
    next_busy = nxt.busy if nxt else 0.0
    replicable = best.name not in set(fixed)
    need = replicas_needed(best.replicas, best.busy, next_busy, min_util=min_util) if replicable else best.replicas
    saturated = best.busy >= saturation
    is_sink = best.name in sinks
    sentence = _sentence(best, nxt, need, is_sink, saturated, loads, min_util, replicable)
    return Bottleneck(
        stage=best.name,
        busy=best.busy,
        replicas=best.replicas,
        replicas_needed=need,
        next_stage=nxt.name if nxt else None,
        next_busy=next_busy,
        is_sink=is_sink,
        replicable=replicable,
        saturated=saturated,
        sentence=sentence,
        loads=loads,
    )


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _sentence(
    b: StageLoad,
    nxt: StageLoad | None,
    need: int,
    is_sink: bool,
    saturated: bool,
    loads: Mapping[str, StageLoad],
    min_util: float,
    replicable: bool = True,
) -> str:
    reps = f"{b.replicas} replica" + ("s" if b.replicas != 1 else "")
    waiting = sorted(
        (ld for ld in loads.values() if ld.name != b.name and max(ld.blocked_in, ld.blocked_out) >= 0.2),
        key=lambda ld: -max(ld.blocked_in, ld.blocked_out),
    )
    wait_txt = ""
    if waiting:
        parts = [
            f"{ld.name} {_pct(ld.blocked_out)} blocked on output"
            if ld.blocked_out >= ld.blocked_in
            else f"{ld.name} {_pct(ld.blocked_in)} starved"
            for ld in waiting[:3]
        ]
        wait_txt = " (" + ", ".join(parts) + ")"
    if not saturated:
        return (
            f"No stage is saturated: the busiest, {b.name}, is busy {_pct(b.busy)} of the time on {reps}; "
            f"the pipeline is limited by latency or by its source, not by one stage's capacity."
        )
    if is_sink:
        lever = (
            " To go faster, add data-parallel ranks (`--nproc N`): it cannot be replicated within a rank."
            if not replicable
            else ""
        )
        return (
            f"{b.name} is the bottleneck, busy {_pct(b.busy)} on {reps}{wait_txt}: the input pipeline keeps it fed, "
            f"which is the goal.{lever}"
        )
    if nxt is None:
        return f"{b.name} is the only stage, busy {_pct(b.busy)} on {reps}."
    if not replicable:
        return (
            f"{b.name} is the bottleneck: busy {_pct(b.busy)} on {reps}{wait_txt}. It cannot be replicated "
            f"within a rank: make its work cheaper, or add data-parallel ranks (`--nproc N`), each with its own {b.name}."
        )
    nb = max(nxt.busy, min_util)
    return (
        f"{b.name} is the bottleneck: busy {_pct(b.busy)} on {reps}{wait_txt}. "
        f"With {need} replicas it would drop to about {_pct(b.replicas * b.busy / need)} busy, "
        f"no more than the next-busiest stage, {nxt.name} ({_pct(nb)})."
    )
