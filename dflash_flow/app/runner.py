"""The Python runner: one call that does what ``dflash-flow run`` does.

    from dflash_flow.app import run

    report = run("pipelines/dflash.yaml", overrides=["stages.interleaver.max_batches=20"])
    print(report.status, report.record.evals)

``run`` takes a pipeline file or a :class:`~dflash_flow.core.Graph` built in Python (``Graph.add``), applies
``--set``-style overrides, validates it with every check ``dflash-flow validate`` makes (a problem raises
:class:`~dflash_flow.core.ConfigError` listing all of them, located), then runs it with the run services:
the output directory and its lock, MLflow tracking, checkpoints, ``resume``, the end-of-run report and
summary. It returns a :class:`~dflash_flow.app.session.RunReport`; a failed or interrupted run is a report
with its status and exit code, not an exception. ``Pipeline(graph).run()`` stays the bare runtime: threads
and channels only, no tracking, no checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_flow.core.graph import Graph
from dflash_flow.core.validate import Validated


def load(
    source: str | Path | Graph,
    *,
    overrides: list[str] | None = None,
    check_devices: bool = True,
    check_paths: bool | None = None,
    local_world_size: int | None = None,
    gpu_count: int | None = None,
) -> Validated:
    """A pipeline file or a Graph, with ``overrides`` (``key.path=value``) applied, validated like
    ``dflash-flow validate`` (the generic checks and the cross-stage ones). Raises ConfigError with every
    problem. ``check_paths`` (default: ``check_devices``): that data files and model directories exist."""
    import logging

    import dflash_flow.app  # noqa: F401 - registers the application sections
    from dflash_flow.app.preflight import preflight_problems, preflight_warnings
    from dflash_flow.core.config import apply_overrides, graph_from_dict, load_graph
    from dflash_flow.core.errors import ConfigError
    from dflash_flow.core.validate import validated

    if isinstance(source, Graph):
        graph = source
        if overrides:
            graph = graph_from_dict(apply_overrides(source.to_dict(), overrides), source.locator)
            graph.instances = dict(source.instances)  # used only where the config still matches
    else:
        graph = load_graph(source, overrides or [])
    v = validated(graph, check_devices=check_devices, local_world_size=local_world_size, gpu_count=gpu_count)
    problems = preflight_problems(v, check_paths=check_devices if check_paths is None else check_paths,
                                  local_world_size=local_world_size, gpu_count=gpu_count)
    if problems:
        raise ConfigError(problems)
    for line in preflight_warnings(v):
        logging.getLogger("dflash_flow").warning(line)
    return v


def model_services(source: Validated | Graph):
    """Run services holding only the model facts of ``source`` (its ``model:`` section resolved): what the
    DFlash stages need under a bare ``Pipeline(v, services=model_services(v))`` (no tracking, no checkpoints)."""
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.services import RunServices

    return RunServices(model=build_model_spec(source.graph if isinstance(source, Validated) else source))


def run(
    source: str | Path | Graph,
    *,
    overrides: list[str] | None = None,
    resume: str | None = None,
    extend: bool = False,
    check_devices: bool = True,
) -> Any:
    """Run a pipeline as ``dflash-flow run`` does (in this process; under torchrun, as this rank) and return
    its :class:`~dflash_flow.app.session.RunReport`. ``resume``: a checkpoint path, ``"latest"``, or ``"auto"``
    (latest if there is one); ``extend``: with ``resume``, train a finished or stopped run on to a new length
    (``session.EXTEND_RULE``). Raises ConfigError before anything runs when the pipeline is invalid."""
    from dflash_flow.app.session import run_validated

    v = load(source, overrides=overrides, check_devices=check_devices)
    config_path = None if isinstance(source, Graph) else Path(source)
    return run_validated(v, config_path=config_path, resume=resume, overrides=overrides or [], extend=extend)
