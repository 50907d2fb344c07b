"""How a pipeline's replicas are joined: one bounded input channel per consumer replica (fed by every
producer replica of every input edge), one router per edge shared by its producers (one round-robin counter
per edge), the collect channels of ``Pipeline.iterate``, and tombstones only where an ordered consumer lies
downstream through 1:1 stages."""

from __future__ import annotations

from typing import Any

from .channel import Channel
from .graph import Graph
from .replica import Replica
from .routing import make_router


def wire(g: Graph, classes: dict[str, Any], replicas: dict[str, list[Replica]], collect: list[str]) -> dict[str, Channel]:
    """Give every replica its input channel and routers; returns the collect channels by stage name."""
    collected: dict[str, Channel] = {}
    # Channels: one per consumer replica, fed by every producer replica of every input edge.
    for spec in g.stages:
        if not spec.inputs:
            continue
        producers = sum(g.stage(i.stage).replicas for i in spec.inputs)
        cap = spec.capacity or g.runtime.capacity
        for rep in replicas[spec.name]:
            rep.input = Channel(cap, name=rep.label, producers=producers)
            rep.ordered = spec.ordered
    for name in collect:
        reps = replicas[name]
        collected[name] = Channel(max(g.runtime.capacity, 1), name=f"collect:{name}", producers=len(reps))
    # Routers: one per edge, shared by all producer replicas (one round-robin counter per edge).
    for spec in g.stages:
        for inp in spec.inputs:
            router = make_router(inp.policy, [r.input for r in replicas[spec.name]])
            for prod in replicas[inp.stage]:
                prod.routers.append(router)
    for name, ch in collected.items():
        router = make_router("round_robin", [ch])
        for prod in replicas[name]:
            prod.routers.append(router)
    # Tombstones are only needed where an ordered consumer lies downstream through 1:1 stages.
    for spec in g.stages:
        if spec.ordered:
            todo = [i.stage for i in spec.inputs]
            seen = set()
            while todo:
                n = todo.pop()
                if n in seen:
                    continue
                seen.add(n)
                for rep in replicas[n]:
                    rep.send_tombstones = True
                cls = classes[n]
                if cls.cardinality == "1:1" and not cls.is_source():
                    todo.extend(i.stage for i in g.stage(n).inputs)
    return collected
