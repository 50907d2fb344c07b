"""Validation before any thread starts: every problem at once, each located, from small named checks."""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable
from typing import Any

import attrs

from . import limits, registry
from .channel import POLICIES
from .convert import CONVERTER, structure
from .convert_types import short
from .devices import (
    RankLayout,
    check_device_string,
    device_groups,
    is_nested,
    nesting_problems,
    plan_groups,
    visible_gpu_count,
)
from .errors import ConfigError, Problem
from .graph import Graph, RuntimeOptions, StageSpec, registered_sections
from .identity import moved_field_message
from .stage import Source, Stage, to_plain


@attrs.define(eq=False, slots=False)
class Validated:
    """A graph that passed validation, with its resolved stage classes and per-replica configs."""

    graph: Graph
    classes: dict[str, type[Stage]]
    configs: dict[str, Any]  # stage name -> a validated Stage instance (the template for replicas)
    order: list[str]  # topological order of stage names


def validate(graph: Graph, *, check_devices: bool = True, gpu_count: int | None = None,
             local_world_size: int | None = None) -> list[Problem]:
    """Every problem in ``graph``; ``local_world_size``: ranks per node (default ``$LOCAL_WORLD_SIZE``, else 1)."""
    try:
        validated(graph, check_devices=check_devices, gpu_count=gpu_count, local_world_size=local_world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def validated(graph: Graph, *, check_devices: bool = True, gpu_count: int | None = None,
              local_world_size: int | None = None) -> Validated:
    """The validated graph; raises ConfigError with every problem."""
    c = _Check(graph, check_devices, gpu_count, local_world_size)
    _check_shapes(c)
    if not c.problems:  # the checks below rely on well-typed specs
        for check in (_check_names, _check_sections, _check_configs, _check_runtime, _check_placement,
                      _check_edges, _check_cycles_and_ordering, _check_stage_configs):
            check(c)
    if c.problems:
        raise ConfigError(c.problems)
    return Validated(graph, c.classes, c.configs, c.order)


@attrs.define
class _Check:
    """What the checks share: the graph, where its stages are in the file, and what was resolved."""

    graph: Graph
    check_devices: bool
    gpu_count: int | None
    local_world_size: int | None = None
    problems: list[Problem] = attrs.field(factory=list)
    classes: dict[str, type[Stage]] = attrs.field(factory=dict)
    configs: dict[str, Any] = attrs.field(factory=dict)
    names: set[str] = attrs.field(factory=set)
    order: list[str] = attrs.field(factory=list)
    _index: dict[int, int] = attrs.field(init=False, default=attrs.Factory(
        lambda self: {id(s): i for i, s in enumerate(self.graph.stages)}, takes_self=True))

    def path(self, spec: StageSpec | None, *path: Any) -> tuple:
        i = self._index.get(id(spec)) if spec is not None else None
        return ("stages", i, *path) if i is not None else path

    def line(self, *path: Any) -> int | None:
        loc = self.graph.locator
        return loc.line(*path) if loc is not None else None

    @property
    def file(self) -> str | None:
        return getattr(self.graph.locator, "filename", None)

    def add(self, message: str, spec: StageSpec | None = None, *path: Any, field: str | None = None) -> None:
        line = self.line(*self.path(spec, *path))
        self.problems.append(Problem(message, file=self.file, line=line, stage=spec.name if spec else None, field=field))

    def add_runtime(self, message: str, key: str) -> None:
        self.problems.append(Problem(message, file=self.file, line=self.line("runtime", key), field=f"runtime.{key}"))


def _check_shapes(c: _Check) -> None:
    """Stage specs built in Python get the checks a YAML file gets when it is read (a YAML graph passes)."""
    for spec in c.graph.stages:
        if not isinstance(spec, StageSpec):
            c.add(f"a stage must be a StageSpec, got {type(spec).__name__}")
            continue
        _, probs = structure(StageSpec, CONVERTER.unstructure(spec), locate=lambda path, spec=spec: c.line(*c.path(spec, *path)),
                             file=c.file, stage=short(spec.name) if isinstance(spec.name, str) else None, what="stage")
        c.problems.extend(probs)
    if len(c.graph.stages) > limits.MAX_TOTAL_REPLICAS:
        c.add(f"{len(c.graph.stages)} stages: a pipeline may run at most {limits.MAX_TOTAL_REPLICAS} replicas in all")


def _check_names(c: _Check) -> None:
    seen: dict[str, int] = {}
    for i, spec in enumerate(c.graph.stages):
        if seen.setdefault(spec.name, i) != i:
            c.add(f"duplicate stage name '{spec.name}' (first defined as stage #{seen[spec.name] + 1})", spec, "name", field="name")
    c.names = set(seen)


def _check_configs(c: _Check) -> None:
    """Resolve each stage type and structure its config into the template instance of its replicas."""
    known = registry.available()
    for spec in c.graph.stages:
        try:
            cls = registry.resolve(spec.type)
        except registry.UnknownStageType:
            close = difflib.get_close_matches(spec.type, known, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; registered types: {', '.join(known)}"
            c.add(f"unknown stage type '{short(spec.type)}'{hint}", spec, "type", field="type")
            continue
        except Exception as exc:  # a broken plugin must not hide the other problems
            c.add(f"stage type '{spec.type}' failed to load: {type(exc).__name__}: {exc}", spec, "type", field="type")
            continue
        c.classes[spec.name] = cls
        moved = [f for f in spec.config if f in cls.moved_fields]
        for field in moved:
            c.add(moved_field_message(field, cls.moved_fields[field]), spec, "config", field, field=field)
        instance = c.graph.instances.get(spec.name)
        if instance is not None and type(instance) is cls and instance.config() == spec.config:
            c.configs[spec.name] = instance
            continue
        obj, probs = structure(cls, {k: v for k, v in spec.config.items() if k not in moved}, file=c.file,
                               locate=lambda path, spec=spec: c.line(*c.path(spec, "config", *path)), stage=spec.name)
        c.problems.extend(probs)
        if obj is not None:
            c.configs[spec.name] = obj


def _check_runtime(c: _Check) -> None:
    """Types (a graph built in Python skipped the YAML reading), then the bounds, as ``not (ok)``: NaN fails."""
    _, probs = structure(RuntimeOptions, attrs.asdict(c.graph.runtime), locate=lambda path: c.line("runtime", *path),
                         file=c.file, field_prefix="runtime.", what="runtime")
    if probs:
        c.problems.extend(probs)
        return
    rt = c.graph.runtime
    if not rt.capacity >= 1:
        c.add_runtime(f"runtime.capacity must be >= 1, got {rt.capacity}", "capacity")
    elif not rt.capacity <= limits.MAX_CAPACITY:
        c.add_runtime(_capacity_limit("runtime.capacity", rt.capacity), "capacity")
    for key in ("stall_timeout_s", "drain_timeout_s", "shutdown_grace_s", "watchdog_interval_s"):
        value = getattr(rt, key)
        if key == "watchdog_interval_s" and not value > 0:
            c.add_runtime("runtime.watchdog_interval_s must be > 0", key)
        elif not value >= 0:
            c.add_runtime(f"runtime.{key} must be >= 0", key)
        elif not value <= limits.MAX_SECONDS:
            c.add_runtime(f"runtime.{key} must be <= {limits.MAX_SECONDS} (seconds; longer waits overflow the clock), got {value:g}", key)


def _check_sections(c: _Check) -> None:
    """Sections set in Python get the YAML checks too; one given as a plain mapping is structured here."""
    known = registered_sections()
    for key in c.graph.sections:
        if key not in known:
            close = difflib.get_close_matches(str(key), sorted(known), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; known sections: {', '.join(sorted(known))}"
            c.problems.append(Problem(f"unknown section '{short(key)}'{hint}", file=c.file, field=str(key)))
    for key, cls in known.items():
        obj = c.graph.sections.get(key)
        if obj is None or not (attrs.has(type(obj)) or isinstance(obj, dict)):
            continue
        built, probs = structure(cls, to_plain(obj), locate=lambda path, key=key: c.line(key, *path),
                                 file=c.file, field_prefix=f"{key}.", what=key)
        c.problems.extend(probs)
        if isinstance(obj, dict) and built is not None:
            c.graph.sections[key] = built


def _capacity_limit(what: str, value: int) -> str:
    return f"{what} must be <= {limits.MAX_CAPACITY} (items each input queue may hold in memory), got {value}"


def _check_placement(c: _Check) -> None:
    """Replicas, queue capacity and devices; bounds first, so placing never loops over an absurd count."""
    layouts = _rank_layouts(c, visible_gpu_count() if c.gpu_count is None else c.gpu_count)
    total = 0
    for spec in c.graph.stages:
        if spec.replicas < 1:
            c.add(f"replicas must be >= 1, got {spec.replicas}", spec, "replicas", field="replicas")
        elif spec.replicas > limits.MAX_REPLICAS:
            c.add(f"replicas must be <= {limits.MAX_REPLICAS} (each replica is a thread), got {short(spec.replicas, 30)}",
                  spec, "replicas", field="replicas")
        else:
            total += spec.replicas
        if spec.capacity is not None and spec.capacity < 1:
            c.add(f"capacity must be >= 1, got {spec.capacity}", spec, "capacity", field="capacity")
        elif spec.capacity is not None and spec.capacity > limits.MAX_CAPACITY:
            c.add(_capacity_limit("capacity", spec.capacity), spec, "capacity", field="capacity")
        cls = c.classes.get(spec.name)
        if cls is not None and cls.is_source() and not cls.shards_by_replica and spec.replicas > 1:
            c.add(f"source type '{spec.type}' would emit its whole output once per replica; replicas must be 1", spec, "replicas", field="replicas")
        elif cls is not None and cls.singleton and spec.replicas > 1:
            c.add(f"stage type '{spec.type}' runs once per process; replicas must be 1", spec, "replicas", field="replicas")
        _check_devices(c, spec, cls, layouts)
    if total > limits.MAX_TOTAL_REPLICAS:
        c.add(f"the stages ask for {total} replicas in all; one process runs at most "
              f"{limits.MAX_TOTAL_REPLICAS} (each replica is a thread)", None, "stages", field="replicas")


def _rank_layouts(c: _Check, gpus: int) -> list[RankLayout]:
    """The GPU slice of every rank of a node; a layout where ranks would share GPUs is a problem."""
    rt = c.graph.runtime
    ranks = c.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1) or 1)
    layouts = [RankLayout(visible=gpus, local_world_size=ranks, local_rank=r, gpus_per_rank=rt.gpus_per_rank,
                          shared=rt.share_gpus) for r in range(max(ranks, 1))]
    err = layouts[0].problem() if c.check_devices else None
    if err:
        c.add(err, None, "runtime", field="runtime.gpus_per_rank")
    return layouts


def _check_devices(c: _Check, spec: StageSpec, cls: type[Stage] | None, layouts: list[RankLayout]) -> None:
    """Each device string; a nested list's shape; each device inside every rank's slice; the stage's own check."""
    groups = device_groups(spec.devices)
    nested = is_nested(spec.devices)

    def at(j: int | None) -> tuple:
        return ("devices",) if j is None or not nested else ("devices", j)

    bad = False
    for j, group in enumerate(groups):
        for d in group:
            err = check_device_string(d)
            if err:
                c.add(err, spec, *at(j), field="devices")
                bad = True
    flat = [d for g in groups for d in g]
    if not nested and "auto" in flat and len(flat) > 1:
        c.add("'auto' cannot be combined with other devices", spec, "devices", field="devices")
        bad = True
    if nested and not bad and 1 <= spec.replicas <= limits.MAX_REPLICAS:
        multi = bool(cls and cls.multi_device)
        for j, err in nesting_problems(groups, spec.replicas, multi_device=multi, stage_type=f"stage type '{short(spec.type)}'"):
            c.add(err, spec, *at(j), field="devices")
            bad = True
    if not bad and c.check_devices and spec.replicas <= limits.MAX_REPLICAS:
        # `cuda:K` is the K-th GPU of each rank's own slice: each rank's problems, each once.
        found = [err for layout in layouts for err in plan_groups(groups, max(spec.replicas, 1), layout)[1]]
        for err in dict.fromkeys(found):
            c.add(err, spec, "devices", field="devices")
    conf = c.configs.get(spec.name)
    if not bad and conf is not None:
        _ask_stage(c, spec, "devices", lambda: conf.device_problems(groups))


def _check_stage_configs(c: _Check) -> None:
    for spec in c.graph.stages:
        if (conf := c.configs.get(spec.name)) is not None:
            _ask_stage(c, spec, "config", conf.config_problems)


def _ask_stage(c: _Check, spec: StageSpec, what: str, ask: Callable[[], list[tuple[str, str]]]) -> None:
    """The stage's own judgement of its ``what`` (``device_problems`` / ``config_problems``), located."""
    try:
        found = ask()
    except Exception as exc:
        c.add(f"stage type '{spec.type}' failed to check its {what}: {type(exc).__name__}: {exc}", spec, what,
              field=what)
        return
    for field, message in found:
        c.add(message, spec, *(("devices",) if what == field == "devices" else ("config", field)), field=field)


# -- the graph's shape: edges, cycles, ordering ----------------------------------------------------
def _check_edges(c: _Check) -> None:
    for spec in c.graph.stages:
        cls = c.classes.get(spec.name)
        if cls is not None and cls.is_source() and not issubclass(cls, Source):
            c.add(f"stage type '{spec.type}' takes no input (input_type None) but is not a Source: subclass "
                  "dflash_flow.core.Source and implement produce()", spec, "type", field="type")
        if cls is not None and cls.is_source() and spec.inputs:
            c.add(f"stage type '{spec.type}' is a source and takes no inputs", spec, "inputs", field="inputs")
        if cls is not None and not cls.is_source() and not spec.inputs:
            c.add(f"missing input: stage type '{spec.type}' needs an input (inputs: [STAGE])", spec, field="inputs")
        seen_inputs: set[str] = set()
        for j, inp in enumerate(spec.inputs):
            if inp.stage in seen_inputs:
                c.add(f"input '{inp.stage}' listed twice", spec, "inputs", j, field="inputs")
            seen_inputs.add(inp.stage)
            if inp.policy not in POLICIES:
                c.add(f"unknown fan-out policy '{short(inp.policy)}'; expected one of {', '.join(POLICIES)}", spec, "inputs", j, field="inputs")
            if inp.stage == spec.name:
                c.add("a stage cannot be its own input", spec, "inputs", j, field="inputs")
            elif inp.stage not in c.names:
                close = difflib.get_close_matches(inp.stage, sorted(c.names), n=1)
                hint = f"; did you mean '{close[0]}'?" if close else ""
                c.add(f"dangling input: no stage named '{short(inp.stage)}'{hint}", spec, "inputs", j, field="inputs")
            elif (prod := c.classes.get(inp.stage)) is None or cls is None:
                continue
            elif prod.is_sink():
                c.add(f"stage '{inp.stage}' ({prod.__name__}) has no output", spec, "inputs", j, field="inputs")
            elif not _accepts(cls.input_type, prod.output_type):
                c.add(f"type mismatch: '{inp.stage}' emits {_tname(prod.output_type)} but "
                      f"'{spec.name}' ({cls.__name__}) accepts {_tname(cls.input_type)}", spec, "inputs", j, field="inputs")


def _check_cycles_and_ordering(c: _Check) -> None:
    """A cycle; else ``ordered: true`` needs one origin with one replica, reached by one path."""
    c.order, cycle = _toposort(c.graph)
    if cycle:
        spec = c.graph.stage(cycle[0]) if cycle[0] in c.names else None
        c.add("cycle: " + _show_cycle(cycle), spec, "inputs", field="inputs")
        return
    for spec in c.graph.stages:
        err = _ordering_problem(c.graph, spec, c.classes) if spec.ordered else None
        if err:
            c.add(err, spec, "ordered", field="ordered")


def _show_cycle(cycle: list[str]) -> str:
    """``a -> b -> a``; a long cycle shows its ends and its length."""
    names = cycle if len(cycle) <= 8 else [*cycle[:3], "...", *cycle[-2:]]
    text = " -> ".join([*names, cycle[0]])
    return text if len(cycle) <= 8 else f"{text} ({len(cycle)} stages)"


def _accepts(consumer_in: type | None, producer_out: type | None) -> bool:
    """A generic producer (``object``) is checked at run time by the consumer."""
    if consumer_in is None or producer_out is None:
        return False
    return consumer_in is object or producer_out is object or issubclass(producer_out, consumer_in)


def _tname(t: type | None) -> str:
    return "nothing" if t is None else "any item" if t is object else t.__name__


def _toposort(graph: Graph) -> tuple[list[str], list[str]]:
    """(topological order, []) or ([], one cycle). Iterative: a chain of thousands of stages is fine."""
    names = [s.name for s in graph.stages]
    known = set(names)
    # Self-loops are reported on their own; here they would only repeat that.
    deps = {s.name: [i.stage for i in s.inputs if i.stage in known and i.stage != s.name] for s in graph.stages}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    order: list[str] = []
    for root in names:
        if root in state:
            continue
        state[root] = 1
        path = [root]
        todo = [iter(deps.get(root, []))]
        while todo:
            nxt = next(todo[-1], None)
            if nxt is None:
                todo.pop()
                done = path.pop()
                state[done] = 2
                order.append(done)
            elif state.get(nxt) == 1:
                return [], list(reversed(path[path.index(nxt):]))
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                todo.append(iter(deps.get(nxt, [])))
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
        cls = classes.get(name)
        if cls is None:
            return None
        up = graph.stage(name)
        if cls.cardinality != "1:1" or cls.is_source():
            origins.add(name)
            if up.replicas != 1:
                return f"ordered input: stage '{name}' starts the order but has {up.replicas} replicas; it needs replicas: 1"
        else:
            for inp in up.inputs:
                if inp.policy == "broadcast" and up.replicas > 1:
                    return f"ordered input: '{name}' receives '{inp.stage}' by broadcast to {up.replicas} replicas, so every item arrives {up.replicas} times"
            todo.extend(dict.fromkeys(inp.stage for inp in up.inputs))
    if len(origins) > 1:
        return f"ordered input merges items from several origins ({', '.join(sorted(origins))}); there is no single order to restore"
    return None
