"""Validation before any thread starts: every problem at once, each located."""

from __future__ import annotations

import difflib
from typing import Any

from . import registry
from .config import structure
from .devices import check_device_string, missing_device, normalize_devices, place, visible_gpu_count
from .errors import ConfigError, Problem
from .graph import Graph, StageSpec
from .routing import POLICIES
from .stage import Stage


class Validated:
    """A graph that passed validation, with its resolved stage classes and per-replica configs."""

    def __init__(self, graph: Graph, classes: dict[str, type[Stage]], configs: dict[str, Any], order: list[str]):
        self.graph = graph
        self.classes = classes
        self.configs = configs  # stage name -> a validated Stage instance (the template for replicas)
        self.order = order  # topological order of stage names


def validate(graph: Graph, *, check_devices: bool = True, gpu_count: int | None = None) -> list[Problem]:
    """Every problem in ``graph`` (empty list when it is valid)."""
    try:
        _validated(graph, check_devices=check_devices, gpu_count=gpu_count)
    except ConfigError as exc:
        return exc.problems
    return []


def validated(graph: Graph, *, check_devices: bool = True, gpu_count: int | None = None) -> Validated:
    return _validated(graph, check_devices=check_devices, gpu_count=gpu_count)


def _validated(graph: Graph, *, check_devices: bool, gpu_count: int | None) -> Validated:
    loc = graph.locator
    problems: list[Problem] = []
    index = {id(s): i for i, s in enumerate(graph.stages)}

    def P(message: str, spec: StageSpec | None = None, *path: Any, field: str | None = None) -> Problem:
        i = index.get(id(spec)) if spec is not None else None
        full = ("stages", i, *path) if i is not None else path
        line = loc.line(*full) if loc is not None else None
        file = loc.filename if loc is not None else None
        return Problem(message, file=file, line=line, stage=spec.name if spec else None, field=field)

    # names
    seen: dict[str, int] = {}
    for i, spec in enumerate(graph.stages):
        if spec.name in seen:
            problems.append(P(f"duplicate stage name '{spec.name}' (first defined as stage #{seen[spec.name] + 1})", spec, "name", field="name"))
        else:
            seen[spec.name] = i
    names = set(seen)

    # types and configs
    classes: dict[str, type[Stage]] = {}
    configs: dict[str, Any] = {}
    known = registry.available()
    for spec in graph.stages:
        try:
            cls = registry.resolve(spec.type)
        except registry.UnknownStageType:
            close = difflib.get_close_matches(spec.type, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; registered types: {', '.join(known)}"
            problems.append(P(f"unknown stage type '{spec.type}'{hint}", spec, "type", field="type"))
            continue
        except Exception as exc:  # a broken plugin must not hide the other problems
            problems.append(P(f"stage type '{spec.type}' failed to load: {type(exc).__name__}: {exc}", spec, "type", field="type"))
            continue
        classes[spec.name] = cls
        instance = graph.instances.get(spec.name)
        if instance is not None and type(instance) is cls and instance.config() == spec.config:
            configs[spec.name] = instance
            continue

        def locate(message: str, key: str | None = None, spec=spec) -> Problem:
            path = ("config", key) if key is not None else ("config",)
            return P(message, spec, *path, field=key)

        obj, probs = structure(cls, spec.config, locate=locate, stage=spec.name)
        problems.extend(probs)
        if obj is not None:
            configs[spec.name] = obj

    # replicas, capacity, devices
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    if graph.runtime.capacity < 1:
        problems.append(Problem(f"runtime.capacity must be >= 1, got {graph.runtime.capacity}", file=loc.filename if loc else None, line=loc.line("runtime", "capacity") if loc else None, field="runtime.capacity"))
    for key in ("stall_timeout_s", "drain_timeout_s", "shutdown_grace_s"):
        if getattr(graph.runtime, key) < 0:
            problems.append(Problem(f"runtime.{key} must be >= 0", file=loc.filename if loc else None, line=loc.line("runtime", key) if loc else None, field=f"runtime.{key}"))
    if graph.runtime.watchdog_interval_s <= 0:
        problems.append(Problem("runtime.watchdog_interval_s must be > 0", file=loc.filename if loc else None, line=loc.line("runtime", "watchdog_interval_s") if loc else None, field="runtime.watchdog_interval_s"))
    for spec in graph.stages:
        if spec.replicas < 1:
            problems.append(P(f"replicas must be >= 1, got {spec.replicas}", spec, "replicas", field="replicas"))
        if spec.capacity is not None and spec.capacity < 1:
            problems.append(P(f"capacity must be >= 1, got {spec.capacity}", spec, "capacity", field="capacity"))
        cls = classes.get(spec.name)
        if cls is not None and cls.is_source() and not cls.shards_by_replica and spec.replicas > 1:
            problems.append(P(f"source type '{spec.type}' would emit its whole output once per replica; replicas must be 1", spec, "replicas", field="replicas"))
        elif cls is not None and cls.singleton and spec.replicas > 1:
            problems.append(P(f"stage type '{spec.type}' runs once per process; replicas must be 1", spec, "replicas", field="replicas"))
        devs = normalize_devices(spec.devices)
        bad = False
        for d in devs:
            err = check_device_string(d)
            if err:
                problems.append(P(err, spec, "devices", field="devices"))
                bad = True
        if "auto" in devs and len(devs) > 1:
            problems.append(P("'auto' cannot be combined with other devices", spec, "devices", field="devices"))
            bad = True
        if not bad and check_devices:
            placed, _ = place(devs, max(spec.replicas, 1), gpus)
            for d in sorted(set(placed)):
                err = missing_device(d, gpus)
                if err:
                    problems.append(P(err, spec, "devices", field="devices"))

    # edges
    for spec in graph.stages:
        cls = classes.get(spec.name)
        if cls is not None and cls.is_source() and spec.inputs:
            problems.append(P(f"stage type '{spec.type}' is a source and takes no inputs", spec, "inputs", field="inputs"))
        if cls is not None and not cls.is_source() and not spec.inputs:
            problems.append(P(f"missing input: stage type '{spec.type}' needs an input (inputs: [STAGE])", spec, field="inputs"))
        seen_inputs = set()
        for j, inp in enumerate(spec.inputs):
            if inp.stage in seen_inputs:
                problems.append(P(f"input '{inp.stage}' listed twice", spec, "inputs", j, field="inputs"))
            seen_inputs.add(inp.stage)
            if inp.policy not in POLICIES:
                problems.append(P(f"unknown fan-out policy '{inp.policy}'; expected one of {', '.join(POLICIES)}", spec, "inputs", j, field="inputs"))
            if inp.stage == spec.name:
                problems.append(P("a stage cannot be its own input", spec, "inputs", j, field="inputs"))
                continue
            if inp.stage not in names:
                close = difflib.get_close_matches(inp.stage, sorted(names), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                problems.append(P(f"dangling input: no stage named '{inp.stage}'{hint}", spec, "inputs", j, field="inputs"))
                continue
            prod = classes.get(inp.stage)
            if prod is None or cls is None:
                continue
            if prod.is_sink():
                problems.append(P(f"stage '{inp.stage}' ({prod.__name__}) has no output", spec, "inputs", j, field="inputs"))
                continue
            if not _accepts(cls.input_type, prod.output_type):
                problems.append(
                    P(
                        f"type mismatch: '{inp.stage}' emits {_tname(prod.output_type)} but "
                        f"'{spec.name}' ({cls.__name__}) accepts {_tname(cls.input_type)}",
                        spec,
                        "inputs",
                        j,
                        field="inputs",
                    )
                )

    # cycles
    order, cycle = _toposort(graph)
    if cycle:
        spec = graph.stage(cycle[0]) if cycle[0] in names else None
        problems.append(P("cycle: " + " -> ".join(cycle + [cycle[0]]), spec, "inputs", field="inputs"))

    # ordered fan-in
    if not cycle:
        for spec in graph.stages:
            if spec.ordered:
                err = _ordering_problem(graph, spec, classes)
                if err:
                    problems.append(P(err, spec, "ordered", field="ordered"))

    if problems:
        raise ConfigError(problems)
    return Validated(graph, classes, configs, order)


def _accepts(consumer_in: type | None, producer_out: type | None) -> bool:
    if consumer_in is None or producer_out is None:
        return False
    if consumer_in is object:
        return True
    if producer_out is object:
        return True  # a generic producer: checked at run time by the consumer
    return issubclass(producer_out, consumer_in)


def _tname(t: type | None) -> str:
    if t is None:
        return "nothing"
    return "any item" if t is object else t.__name__


def _toposort(graph: Graph) -> tuple[list[str], list[str]]:
    names = [s.name for s in graph.stages]
    known = set(names)
    # Self-loops are reported on their own; here they would only repeat that.
    deps = {s.name: [i.stage for i in s.inputs if i.stage in known and i.stage != s.name] for s in graph.stages}
    state: dict[str, int] = {}
    order: list[str] = []
    stack: list[str] = []

    def visit(n: str) -> list[str]:
        state[n] = 1
        stack.append(n)
        for d in deps.get(n, []):
            if state.get(d) == 1:
                return stack[stack.index(d):]
            if state.get(d) is None:
                c = visit(d)
                if c:
                    return c
        state[n] = 2
        stack.pop()
        order.append(n)
        return []

    for n in names:
        if state.get(n) is None:
            c = visit(n)
            if c:
                return [], list(reversed(c))
    return order, []


def _ordering_problem(graph: Graph, spec: StageSpec, classes: dict[str, type[Stage]]) -> str | None:
    if spec.replicas != 1:
        return "ordered input needs replicas: 1 (one consumer restores one order)"
    origins: set[str] = set()
    todo = list(dict.fromkeys(i.stage for i in spec.inputs))  # an input listed twice is reported elsewhere
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            # A diamond: every item of this stage reaches the consumer more than once.
            return f"ordered input: items of stage '{name}' arrive by more than one path; there is no single order to restore"
        seen.add(name)
        try:
            up = graph.stage(name)
        except KeyError:
            return None
        cls = classes.get(name)
        if cls is None:
            return None
        if cls.cardinality != "1:1" or cls.is_source():
            origins.add(name)
            if up.replicas != 1:
                return (
                    f"ordered input: stage '{name}' starts the order but has {up.replicas} replicas; "
                    "it needs replicas: 1"
                )
        else:
            for inp in up.inputs:
                if inp.policy == "broadcast" and up.replicas > 1:
                    return f"ordered input: '{name}' receives '{inp.stage}' by broadcast to {up.replicas} replicas, so every item arrives {up.replicas} times"
            todo.extend(dict.fromkeys(inp.stage for inp in up.inputs))
    if len(origins) > 1:
        return f"ordered input merges items from several origins ({', '.join(sorted(origins))}); there is no single order to restore"
    return None
