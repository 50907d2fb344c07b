"""A pipeline's replicas built from its validated graph (placed, with contexts, resume states, channels)."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from typing import Any

from .channel import Channel, make_router
from .devices import RankLayout, device_groups, plan_groups, visible_gpu_count
from .graph import Graph
from .metrics import MetricSet
from .replica import Replica
from .stage import StageContext
from .validate import Validated


def assemble(v: Validated, pipe: Any, *, stop: threading.Event, resume_state: dict[str, list[dict[str, Any]]],
             collect: list[str]) -> tuple[str | None, dict[str, list[Replica]], dict[str, Channel]]:
    """(this rank's first GPU, replicas by stage, collect channels); ``pipe``: the Pipeline they run in."""
    g = v.graph
    layout = RankLayout(visible=visible_gpu_count(), local_world_size=pipe.local_world_size,
                        local_rank=pipe.local_rank, gpus_per_rank=g.runtime.gpus_per_rank, shared=g.runtime.share_gpus)
    gpus = layout.gpus()
    home = f"cuda:{gpus[0]}" if gpus else None
    devices: dict[str, list[list[str]]] = {}  # stage -> the devices of each replica, first one first
    for spec in g.stages:
        placed, _problems, warning = plan_groups(device_groups(spec.devices), spec.replicas, layout)  # validated
        if warning:
            warnings.warn(f"stage '{spec.name}': {warning}", RuntimeWarning, stacklevel=3)
        devices[spec.name] = placed
    replicas: dict[str, list[Replica]] = {}
    for spec in g.stages:
        template = v.configs[spec.name]
        # A consumer replica takes its input on its first device.
        downstream = sorted({d[0] for c, _ in g.consumers(spec.name) for d in devices[c.name]})
        states = resume_state.get(spec.name)
        reps = []
        for i in range(spec.replicas):
            # Each replica owns its stage object; replica 0 reuses the validated (or user's) instance.
            stage = template if i == 0 else copy.deepcopy(template)
            ctx = StageContext(
                name=spec.name, replica=i, num_replicas=spec.replicas, rank=pipe.rank, world_size=pipe.world_size,
                local_rank=pipe.local_rank, local_world_size=pipe.local_world_size, device=devices[spec.name][i][0],
                devices=devices[spec.name][i], downstream_devices=downstream, seed=g.seed, output_dir=pipe.output_dir,
                services=pipe.services, metrics=MetricSet(), stop_requested=stop, runtime=pipe)
            rep = Replica(spec.name, spec.type, i, stage, ctx)
            rep.home_device = home
            if states:
                rep.resume_state = states[i] if i < len(states) else states[-1]
            reps.append(rep)
        replicas[spec.name] = reps
    channels = wire(g, replicas, collect)
    one_to_one = {n for n, c in v.classes.items() if c.cardinality == "1:1" and not c.is_source()}
    for spec in (s for s in g.stages if s.ordered):
        # Tombstones are needed where an ordered consumer lies downstream through 1:1 stages.
        for name in upstream_of(g, spec.name, one_to_one.__contains__):
            for rep in replicas[name]:
                rep.send_tombstones = True
        for rep in replicas[spec.name]:  # it watches its upstream's progress (Channel.get_seq)
            rep.upstream = [r for name in sorted(upstream_of(g, spec.name)) for r in replicas[name]]
    return home, replicas, channels


def wire(g: Graph, replicas: dict[str, list[Replica]], collect: list[str]) -> dict[str, Channel]:
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
    # Routers: one per edge, shared by all producer replicas (one round-robin counter per edge).
    for spec in g.stages:
        for inp in spec.inputs:
            router = make_router(inp.policy, [r.input for r in replicas[spec.name]])
            for prod in replicas[inp.stage]:
                prod.routers.append(router)
    for name in collect:
        ch = collected[name] = Channel(max(g.runtime.capacity, 1), name=f"collect:{name}", producers=len(replicas[name]))
        router = make_router("round_robin", [ch])
        for prod in replicas[name]:
            prod.routers.append(router)
    return collected


def upstream_of(g: Graph, stage: str, through: Callable[[str], bool] = lambda _: True) -> set[str]:
    """Every stage ``stage`` reads from, directly or through stages ``through`` accepts."""
    todo, seen = [i.stage for i in g.stage(stage).inputs], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            if through(name):
                todo.extend(i.stage for i in g.stage(name).inputs)
    return seen


def only_feeding(g: Graph, stage: str, collected: Any = ()) -> list[str]:
    """The stages whose work can only reach ``stage`` (a collected stage has a consumer outside the graph)."""
    gone = {stage}
    changed = True
    while changed:
        changed = False
        for spec in g.stages:
            if spec.name in gone:
                continue
            consumers = {c.name for c, _ in g.consumers(spec.name)}
            if spec.name in collected:
                consumers.add("<collect>")
            if consumers and consumers <= gone:
                gone.add(spec.name)
                changed = True
    gone.discard(stage)
    return sorted(gone)
