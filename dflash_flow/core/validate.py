"""Validation before any thread starts: every problem at once, each located.

``validated`` runs small named checks over one shared ``_Check`` (the graph, a problem factory and what
earlier checks resolved): shapes, names, types and configs, runtime options, placement (replicas,
capacity, devices), edges, cycles, ordering, and each stage's own view of its config.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

import attrs

from . import limits, registry
from .convert import structure, unstructure
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
from .fill import moved_field_message
from .graph import Graph, RuntimeOptions, StageSpec
from .sections import section_to_dict
from .stage import Stage
from .validate_graph import check_cycles, check_edges, check_ordering
from .wording import short


class Validated:
    """A graph that passed validation, with its resolved stage classes and per-replica configs."""

    def __init__(self, graph: Graph, classes: dict[str, type[Stage]], configs: dict[str, Any], order: list[str]):
        self.graph = graph
        self.classes = classes
        self.configs = configs  # stage name -> a validated Stage instance (the template for replicas)
        self.order = order  # topological order of stage names


def validate(graph: Graph, *, check_devices: bool = True, gpu_count: int | None = None,
             local_world_size: int | None = None) -> list[Problem]:
    """Every problem in ``graph`` (empty list when it is valid). ``local_world_size``: ranks per node the
    placement is checked for (default: ``$LOCAL_WORLD_SIZE`` under torchrun, else 1)."""
    try:
        _validated(graph, check_devices=check_devices, gpu_count=gpu_count, local_world_size=local_world_size)
    except ConfigError as exc:
        return exc.problems
    return []


def validated(graph: Graph, *, check_devices: bool = True, gpu_count: int | None = None,
              local_world_size: int | None = None) -> Validated:
    return _validated(graph, check_devices=check_devices, gpu_count=gpu_count, local_world_size=local_world_size)


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
    cycle: list[str] = attrs.field(factory=list)
    _index: dict[int, int] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self._index = {id(s): i for i, s in enumerate(self.graph.stages)}

    def path(self, spec: StageSpec | None, *path: Any) -> tuple:
        i = self._index.get(id(spec)) if spec is not None else None
        return ("stages", i, *path) if i is not None else path

    def line(self, *path: Any) -> int | None:
        loc = self.graph.locator
        return loc.line(*path) if loc is not None else None

    @property
    def file(self) -> str | None:
        loc = self.graph.locator
        return loc.filename if loc is not None else None

    def add(self, message: str, spec: StageSpec | None = None, *path: Any, field: str | None = None) -> None:
        line = self.line(*self.path(spec, *path))
        self.problems.append(Problem(message, file=self.file, line=line, stage=spec.name if spec else None, field=field))

    def add_field(self, message: str, spec: StageSpec, field: str) -> None:
        """A problem with a config field, located at the stage's value (or the stage when it leaves it out)."""
        self.add(message, spec, "config", field, field=field)

    def add_runtime(self, message: str, key: str) -> None:
        self.problems.append(Problem(message, file=self.file, line=self.line("runtime", key), field=f"runtime.{key}"))

    def extend(self, problems: list[Problem]) -> None:
        self.problems.extend(problems)


def _validated(graph: Graph, *, check_devices: bool, gpu_count: int | None,
               local_world_size: int | None = None) -> Validated:
    c = _Check(graph, check_devices, gpu_count, local_world_size)
    _check_shapes(c)
    if not c.problems:  # the checks below rely on well-typed specs
        for check in (_check_names, _check_sections, _check_configs, _check_runtime, _check_placement,
                      check_edges, check_cycles, check_ordering, _check_stage_configs):
            check(c)
    if c.problems:
        raise ConfigError(c.problems)
    return Validated(graph, c.classes, c.configs, c.order)


def _check_shapes(c: _Check) -> None:
    """Stage specs built in Python get the checks a YAML file gets when it is read (types of replicas,
    inputs, devices...). A graph read from YAML passes them by construction."""
    for spec in c.graph.stages:
        if not isinstance(spec, StageSpec):
            c.add(f"a stage must be a StageSpec, got {type(spec).__name__}")
            continue
        _, probs = structure(
            StageSpec,
            unstructure(spec),
            locate=lambda path, spec=spec: c.line(*c.path(spec, *path)),
            file=c.file,
            stage=short(spec.name) if isinstance(spec.name, str) else None,
            what="stage",
        )
        c.extend(probs)
    if len(c.graph.stages) > limits.MAX_TOTAL_REPLICAS:
        c.add(f"{len(c.graph.stages)} stages: a pipeline may run at most {limits.MAX_TOTAL_REPLICAS} replicas in all")


def _check_names(c: _Check) -> None:
    seen: dict[str, int] = {}
    for i, spec in enumerate(c.graph.stages):
        if spec.name in seen:
            c.add(f"duplicate stage name '{spec.name}' (first defined as stage #{seen[spec.name] + 1})", spec, "name", field="name")
        else:
            seen[spec.name] = i
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
        obj, probs = structure(
            cls,
            {k: v for k, v in spec.config.items() if k not in moved},
            locate=lambda path, spec=spec: c.line(*c.path(spec, "config", *path)),
            file=c.file,
            stage=spec.name,
        )
        c.extend(probs)
        if obj is not None:
            c.configs[spec.name] = obj


def _check_runtime(c: _Check) -> None:
    """Types (a graph built in Python skipped the YAML reading), then the bounds. NaN fails every
    ``>=`` and ``<=``, so each bound is written as ``not (ok)``."""
    _, probs = structure(
        RuntimeOptions,
        attrs.asdict(c.graph.runtime),
        locate=lambda path: c.line("runtime", *path),
        file=c.file,
        field_prefix="runtime.",
        what="runtime",
    )
    if probs:
        c.extend(probs)
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
    """Sections set in Python get the YAML checks (types, finite numbers, validators) too; one given as a
    plain mapping (``Graph(sections={"tracking": {"enabled": False}})``) is structured into its class here."""
    from .sections import registered_sections

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
        built, probs = structure(
            cls, section_to_dict(obj), locate=lambda path, key=key: c.line(key, *path), file=c.file,
            field_prefix=f"{key}.", what=key,
        )
        c.extend(probs)
        if isinstance(obj, dict) and built is not None:
            c.graph.sections[key] = built


def _capacity_limit(what: str, value: int) -> str:
    return (f"{what} must be <= {limits.MAX_CAPACITY} (items each input queue may hold in memory), "
            f"got {value}")


def _check_placement(c: _Check) -> None:
    """Replicas (a thread each), queue capacity and devices; the bounds come first, so placing
    replicas on devices never loops over an absurd count."""
    gpus = visible_gpu_count() if c.gpu_count is None else c.gpu_count
    layouts = _rank_layouts(c, gpus)
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
        _check_replica_kind(c, spec)
        _check_devices(c, spec, layouts)
    if total > limits.MAX_TOTAL_REPLICAS:
        c.add(f"the stages ask for {total} replicas in all; one process runs at most "
              f"{limits.MAX_TOTAL_REPLICAS} (each replica is a thread)", None, "stages", field="replicas")


def _check_replica_kind(c: _Check, spec: StageSpec) -> None:
    cls = c.classes.get(spec.name)
    if cls is not None and cls.is_source() and not cls.shards_by_replica and spec.replicas > 1:
        c.add(f"source type '{spec.type}' would emit its whole output once per replica; replicas must be 1", spec, "replicas", field="replicas")
    elif cls is not None and cls.singleton and spec.replicas > 1:
        c.add(f"stage type '{spec.type}' runs once per process; replicas must be 1", spec, "replicas", field="replicas")


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


def _check_devices(c: _Check, spec: StageSpec, layouts: list[RankLayout]) -> None:
    """Each device string; for a list per replica its shape (:func:`nesting_problems`); each device inside
    every rank's slice; then the stage's own check of the lists (``Stage.device_problems``)."""
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
    cls = c.classes.get(spec.name)
    if nested and not bad and 1 <= spec.replicas <= limits.MAX_REPLICAS:
        multi = bool(cls and cls.multi_device)
        for j, err in nesting_problems(groups, spec.replicas, multi_device=multi, stage_type=f"stage type '{short(spec.type)}'"):
            c.add(err, spec, *at(j), field="devices")
            bad = True
    if not bad and c.check_devices and spec.replicas <= limits.MAX_REPLICAS:
        seen: set[str] = set()
        for layout in layouts:  # `cuda:K` is the K-th GPU of each rank's own slice
            _placed, problems, _ = plan_groups(groups, max(spec.replicas, 1), layout)
            for err in problems:
                if err not in seen:
                    seen.add(err)
                    c.add(err, spec, "devices", field="devices")
    conf = c.configs.get(spec.name)
    if not bad and conf is not None:
        _check_stage_devices(c, spec, conf, groups)


def _check_stage_devices(c: _Check, spec: StageSpec, conf: Stage, groups: list[list[str]]) -> None:
    """The stage's own view of its device lists (e.g. TargetForward: the deepest layer exists and each
    replica has at most one device per layer); a failing check is reported, never raised."""
    try:
        found = conf.device_problems(groups)
    except Exception as exc:
        c.add(f"stage type '{spec.type}' failed to check its devices: {type(exc).__name__}: {exc}", spec, "devices",
              field="devices")
        return
    for field, message in found:
        if field == "devices":
            c.add(message, spec, "devices", field=field)
        else:
            c.add_field(message, spec, field)


def _check_stage_configs(c: _Check) -> None:
    """Each stage's own judgement of its settings (``Stage.config_problems``); a failing check is reported."""
    for spec in c.graph.stages:
        conf = c.configs.get(spec.name)
        if conf is None:
            continue
        try:
            found = conf.config_problems()
        except Exception as exc:
            c.add(f"stage type '{spec.type}' failed to check its config: {type(exc).__name__}: {exc}", spec,
                  "config", field="config")
            continue
        for field, message in found:
            c.add_field(message, spec, field)


