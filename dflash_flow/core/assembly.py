"""A pipeline's replicas built from its validated graph (``Pipeline.__init__``): placed on this rank's devices,
one stage object and context each, their resume states, the channels wired; and the graph walks the supervisor
needs."""

from __future__ import annotations

import copy
import threading
import warnings
from pathlib import Path
from typing import Any

import attrs

from .channel import Channel, make_router
from .devices import RankLayout, place_replicas, visible_gpu_count
from .graph import Graph
from .metrics import MetricSet
from .replica import Replica
from .stage import StageContext
from .validate import Validated


@attrs.frozen
class Assembly:
    home_device: str | None  # this rank's first GPU (devices.setup_thread)
    replicas: dict[str, list[Replica]]
    collect: dict[str, Channel]  # the collected stages' outputs (Pipeline.iterate)


@attrs.frozen(kw_only=True)
class Place:
    """Where and as whom the replicas run."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    output_dir: Path


def assemble(v: Validated, place: Place, *, services: Any, stop: threading.Event, view: Any,
             resume_state: dict[str, list[dict[str, Any]]], collect: list[str]) -> Assembly:
    g = v.graph
    layout = RankLayout(visible=visible_gpu_count(), local_world_size=place.local_world_size,
                        local_rank=place.local_rank, gpus_per_rank=g.runtime.gpus_per_rank, shared=g.runtime.share_gpus)
    gpus = layout.gpus()
    home = f"cuda:{gpus[0]}" if gpus else None
    devices: dict[str, list[list[str]]] = {}  # stage -> the devices of each replica, first one first
    for spec in g.stages:
        placed, warning = place_replicas(spec.devices, spec.replicas, layout)
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
                name=spec.name, replica=i, num_replicas=spec.replicas, rank=place.rank, world_size=place.world_size,
                local_rank=place.local_rank, local_world_size=place.local_world_size, device=devices[spec.name][i][0],
                devices=devices[spec.name][i], downstream_devices=downstream, seed=g.seed, output_dir=place.output_dir,
                services=services, metrics=MetricSet(), stop_requested=stop, runtime=view)
            rep = Replica(spec.name, spec.type, i, stage, ctx)
            rep.home_device = home
            if states:
                rep.resume_state = states[i] if i < len(states) else states[-1]
            reps.append(rep)
        replicas[spec.name] = reps
    channels = wire(g, v.classes, replicas, collect)
    for spec in g.stages:  # an ordered consumer watches its upstream's progress (Channel.get_seq)
        if spec.ordered:
            for rep in replicas[spec.name]:
                rep.upstream = [r for name in sorted(upstream_of(g, spec.name)) for r in replicas[name]]
    return Assembly(home, replicas, channels)


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


def upstream_of(g: Graph, stage: str) -> set[str]:
    """Every stage ``stage`` reads from, directly or not."""
    todo, seen = [i.stage for i in g.stage(stage).inputs], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(i.stage for i in g.stage(name).inputs)
    return seen


def only_feeding(g: Graph, stage: str, collected: Any = ()) -> list[str]:
    """The stages all of whose consumers are ``stage`` or such stages (a collected stage has a consumer
    outside the graph): the work that can only reach ``stage``."""
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
