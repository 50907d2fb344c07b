"""The graph-shape checks of validation: edges (types, sources, sinks, policies), cycles, and ordering
(``ordered: true`` needs one origin with one replica). ``c`` is validation's shared check state."""

from __future__ import annotations

import difflib
from typing import Any

from .graph import Graph, StageSpec
from .routing import POLICIES
from .stage import Source, Stage
from .wording import short


def check_edges(c: Any) -> None:
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
            _check_edge(c, spec, cls, j)


def _check_edge(c: Any, spec: StageSpec, cls: type[Stage] | None, j: int) -> None:
    inp = spec.inputs[j]
    if inp.stage == spec.name:
        c.add("a stage cannot be its own input", spec, "inputs", j, field="inputs")
        return
    if inp.stage not in c.names:
        close = difflib.get_close_matches(inp.stage, sorted(c.names), n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        c.add(f"dangling input: no stage named '{short(inp.stage)}'{hint}", spec, "inputs", j, field="inputs")
        return
    prod = c.classes.get(inp.stage)
    if prod is None or cls is None:
        return
    if prod.is_sink():
        c.add(f"stage '{inp.stage}' ({prod.__name__}) has no output", spec, "inputs", j, field="inputs")
    elif not _accepts(cls.input_type, prod.output_type):
        c.add(
            f"type mismatch: '{inp.stage}' emits {_tname(prod.output_type)} but "
            f"'{spec.name}' ({cls.__name__}) accepts {_tname(cls.input_type)}",
            spec,
            "inputs",
            j,
            field="inputs",
        )


def check_cycles(c: Any) -> None:
    c.order, c.cycle = _toposort(c.graph)
    if c.cycle:
        spec = c.graph.stage(c.cycle[0]) if c.cycle[0] in c.names else None
        c.add("cycle: " + _show_cycle(c.cycle), spec, "inputs", field="inputs")


def _show_cycle(cycle: list[str]) -> str:
    """``a -> b -> a``; a long cycle shows its ends and its length."""
    names = cycle if len(cycle) <= 8 else [*cycle[:3], "...", *cycle[-2:]]
    text = " -> ".join([*names, cycle[0]])
    return text if len(cycle) <= 8 else f"{text} ({len(cycle)} stages)"


def check_ordering(c: Any) -> None:
    if c.cycle:
        return
    for spec in c.graph.stages:
        if spec.ordered:
            err = _ordering_problem(c.graph, spec, c.classes)
            if err:
                c.add(err, spec, "ordered", field="ordered")


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
