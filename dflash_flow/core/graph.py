"""The pipeline graph, the one object both the Python API and YAML produce: plain data (stage type names and
config dicts), so it compares, serialises to YAML and validates without running anything. Beside ``stages`` a
file holds application sections: a layer above the core registers them (``tracking:``, ``checkpoint:``) here."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from .stage import Stage

DEFAULT_CAPACITY = 8

_SECTIONS: dict[str, type] = {}
_RESULT_SECTIONS: set[str] = set()


def register_section(name: str, cls: type, *, affects_result: bool = False) -> None:
    """Make ``name:`` a valid top-level YAML key, structured into the attrs class ``cls``. ``affects_result``:
    its fields can change what a run trains (``model:``), so a resume must match them (unless ``cfg(result=False)``)."""
    _SECTIONS[name] = cls
    if affects_result:
        _RESULT_SECTIONS.add(name)
    else:
        _RESULT_SECTIONS.discard(name)


def result_sections() -> set[str]:
    """The registered sections whose fields can change a run's result."""
    return set(_RESULT_SECTIONS)


def registered_sections() -> dict[str, type]:
    return dict(_SECTIONS)


def section_to_dict(value: Any) -> Any:
    if attrs.has(type(value)):
        return {k: section_to_dict(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if isinstance(value, (list, tuple)):
        return [section_to_dict(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


@attrs.define
class InputSpec:
    """One input edge: the producing stage and the fan-out policy over this stage's replicas."""

    stage: str
    policy: str = "round_robin"


@attrs.define
class StageSpec:
    """One stage of a graph as written: its name, registered type, config mapping and placement."""

    name: str
    type: str
    config: dict[str, Any] = attrs.field(factory=dict)
    replicas: int = 1
    # A device, one device per replica (cycled), or a list of devices per replica ([[cuda:0, cuda:1], ...]).
    devices: str | list[str] | list[list[str]] = "cpu"
    inputs: list[InputSpec] = attrs.field(factory=list)
    capacity: int | None = None
    ordered: bool = False


@attrs.define
class RuntimeOptions:
    """Runtime knobs, all in one place."""

    capacity: int = DEFAULT_CAPACITY  # default input-queue capacity of every replica
    stall_timeout_s: float = 600.0  # no-progress watchdog; 0 turns it off
    drain_timeout_s: float = 30.0  # after Ctrl-C: time allowed to finish in-flight items
    shutdown_grace_s: float = 10.0  # after cancel: time allowed for threads to exit
    watchdog_interval_s: float = 1.0
    # Under torchrun: GPUs each rank of a node owns (None: visible GPUs / ranks per node), and whether ranks
    # may share GPUs (refused unless asked). `cuda:K` in a stage's devices is the K-th GPU of its rank's slice.
    gpus_per_rank: int | None = None
    share_gpus: bool = False


@attrs.define
class Graph:
    """A pipeline: stages, runtime options and application sections (attrs objects or plain mappings). Built
    with :meth:`add` or loaded from YAML (``core.load_graph``): the two are equal; :meth:`to_yaml` writes one
    back. Run it with ``dflash_flow.app.run(graph)`` or ``core.Pipeline(graph).run()`` (the bare runtime)."""

    name: str = "pipeline"
    seed: int = 0
    output_dir: str | None = None
    runtime: RuntimeOptions = attrs.field(factory=RuntimeOptions)
    stages: list[StageSpec] = attrs.field(factory=list)
    sections: dict[str, Any] = attrs.field(factory=dict)
    # Where the graph came from (file name and line numbers); not part of equality.
    locator: Any = attrs.field(default=None, eq=False, repr=False)
    # Stage instances given through the Python API, used as replica 0's object.
    instances: dict[str, Stage] = attrs.field(factory=dict, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        # The default sections a YAML load fills in, so that the two compare equal.
        for key, cls in registered_sections().items():
            if key not in self.sections:
                try:
                    self.sections[key] = cls()
                except TypeError:  # a section without defaults must be given explicitly
                    pass

    # -- Python composition -------------------------------------------------------------------------
    def add(self, name: str, stage: Stage | type[Stage] | str, *,
            inputs: str | Iterable[str | InputSpec | tuple[str, str] | Mapping[str, str]] = (), replicas: int = 1,
            devices: str | list[str] | list[list[str]] = "cpu", capacity: int | None = None, ordered: bool = False,
            policy: str | None = None, config: Mapping[str, Any] | None = None) -> Graph:
        """Add stage ``name`` and return the graph (calls chain).

        ``stage``: a Stage instance (its config fields become the stage's config; the instance is replica 0's
        object, so non-config attributes travel with it), a Stage class, or a registered type name. ``inputs``:
        a stage name, or a list of names, ``InputSpec``, ``(name, policy)`` pairs or ``{"stage", "policy"}``
        mappings; ``policy``: the default fan-out policy. The rest are as in YAML; ``config`` overrides the
        instance's config. Nothing is checked here: validation reports every problem.
        """
        from .registry import type_name

        conf = dict(config or {})
        if isinstance(stage, Stage):
            type_ = type_name(type(stage))
            conf = {**stage.config(), **conf}
            self.instances[name] = stage
        elif isinstance(stage, type) and issubclass(stage, Stage):
            type_ = type_name(stage)
        else:
            type_ = str(stage)
        self.stages.append(StageSpec(name=name, type=type_, config=conf, replicas=replicas, devices=devices,
                                     inputs=_inputs(inputs, policy), capacity=capacity, ordered=ordered))
        return self

    @property
    def run_dir(self) -> Path:
        """Where the run writes: ``output_dir``, by default ``runs/<name>`` (the one place that default lives)."""
        return Path(self.output_dir or f"runs/{self.name}")

    def stage(self, name: str) -> StageSpec:
        """The spec of stage ``name`` (KeyError when there is none)."""
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def consumers(self, name: str) -> list[tuple[StageSpec, InputSpec]]:
        """Every (stage, edge) that takes ``name`` as an input."""
        return [(s, i) for s in self.stages for i in s.inputs if i.stage == name]

    def to_dict(self, configs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The graph as the plain mapping a YAML file holds (defaults left out of the stages); ``configs``:
        the stages' configs to write instead, by stage name."""
        out: dict[str, Any] = {"name": self.name, "seed": self.seed}
        if self.output_dir is not None:
            out["output_dir"] = self.output_dir
        out["runtime"] = attrs.asdict(self.runtime)
        for key, value in self.sections.items():
            out[key] = section_to_dict(value)
        stages = []
        for s in self.stages:
            d: dict[str, Any] = {"name": s.name, "type": s.type}
            if s.inputs:
                d["inputs"] = [i.stage if i.policy == "round_robin" else {"stage": i.stage, "policy": i.policy}
                               for i in s.inputs]
            placement = {"replicas": (s.replicas, 1), "devices": (s.devices, "cpu"), "capacity": (s.capacity, None),
                         "ordered": (s.ordered, False)}
            d.update({k: v for k, (v, default) in placement.items() if v != default})
            config = s.config if configs is None else configs.get(s.name, s.config)
            if config:
                d["config"] = config
            stages.append(d)
        out["stages"] = stages
        return out

    def to_yaml(self, configs: dict[str, dict[str, Any]] | None = None) -> str:
        """The graph as YAML text that loads back into an equal graph (``configs``: as for ``to_dict``)."""
        import yaml

        return yaml.safe_dump(self.to_dict(configs), sort_keys=False, default_flow_style=None, width=100)


def _inputs(inputs: Any, policy: str | None) -> list[InputSpec]:
    if isinstance(inputs, (str, InputSpec)):
        inputs = [inputs]
    out = []
    for item in inputs:
        if isinstance(item, InputSpec):
            out.append(item)
        elif isinstance(item, str):
            out.append(InputSpec(item, policy or "round_robin"))
        elif isinstance(item, tuple):
            out.append(InputSpec(item[0], item[1]))
        elif isinstance(item, Mapping):
            out.append(InputSpec(item["stage"], item.get("policy", policy or "round_robin")))
        else:
            raise TypeError(f"cannot read input spec {item!r}")
    return out
