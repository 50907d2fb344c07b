"""YAML (and dict) -> Graph, every problem located: the top-level keys, the sections, the stages and ``--set``."""

from __future__ import annotations

import difflib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from . import limits
from .convert import STAGE_KEYS, structure
from .convert_types import short
from .errors import ConfigError, Problem
from .graph import Graph, RuntimeOptions, StageSpec, registered_sections
from .yaml_load import Locator, YAMLLimitError, load_value, parse_yaml, read_yaml_file, yaml_problem

TOP_LEVEL_KEYS = ("name", "seed", "output_dir", "runtime", "stages")


# -- overrides --------------------------------------------------------------------------------------
def apply_overrides(data: Any, overrides: list[str]) -> Any:
    """Apply ``key.path=value`` overrides (values parsed as YAML). In a list of named mappings a segment may be a
    name or an index; a key under a stage that is not a stage key goes into its ``config``."""
    if not overrides:
        return data
    if not isinstance(data, dict):
        raise ConfigError("cannot apply --set overrides: the file is not a mapping")
    data = _unshared(data)
    problems = [p for p in (_apply_one(data, item) for item in overrides) if p is not None]
    if problems:
        raise ConfigError(problems)
    return data


def _apply_one(data: dict, item: str) -> Problem | None:
    key, sep, raw = item.partition("=")
    if not sep or not key:
        return Problem(f"--set {short(item)!r}: expected key.path=value")
    parts = key.split(".")
    if len(parts) > limits.MAX_YAML_DEPTH:
        return Problem(f"--set {short(key)}: a path of {len(parts)} keys (at most {limits.MAX_YAML_DEPTH})")
    try:
        value = load_value(raw, depth_offset=len(parts)) if raw != "" else ""
    except YAMLLimitError as exc:
        return yaml_problem(exc, None, prefix=f"--set {short(key)}: ")
    except yaml.YAMLError:
        value = raw  # not YAML (``--set name=a: b``): the text itself
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        nxt = _descend(node, part)
        if nxt is None:
            if not isinstance(node, dict):
                where = '.'.join(parts[:i]) or 'the file'
                return Problem(f"--set {short(key)}: no element '{short(part)}' in {where}{_suggest(node, part)}")
            nxt = node.setdefault(part, {})
        # A stage mapping: unknown keys go into its config.
        stage = isinstance(nxt, dict) and "type" in nxt and "name" in nxt
        if stage and i + 2 == len(parts) and parts[-1] not in STAGE_KEYS:
            nxt = nxt.setdefault("config", {})
            if not isinstance(nxt, dict):
                return Problem(f"--set {short(key)}: the stage's 'config' is not a mapping")
        node = nxt
    last = parts[-1]
    if isinstance(node, list):
        idx = _index(node, last)
        if idx is None:
            return Problem(f"--set {short(key)}: no element '{short(last)}'{_suggest(node, last)}")
        node[idx] = value
    elif isinstance(node, dict):
        node[last] = value
    else:
        return Problem(f"--set {short(key)}: '{'.'.join(parts[:-1])}' is not a mapping")
    return None


def _unshared(value: Any) -> Any:
    """A copy in which no two paths share a list or mapping (``--set`` on a node an alias repeats changes one place)."""
    if isinstance(value, dict):
        return {k: _unshared(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_unshared(v) for v in value]
    return value


def _index(node: list, part: str) -> int | None:
    for i, el in enumerate(node):
        if isinstance(el, dict) and el.get("name") == part:
            return i
    if part.lstrip("-").isdigit() and len(part) < 20 and -len(node) <= int(part) < len(node):
        return int(part)
    return None


def _suggest(node: list, part: str) -> str:
    """'; did you mean ...' for a name missing from a list of named mappings, else the names there."""
    names = [str(el["name"]) for el in node if isinstance(el, dict) and "name" in el]
    if not names:
        return f" (a list of {len(node)}: use an index)"
    close = difflib.get_close_matches(part, names, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; names there: {', '.join(names)}"


def _descend(node: Any, part: str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list):
        idx = _index(node, part)
        return node[idx] if idx is not None else None
    return None


# -- graph building ---------------------------------------------------------------------------------
def _locating(loc: Locator, *base: Any) -> Callable[[tuple], int | None]:
    return lambda path: loc.line(*base, *path)


def graph_from_dict(data: Any, locator: Locator | None = None) -> Graph:
    """Structure a parsed document into a Graph. Shape problems raise ConfigError (all of them)."""
    loc = locator or Locator(None)
    if not isinstance(data, dict):
        raise ConfigError(loc.problem("a pipeline file must be a mapping with a 'stages' list"))
    sections = registered_sections()
    graph = Graph(locator=loc)
    problems = _top_level(data, graph, loc, sections)
    problems += _sections(data, graph, loc, sections)
    problems += _stages(data, graph, loc)
    if problems:
        raise ConfigError(problems)
    return graph


def _top_level(data: dict, graph: Graph, loc: Locator, sections: dict[str, type]) -> list[Problem]:
    problems = []

    def bad(key: Any, message: str) -> None:
        problems.append(loc.problem(message, key, field=short(key)))

    allowed = set(TOP_LEVEL_KEYS) | set(sections)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(short(key), sorted(allowed), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; allowed: {', '.join(sorted(allowed))}"
            bad(key, f"unknown top-level key '{short(key)}'{hint}")
    name = data.get("name", "pipeline")
    if not isinstance(name, str) or not name:
        bad("name", "'name' must be a non-empty string")
    elif len(name) > limits.MAX_NAME_CHARS:
        bad("name", f"'name' has {len(name)} characters; at most {limits.MAX_NAME_CHARS}")
    elif "/" in name or "\\" in name or name in (".", ".."):
        bad("name", f"'name' {name!r} names the run directory (runs/NAME by default): it may not contain '/' or "
            "'\\' or be '.' or '..'")
    else:
        graph.name = name
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        bad("seed", f"'seed' must be a non-negative integer, got {short(repr(seed), 40)}")
    elif seed > limits.MAX_SEED:
        bad("seed", f"'seed' must be < 2**63 (seeds are 64-bit), got {short(seed, 40)}")
    else:
        graph.seed = seed
    out_dir = data.get("output_dir")
    if out_dir is not None and not isinstance(out_dir, str):
        bad("output_dir", "'output_dir' must be a string")
    else:
        graph.output_dir = out_dir
    return problems


def _sections(data: dict, graph: Graph, loc: Locator, sections: dict[str, type]) -> list[Problem]:
    """``runtime`` and the application sections the file gives (Graph() holds the defaults of the others)."""
    problems = []
    for key, cls in {"runtime": RuntimeOptions, **sections}.items():
        if key not in data:
            continue
        obj, probs = structure(cls, data[key], locate=_locating(loc, key), file=loc.filename, field_prefix=f"{key}.", what=key)
        problems.extend(probs)
        if obj is not None and key == "runtime":
            graph.runtime = obj
        elif obj is not None:
            graph.sections[key] = obj
    return problems


def _stages(data: dict, graph: Graph, loc: Locator) -> list[Problem]:
    stages = data.get("stages")
    if stages is None:
        return [loc.problem("missing 'stages' (a list of stage definitions)", field="stages")]
    if not isinstance(stages, list):
        return [loc.problem("'stages' must be a list", "stages", field="stages")]
    if not stages:
        return [loc.problem("'stages' is empty", "stages", field="stages")]
    if len(stages) > limits.MAX_TOTAL_REPLICAS:
        return [loc.problem(f"{len(stages)} stages: a pipeline may run at most {limits.MAX_TOTAL_REPLICAS} replicas "
                            "(threads) in all, one per stage at least", "stages", field="stages")]
    problems = []
    for i, raw in enumerate(stages):
        if not isinstance(raw, dict):
            problems.append(loc.problem(f"stage #{i + 1} must be a mapping", "stages", i))
            continue
        label = raw.get("name") if isinstance(raw.get("name"), str) and raw.get("name") else f"#{i + 1}"
        spec, probs = structure(StageSpec, raw, locate=_locating(loc, "stages", i), file=loc.filename,
                                stage=short(label), what="stage")
        problems.extend(probs)
        if spec is not None:
            graph.stages.append(spec)
    return problems


def searched_in(path: str | Path) -> str:
    """For a path a pipeline names that is not there: where it was looked for ("" for an absolute one)."""
    if Path(path).expanduser().is_absolute():
        return ""
    return (f" (looked for in {Path.cwd()}, the working directory: relative paths in a pipeline resolve against "
            "it, not against the pipeline file)")


def load_graph(path: str | Path, overrides: list[str] | None = None) -> Graph:
    """Read, override and structure a pipeline file (no validation of stage configs yet)."""
    data, loc = read_yaml_file(path)
    return graph_from_dict(apply_overrides(data, overrides or []), loc)


def load_graph_text(text: str, filename: str | None = None, overrides: list[str] | None = None) -> Graph:
    data, loc = parse_yaml(text, filename)
    return graph_from_dict(apply_overrides(data, overrides or []), loc)
