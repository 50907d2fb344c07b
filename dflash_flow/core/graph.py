"""The pipeline graph both the Python API and YAML produce: plain data (it compares, serialises and validates
without running anything); its pictures (Mermaid, dot) and the text of a stage type (`dflash-flow stages`)."""

from __future__ import annotations

import inspect
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from . import registry
from .convert_types import describe_type, field_default, field_types
from .devices import device_groups
from .metrics import declared_metrics
from .stage import Stage, to_plain

_SECTIONS: dict[str, type] = {}
_RESULT_SECTIONS: set[str] = set()


def register_section(name: str, cls: type, *, affects_result: bool = False) -> None:
    """Make ``name:`` a top-level YAML key (the attrs class ``cls``); ``affects_result``: a resume must match it."""
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

    capacity: int = 8  # default input-queue capacity of every replica
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
    """A pipeline: stages, runtime options and application sections. Built with :meth:`add` or loaded from YAML
    (``core.load_graph``), the two equal; run with ``dflash_flow.app.run(graph)`` or ``core.Pipeline(graph).run()``."""

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
        """Add stage ``name`` (a Stage instance, which becomes replica 0's object, a class or a type name);
        the rest as in YAML, ``policy`` the inputs' default. Unchecked: validation reports every problem."""
        conf = dict(config or {})
        if isinstance(stage, Stage):
            type_ = registry.type_name(type(stage))
            conf = {**stage.config(), **conf}
            self.instances[name] = stage
        elif isinstance(stage, type) and issubclass(stage, Stage):
            type_ = registry.type_name(stage)
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
        for spec in self.stages:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def consumers(self, name: str) -> list[tuple[StageSpec, InputSpec]]:
        """Every (stage, edge) that takes ``name`` as an input."""
        return [(s, i) for s in self.stages for i in s.inputs if i.stage == name]

    def to_dict(self, configs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
        """The graph as the plain mapping a YAML file holds; ``configs``: stage configs to write instead, by name."""
        out: dict[str, Any] = {"name": self.name, "seed": self.seed}
        if self.output_dir is not None:
            out["output_dir"] = self.output_dir
        out["runtime"] = attrs.asdict(self.runtime)
        out.update({key: to_plain(value) for key, value in self.sections.items()})
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
        """The graph as YAML text that loads back into an equal graph."""
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


# -- pictures of a graph, and the text of a stage type ---------------------------------------------
def describe_stage(name: str) -> str:
    cls = registry.resolve(name)
    doc = inspect.getdoc(cls) or ""
    summary = doc.splitlines()[0] if doc else ""
    lines = [f"{name}  ({cls.__module__}.{cls.__qualname__})"]
    if summary:
        lines.append(f"  {summary}")
    ins, outs = (f"none ({none})" if t is None else "any" if t is object else t.__name__
                 for t, none in ((cls.input_type, "source"), (cls.output_type, "sink")))
    lines.append(f"  input: {ins}   output: {outs}   cardinality: {cls.cardinality}")
    fields = cls.config_fields()
    hints = field_types(cls)
    if not fields:
        lines.append("  config: (none)")
    for f in fields:
        default = "required" if f.default is attrs.NOTHING else f"default {field_default(f)!r}"
        doc_line = f.metadata.get("doc", "")
        rules = _rules(f)
        lines.append(f"  - {f.name}: {describe_type(hints.get(f.name, object))} ({default})"
                     f"{'  ' + doc_line if doc_line else ''}{f'  [{rules}]' if rules else ''}")
    return "\n".join(lines + _metric_lines(cls))


def _metric_lines(cls: type) -> list[str]:
    """The metrics the stage declares (its ``stage_metrics`` classes), as MLflow names them."""
    listed = [m for group in cls.stage_metrics for m in declared_metrics(group)]
    if not listed:
        return []
    rows = [f"  - {name}: {kind.__name__.lower()}{f', {unit}' if unit else ''}  {description}"
            for name, kind, unit, description in listed]
    return ["  metrics (in MLflow: stage/<stage>/metric/<name>; a summary's /count /mean /min /max, a labeled "
            "one's /<label>):", *rows]


_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _rules(f: attrs.Attribute) -> str:
    """What ``cfg`` declared beyond the type: bounds, choices, whether .inf/.nan are accepted."""
    rules = [f"{_OPS[k]} {v}" for k, v in f.metadata.get("bounds", {}).items()]
    if f.metadata.get("choices"):
        rules.append("one of " + ", ".join(repr(c) for c in f.metadata["choices"]))
    if f.metadata.get("finite") is False:
        rules.append(".inf and .nan accepted")
    return ", ".join(rules)


def _label(graph: Graph, name: str) -> str:
    s = graph.stage(name)
    extra = []
    if s.replicas > 1:
        extra.append(f"x{s.replicas}")
    if s.devices not in ("cpu", ["cpu"]):
        # One entry per replica list; a replica's own devices joined by '+': cuda:0+cuda:1,cuda:2+cuda:3
        extra.append(s.devices if isinstance(s.devices, str) else ",".join("+".join(g) for g in device_groups(s.devices)))
    suffix = f" ({' '.join(extra)})" if extra else ""
    return f"{name}: {s.type}{suffix}"


def _edges(graph: Graph, sep: str):
    """(stage, input, edge label) of every edge: its policy (where it fans out) and capacity."""
    for s in graph.stages:
        for inp in s.inputs:
            cap = s.capacity or graph.runtime.capacity
            yield s, inp, f"{inp.policy}{sep}cap {cap}" if s.replicas > 1 else f"cap {cap}"


def to_mermaid(graph: Graph) -> str:
    lines = ["flowchart LR", *(f'    {_id(s.name)}["{_label(graph, s.name)}"]' for s in graph.stages)]
    for s, inp, text in _edges(graph, " "):
        lines.append(f"    {_id(inp.stage)} -->|{text}{' ordered' if s.ordered else ''}| {_id(s.name)}")
    return "\n".join(lines) + "\n"


def to_dot(graph: Graph) -> str:
    lines = [f'digraph "{graph.name}" {{', "  rankdir=LR;", '  node [shape=box, style=rounded, fontname="Helvetica"];']
    lines += [f'  {_id(s.name)} [label="{_label(graph, s.name)}"];' for s in graph.stages]
    lines += [f'  {_id(inp.stage)} -> {_id(s.name)} [label="{text}"];' for s, inp, text in _edges(graph, "\\n")]
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_image(graph: Graph, path: str | Path) -> Path | None:
    """Write an image with graphviz's `dot` when it is installed; None otherwise."""
    dot = shutil.which("dot")
    if dot is None:
        return None
    path = Path(path)
    fmt = path.suffix.lstrip(".") or "png"
    subprocess.run([dot, f"-T{fmt}", "-o", str(path)], input=to_dot(graph).encode(), check=True, timeout=60)
    return path


def _id(name: str) -> str:
    return "s_" + "".join(c if c.isalnum() else "_" for c in name)
