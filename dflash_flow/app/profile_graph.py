"""The graph facts a profile needs: the trainer stage, the Monitor(s), the stages that feed the trainer one
item per batch, what can be replicated, the gradient accumulation, the edges."""

from __future__ import annotations

from dflash_flow.core.validate import Validated


class ProfileError(Exception):
    """The profile could not measure what was asked (the pipeline ended too early, no trainer stage...)."""


def graph_edges(v: Validated) -> dict[str, list[str]]:
    """Each stage's consumers."""
    edges: dict[str, list[str]] = {}
    for s in v.graph.stages:
        for i in s.inputs:
            edges.setdefault(i.stage, []).append(s.name)
    return edges


def observer_stages(v: Validated) -> set[str]:
    from dflash_flow.stages.monitor import Monitor

    return {name for name, cls in v.classes.items() if issubclass(cls, Monitor)}


def find_step_stage(v: Validated) -> str:
    """The trainer: the DrafterStep stage; else the one sink that is not a Monitor."""
    from dflash_flow.stages.drafter_step import DrafterStep

    trainers = [n for n in v.order if issubclass(v.classes[n], DrafterStep)]
    if len(trainers) == 1:
        return trainers[0]
    observers = observer_stages(v)
    sinks = [n for n in v.order if v.classes[n].is_sink() and n not in observers]
    if len(trainers) > 1 or len(sinks) != 1:
        found = trainers if len(trainers) > 1 else sinks
        raise ProfileError(
            f"cannot tell which stage is the trainer (found {', '.join(found) or 'no sink'}); name it with --step-stage"
        )
    return sinks[0]


def direct_feeders(v: Validated, step_stage: str) -> set[str]:
    """The trainer and the stages that feed it through 1:1 stages only: one item per trained batch each."""
    out = {step_stage}
    todo = [i.stage for i in v.graph.stage(step_stage).inputs]
    while todo:
        name = todo.pop()
        cls = v.classes[name]
        if name in out or cls.is_source() or cls.cardinality != "1:1":
            continue
        out.add(name)
        todo.extend(i.stage for i in v.graph.stage(name).inputs)
    return out


def is_replicable(v: Validated, name: str, step_stage: str) -> bool:
    """Whether more replicas of ``name`` would share its work (not a singleton, a sharding source, or the
    trainer, which grows by data-parallel ranks instead)."""
    cls = v.classes[name]
    if name == step_stage or cls.singleton:
        return False
    return not cls.is_source() or cls.shards_by_replica


def grad_accum_of(v: Validated, step_stage: str) -> int:
    return max(1, v.configs[step_stage].inputs_per_step)
