"""Checks across stages that generic validation cannot know, run before any thread starts: cross-stage
problems (``dflash-flow validate`` and ``run``), and for ``run`` the size of one checkpoint, the fingerprint
of the data a resume must find unchanged, and whether ``--extend`` has anything to do. The output directory
and the free space are ``app.output_dir``'s."""

from __future__ import annotations

import math
from pathlib import Path

from dflash_flow.core.errors import Problem
from dflash_flow.core.validate import Validated


def preflight_problems(v: Validated, *, check_paths: bool = True, local_world_size: int | None = None,
                       gpu_count: int | None = None) -> list[Problem]:
    """The static checks across stages: the model facts and each stage's view of them (``app.model_spec``:
    layers the target has, sizes, files that exist unless ``check_paths`` is false), and a Bucketer token budget
    smaller than the longest sample an upstream source may emit (it would only fail after reading all the
    data)."""
    from dflash_flow.app.model_spec import model_problems
    from dflash_flow.stages.bucketer import Bucketer

    graph = v.graph
    loc = graph.locator
    problems = model_problems(v, check_paths=check_paths)
    for i, spec in enumerate(graph.stages):
        conf = v.configs.get(spec.name)
        if not isinstance(conf, Bucketer):
            continue
        problems += _mixture_problems(v, i, conf.mixture)
        todo, seen = [inp.stage for inp in spec.inputs], set()
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            up = v.configs.get(name)
            max_length = up.longest_item() if up is not None else None
            if max_length is not None:
                multiple = max(conf.pad_to_multiple, 1)
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
    if check_paths:
        problems += aliased_data_files(v)
    problems += _backend_problems(v, local_world_size, gpu_count)
    return problems


def _backend_problems(v: Validated, local_world_size: int | None, gpu_count: int | None) -> list[Problem]:
    """``distributed.backend: nccl`` where the node's ranks would share a GPU (``validate --nproc N --gpus G``,
    or the job's own ranks under torchrun): it would fail at the first collective, after every target loaded."""
    import os

    from dflash_flow.app.distributed import backend_problem, node_layouts
    from dflash_flow.core.devices import visible_gpu_count

    ranks = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", 1) or 1)
    gpus = visible_gpu_count() if gpu_count is None else gpu_count
    if ranks < 2 or gpus < 1:
        return []
    graph = v.graph
    message = backend_problem(graph.sections["distributed"].backend, node_layouts(gpus, ranks, graph.runtime))
    if message is None:
        return []
    loc = graph.locator
    return [Problem(message, file=loc.filename if loc is not None else None,
                    line=loc.line("distributed", "backend") if loc is not None else None, field="distributed.backend")]


def preflight_warnings(v: Validated) -> list[str]:
    """What validate says without refusing, one located line each: a stage that emits samples longer than the
    target's context window (``max_length`` past its ``max_position_embeddings``: the target would be run
    past the positions it was trained for)."""
    from dflash_flow.app.model_spec import build_model_spec

    graph = v.graph
    loc = graph.locator
    try:
        facts = build_model_spec(graph).facts
    except Exception:  # noqa: BLE001 - the model's own problems are reported by the checks
        return []
    window = facts.max_positions if facts is not None else None
    if window is None:
        return []
    out = []
    for i, spec in enumerate(graph.stages):
        conf = v.configs.get(spec.name)
        longest = conf.longest_item() if conf is not None else None
        if longest is not None and longest > window:
            out.append("warning: " + Problem(
                f"max_length {longest} is past the target's context window of {window} positions "
                "(max_position_embeddings): longer samples would run it where it was not trained; set max_length "
                f"to at most {window}",
                file=loc.filename if loc is not None else None,
                line=loc.line("stages", i, "config", "max_length") if loc is not None else None,
                stage=spec.name, field="max_length").format())
    return out


def _mixture_problems(v: Validated, index: int, mixture: dict | None) -> list[Problem]:
    """A Bucketer's mixture must weigh every source it draws from (the source stages upstream of it: samples
    carry their source's name) and name nothing else; found here, not after every input was read."""
    if mixture is None:
        return []
    graph = v.graph
    spec = graph.stages[index]
    sources, ancestors, todo = [], set(), [inp.stage for inp in spec.inputs]
    while todo:
        name = todo.pop(0)
        if name in ancestors:
            continue
        ancestors.add(name)
        up = [inp.stage for inp in graph.stage(name).inputs]
        if not up:
            sources.append(name)
        todo.extend(up)
    missing = [s for s in sources if s not in mixture]
    unknown = sorted(k for k in mixture if k not in ancestors)
    if not (missing or unknown):
        return []
    loc = graph.locator
    parts = []
    if missing:
        parts.append(f"no weight for {', '.join(repr(s) for s in missing)} (give every source a weight; 0 leaves it "
                     "out)")
    if unknown:
        parts.append(f"{', '.join(repr(s) for s in unknown)} {'is' if len(unknown) == 1 else 'are'} not among its "
                     f"sources")
    return [Problem(f"mixture: {'; '.join(parts)}; its sources are {', '.join(sources)}",
                    file=loc.filename if loc is not None else None,
                    line=loc.line("stages", index, "config", "mixture") if loc is not None else None,
                    stage=spec.name, field="mixture")]


def aliased_data_files(v: Validated) -> list[Problem]:
    """A data file read twice -- by two stages, or once by name and once through a link or another spelling
    (the same inode) -- would train each of its samples twice per epoch without a word: refused, naming both.
    (One stage listing one name twice is refused by the source's own field check.)"""
    import os

    graph = v.graph
    loc = graph.locator
    index = {s.name: i for i, s in enumerate(graph.stages)}
    seen: dict[tuple[int, int], tuple[str, int, str]] = {}
    problems: list[Problem] = []
    for name, conf in v.configs.items():
        for j, f in enumerate(conf.data_files()):
            try:
                st = os.stat(Path(f).expanduser())
            except OSError:
                continue  # a missing file is the path check's
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen[key] = (name, j, str(f))
                continue
            first, k, other = seen[key]
            where = f"stage '{first}' paths[{k}]" if first != name else f"paths[{k}]"
            problems.append(Problem(
                f"{f} is the same file as {other} ({where}): its samples would be trained twice per epoch; list "
                "each file once (to weight a source, give it its own source stage and a Bucketer mixture weight)",
                file=loc.filename if loc is not None else None,
                line=(loc.line("stages", index[name], "config", "paths", j) or loc.line("stages", index[name]))
                if loc is not None else None,
                stage=name, field="paths"))
    return problems


def extend_problem(recorded: dict | None, current: dict, length_keys, moved: dict | None = None) -> str | None:
    """Why ``--extend`` has nothing to do (None: the run gets longer): no run-length setting (``epochs``,
    ``max_batches``: ``cfg(run_length=True)``) is larger than the checkpoint's; a shorter or equal length would
    resume, train nothing and write over the real run's summary."""
    from dflash_flow.core.identity import recorded_as_today

    if recorded is None:  # written before checkpoints recorded their settings: cannot be told
        return None
    recorded = recorded_as_today(recorded, moved or {}, current)
    same, shorter = [], []
    for key in sorted(length_keys):
        old, new = recorded.get(key), current.get(key)
        if old == new:
            same.append(f"{key.rsplit('.', 1)[-1]} {new if new is not None else 'unlimited'}")
        elif new is None or (old is not None and isinstance(new, int | float) and new > old):
            return None  # longer (None: no budget)
        else:
            shorter.append(f"{key}: {old if old is not None else 'unlimited'} in the checkpoint, {new} now")
    what = f"shorter ({'; '.join(shorter)})" if shorter else f"the same ({', '.join(same)})"
    return (f"nothing to extend: the run length is {what}; --extend trains a run on to a larger epochs or "
            "max_batches (a stopped run continues with --resume alone); the run and its summary are left as they are")


def data_fingerprint(v: Validated) -> dict[str, str]:
    """sha256 of every data file the sources read (``data_files()``), keyed by the path as configured.
    Files that do not exist are left out (their source reports them, with its own message)."""
    from dflash_flow.data.records import file_sha256

    out: dict[str, str] = {}
    for conf in v.configs.values():
        for name in conf.data_files():
            try:
                out[str(name)] = file_sha256(Path(name).expanduser())
            except OSError:
                continue
    return out


def checkpoint_bytes(v: Validated) -> tuple[int, int]:
    """Upper estimates of (one checkpoint, the final export) of the run, from the stages that report the
    size of what they train (``parameter_count()``); zeros when none does, or when the size cannot be known
    before the models are built (the stage's own setup then reports a bad target, located)."""
    import logging

    from dflash_flow.app.checkpoint_format import checkpoint_size_estimate
    from dflash_flow.app.model_spec import build_model_spec
    from dflash_flow.model.spec import UsesModel

    ckpt = export = 0
    spec = build_model_spec(v.graph)
    for name, conf in v.configs.items():
        try:
            n = int(conf.parameter_count(spec) if isinstance(conf, UsesModel) else conf.parameter_count())
        except Exception as exc:  # noqa: BLE001
            logging.getLogger("dflash_flow").debug("no checkpoint size estimate for stage '%s': %s", name, exc)
            continue
        if not n:
            continue
        ckpt += checkpoint_size_estimate(n)
        export += 4 * n
    return ckpt, export
