"""Checks across stages and of the environment that generic validation cannot know, run before any
thread starts (``dflash-flow validate`` and ``run``)."""

from __future__ import annotations

import math

from dflash_flow.core.errors import Problem
from dflash_flow.core.validate import Validated


def preflight_problems(v: Validated) -> list[Problem]:
    """A Bucketer token budget smaller than the longest sample an upstream source may emit (it would
    only fail after reading all the data)."""
    from dflash_flow.stages.bucketer import Bucketer

    graph = v.graph
    loc = graph.locator
    problems = []
    for i, spec in enumerate(graph.stages):
        conf = v.configs.get(spec.name)
        if not isinstance(conf, Bucketer):
            continue
        todo, seen = [inp.stage for inp in spec.inputs], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            up = v.configs.get(name)
            max_length = getattr(up, "max_length", None)
            if isinstance(max_length, int):
                multiple = max(int(getattr(conf, "pad_to_multiple", 1)), 1)
                padded = math.ceil(max_length / multiple) * multiple
                if conf.max_tokens < padded:
                    problems.append(Problem(
                        f"max_tokens={conf.max_tokens} is smaller than one sample: stage '{name}' emits samples "
                        f"of up to max_length={max_length} tokens ({padded} padded); raise max_tokens or lower max_length",
                        file=loc.filename if loc is not None else None,
                        line=loc.line("stages", i, "config", "max_tokens") if loc is not None else None,
                        stage=spec.name,
                        field="max_tokens",
                    ))
                continue
            todo.extend(inp.stage for inp in graph.stage(name).inputs)
    return problems
