"""YAML (and dict) -> Graph, with every problem located by file, line, stage and field.

Only ``yaml.SafeLoader`` is used: a YAML file cannot construct Python objects or import modules.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import yaml

from .errors import ConfigError, Problem
from .graph import Graph, InputSpec, RuntimeOptions, StageSpec
from .sections import registered_sections

TOP_LEVEL_KEYS = ("name", "seed", "output_dir", "runtime", "stages")
STAGE_KEYS = ("name", "type", "config", "replicas", "devices", "inputs", "capacity", "ordered")

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``6e-4`` as a float (YAML 1.1 requires a dot: ``6.0e-4``), which is how
    everyone writes learning rates."""


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


# -- locating -------------------------------------------------------------------------------------
class Locator:
    """Line numbers of every key and value of a YAML document, by path."""

    def __init__(self, filename: str | None, lines: dict[tuple, int] | None = None):
        self.filename = filename
        self.lines = lines or {}

    def line(self, *path: Any) -> int | None:
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def problem(self, message: str, *path: Any, stage: str | None = None, field: str | None = None) -> Problem:
        return Problem(message, file=self.filename, line=self.line(*path), stage=stage, field=field)


def _record(node: yaml.Node, path: tuple, lines: dict[tuple, int], problems: list[Problem], fname) -> None:
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value
            if key in seen:
                problems.append(
                    Problem(f"duplicate key '{key}'", file=fname, line=key_node.start_mark.line + 1)
                )
            seen.add(key)
            lines[path + (key,)] = key_node.start_mark.line + 1
            _record(value_node, path + (key,), lines, problems, fname)
            lines[path + (key,)] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record(item, path + (i,), lines, problems, fname)


def parse_yaml(text: str, filename: str | None = None) -> tuple[Any, Locator]:
    """Safe-load ``text``; syntax errors and Python tags become located ConfigErrors."""
    fname = filename or "<string>"
    problems: list[Problem] = []
    lines: dict[tuple, int] = {}
    try:
        node = yaml.compose(text, Loader=_Loader)
        if node is not None:
            _record(node, (), lines, problems, fname)
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = exc.problem or str(exc)
        if "python/" in str(exc) or "could not determine a constructor" in str(exc):
            what = f"{what} (YAML tags that build Python objects are not allowed)"
        raise ConfigError(Problem(f"invalid YAML: {what}", file=fname, line=line)) from None
    except yaml.YAMLError as exc:
        raise ConfigError(Problem(f"invalid YAML: {exc}", file=fname)) from None
    if problems:
        raise ConfigError(problems)
    return data, Locator(fname, lines)


def read_yaml_file(path: str | Path) -> tuple[Any, Locator]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(Problem("file not found", file=str(path))) from None
    except OSError as exc:
        raise ConfigError(Problem(f"cannot read file: {exc.strerror}", file=str(path))) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(Problem(f"file is not UTF-8 (byte {exc.start})", file=str(path))) from None
    return parse_yaml(text, str(path))


# -- overrides --------------------------------------------------------------------------------------
def apply_overrides(data: Any, overrides: list[str]) -> Any:
    """Apply ``key.path=value`` overrides (values parsed as YAML).

    In a list of named mappings (``stages``), a path segment may be a stage name or an index. A key
    under a stage that is not one of the stage's own keys goes into its ``config``.
    """
    if not overrides:
        return data
    if not isinstance(data, dict):
        raise ConfigError("cannot apply --set overrides: the file is not a mapping")
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            problems.append(Problem(f"--set {item!r}: expected key.path=value"))
            continue
        try:
            value = yaml.load(raw, Loader=_Loader) if raw != "" else ""  # noqa: S506 - SafeLoader
        except yaml.YAMLError:
            value = raw
        parts = key.split(".")
        node: Any = data
        ok = True
        for i, part in enumerate(parts[:-1]):
            nxt = _descend(node, part)
            if nxt is None:
                if isinstance(node, dict):
                    nxt = node.setdefault(part, {})
                else:
                    problems.append(Problem(f"--set {key}: no element '{part}' in {'.'.join(parts[:i]) or 'the file'}"))
                    ok = False
                    break
            # A stage mapping: unknown keys go into its config.
            if _is_stage(nxt) and i + 2 == len(parts) and parts[-1] not in STAGE_KEYS:
                nxt = nxt.setdefault("config", {})
            node = nxt
        if not ok:
            continue
        last = parts[-1]
        if isinstance(node, list):
            idx = _index(node, last)
            if idx is None:
                problems.append(Problem(f"--set {key}: no element '{last}'"))
                continue
            node[idx] = value
        elif isinstance(node, dict):
            node[last] = value
        else:
            problems.append(Problem(f"--set {key}: '{'.'.join(parts[:-1])}' is not a mapping"))
    if problems:
        raise ConfigError(problems)
    return data


def _is_stage(node: Any) -> bool:
    return isinstance(node, dict) and "type" in node and "name" in node


def _index(node: list, part: str) -> int | None:
    for i, el in enumerate(node):
        if isinstance(el, dict) and el.get("name") == part:
            return i
    if part.lstrip("-").isdigit() and -len(node) <= int(part) < len(node):
        return int(part)
    return None


def _descend(node: Any, part: str) -> Any:
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list):
        idx = _index(node, part)
        return node[idx] if idx is not None else None
    return None


# -- typed structuring ------------------------------------------------------------------------------
def describe_type(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if isinstance(tp, type):
        return tp.__name__
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(describe_type(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None and args:
        return f"{getattr(origin, '__name__', str(origin))}[{', '.join(describe_type(a) for a in args if a is not Ellipsis)}]"
    return str(tp).replace("typing.", "")


def check_type(value: Any, tp: Any) -> str | None:
    """Why ``value`` does not fit ``tp`` (strictly: YAML ``"3"`` is not an int), or None."""
    if tp is Any or tp is object:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if any(check_type(value, a) is None for a in args):
            return None
        return f"expected {describe_type(tp)}, got {_show(value)}"
    if origin is typing.Literal:
        return None if value in args else f"expected one of {', '.join(repr(a) for a in args)}, got {_show(value)}"
    if tp is type(None):
        return None if value is None else f"expected null, got {_show(value)}"
    if tp is bool:
        return None if isinstance(value, bool) else f"expected a boolean, got {_show(value)}"
    if tp is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else f"expected an integer, got {_show(value)}"
    if tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        return None if ok else f"expected a number, got {_show(value)}"
    if tp is str or tp is Path:
        return None if isinstance(value, str) else f"expected a string, got {_show(value)}"
    if origin in (list, tuple, typing.Sequence) or tp in (list, tuple):
        if not isinstance(value, list):
            return f"expected a list, got {_show(value)}"
        if args:
            elem = args[0]
            for i, v in enumerate(value):
                err = check_type(v, elem)
                if err:
                    return f"item {i}: {err}"
        return None
    if origin in (dict, Mapping) or tp is dict:
        if not isinstance(value, dict):
            return f"expected a mapping, got {_show(value)}"
        if len(args) == 2:
            for k, v in value.items():
                err = check_type(k, args[0]) or check_type(v, args[1])
                if err:
                    return f"key {k!r}: {err}"
        return None
    if isinstance(tp, type) and attrs.has(tp):
        return None if isinstance(value, dict) else f"expected a mapping, got {_show(value)}"
    if isinstance(tp, type):
        return None if isinstance(value, tp) else f"expected {tp.__name__}, got {_show(value)}"
    return None


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}" if not isinstance(value, (dict, list)) else type(value).__name__


def _convert(value: Any, tp: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for a in args:
            if a is not type(None) and check_type(value, a) is None:
                return _convert(value, a)
        return value
    if tp is Path:
        return Path(value)
    if tp is float and isinstance(value, int):
        return float(value)
    if origin is tuple and isinstance(value, list):
        return tuple(value)
    if isinstance(tp, type) and attrs.has(tp) and isinstance(value, dict):
        obj, _ = structure(tp, value)
        return obj
    return value


def _field_types(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    return hints


def structure(
    cls: type,
    data: Any,
    *,
    locate: Any = None,
    stage: str | None = None,
    fields: list[attrs.Attribute] | None = None,
    what: str = "config",
) -> tuple[Any, list[Problem]]:
    """Build the attrs class ``cls`` from a mapping; return (instance or None, problems).

    Every unknown key, wrong type and failed validator is reported, not just the first.
    ``locate(key) -> Problem`` factory gives each problem its file and line.
    """
    locate = locate or (lambda message, key=None: Problem(message, stage=stage, field=key))
    problems: list[Problem] = []
    if data is None:
        data = {}
    if not isinstance(data, dict):
        return None, [locate(f"{what} must be a mapping, got {type(data).__name__}")]
    fields = fields if fields is not None else [f for f in attrs.fields(cls) if f.init and not f.name.startswith("_")]
    by_name = {f.alias if hasattr(f, "alias") and f.alias else f.name: f for f in fields}
    hints = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in by_name:
            close = difflib.get_close_matches(str(key), list(by_name), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else (f"; known fields: {', '.join(by_name)}" if by_name else "; this stage takes no config")
            problems.append(locate(f"unknown field '{key}'{hint}", key))
            continue
        f = by_name[key]
        tp = hints.get(f.name, Any)
        err = check_type(value, tp)
        if err:
            problems.append(locate(err, key))
            continue
        value = _convert(value, tp)
        if f.validator is not None:
            try:
                f.validator(None, f, value)
            except Exception as exc:  # validators raise ValueError/TypeError with a message
                problems.append(locate(_validator_message(exc), key))
                continue
        kwargs[f.name if not getattr(f, "alias", None) else f.alias] = value
    for name, f in by_name.items():
        if f.default is attrs.NOTHING and name not in data:
            problems.append(locate(f"missing required field '{name}'", name))
    if problems:
        return None, problems
    try:
        return cls(**kwargs), []
    except Exception as exc:
        return None, [locate(f"invalid {what}: {_validator_message(exc)}")]


def _validator_message(exc: Exception) -> str:
    if isinstance(exc, ValueError) and exc.args and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc) or type(exc).__name__


# -- graph building ---------------------------------------------------------------------------------
def graph_from_dict(data: Any, locator: Locator | None = None) -> Graph:
    """Structure a parsed document into a Graph. Shape problems raise ConfigError (all of them)."""
    loc = locator or Locator(None)
    problems: list[Problem] = []
    if not isinstance(data, dict):
        raise ConfigError(loc.problem("a pipeline file must be a mapping with a 'stages' list"))
    sections = registered_sections()
    allowed = set(TOP_LEVEL_KEYS) | set(sections)
    for key in data:
        if key not in allowed:
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; allowed: {', '.join(sorted(allowed))}"
            problems.append(loc.problem(f"unknown top-level key '{key}'{hint}", key, field=str(key)))
    graph = Graph(locator=loc)
    name = data.get("name", "pipeline")
    if not isinstance(name, str) or not name:
        problems.append(loc.problem("'name' must be a non-empty string", "name", field="name"))
    else:
        graph.name = name
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        problems.append(loc.problem(f"'seed' must be a non-negative integer, got {seed!r}", "seed", field="seed"))
    else:
        graph.seed = seed
    out_dir = data.get("output_dir")
    if out_dir is not None and not isinstance(out_dir, str):
        problems.append(loc.problem("'output_dir' must be a string", "output_dir", field="output_dir"))
    else:
        graph.output_dir = out_dir
    runtime, probs = structure(
        RuntimeOptions,
        data.get("runtime") or {},
        locate=lambda m, k=None: loc.problem(m, "runtime", *( [k] if k else []), field=f"runtime.{k}" if k else "runtime"),
        what="runtime",
    )
    problems.extend(probs)
    if runtime is not None:
        graph.runtime = runtime
    for key, cls in sections.items():
        if key in data:
            obj, probs = structure(
                cls,
                data[key],
                locate=lambda m, k=None, key=key: loc.problem(m, key, *([k] if k else []), field=f"{key}.{k}" if k else key),
                what=key,
            )
            problems.extend(probs)
            if obj is not None:
                graph.sections[key] = obj
        else:
            try:
                graph.sections[key] = cls()
            except TypeError:
                pass
    stages = data.get("stages")
    if stages is None:
        problems.append(loc.problem("missing 'stages' (a list of stage definitions)", field="stages"))
        stages = []
    elif not isinstance(stages, list):
        problems.append(loc.problem("'stages' must be a list", "stages", field="stages"))
        stages = []
    elif not stages:
        problems.append(loc.problem("'stages' is empty", "stages", field="stages"))
    for i, raw in enumerate(stages):
        spec, probs = _stage_spec(raw, i, loc)
        problems.extend(probs)
        if spec is not None:
            graph.stages.append(spec)
    if problems:
        raise ConfigError(problems)
    return graph


def _stage_spec(raw: Any, i: int, loc: Locator) -> tuple[StageSpec | None, list[Problem]]:
    p = ("stages", i)
    if not isinstance(raw, dict):
        return None, [loc.problem(f"stage #{i + 1} must be a mapping", *p)]
    problems = []
    name = raw.get("name")
    label = name if isinstance(name, str) else f"#{i + 1}"
    if not isinstance(name, str) or not name:
        problems.append(loc.problem("stage needs a 'name' (a non-empty string)", *p, stage=label, field="name"))
    elif not name.replace("_", "").replace("-", "").isalnum():
        problems.append(loc.problem(f"stage name {name!r} may contain only letters, digits, '_' and '-'", *p, "name", stage=label, field="name"))
    for key in raw:
        if key not in STAGE_KEYS:
            close = difflib.get_close_matches(str(key), STAGE_KEYS, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else f"; stage keys are {', '.join(STAGE_KEYS)} (stage settings go under 'config')"
            problems.append(loc.problem(f"unknown stage key '{key}'{hint}", *p, key, stage=label, field=str(key)))
    type_ = raw.get("type")
    if not isinstance(type_, str) or not type_:
        problems.append(loc.problem("stage needs a 'type' (a registered stage type name)", *p, stage=label, field="type"))
    config = raw.get("config") or {}
    if not isinstance(config, dict):
        problems.append(loc.problem("'config' must be a mapping", *p, "config", stage=label, field="config"))
        config = {}
    replicas = raw.get("replicas", 1)
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        problems.append(loc.problem(f"'replicas' must be an integer, got {replicas!r}", *p, "replicas", stage=label, field="replicas"))
        replicas = 1
    devices = raw.get("devices", "cpu")
    if not (isinstance(devices, str) or (isinstance(devices, list) and all(isinstance(d, str) for d in devices) and devices)):
        problems.append(loc.problem("'devices' must be a device string or a non-empty list of them", *p, "devices", stage=label, field="devices"))
        devices = "cpu"
    capacity = raw.get("capacity")
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int)):
        problems.append(loc.problem(f"'capacity' must be an integer, got {capacity!r}", *p, "capacity", stage=label, field="capacity"))
        capacity = None
    ordered = raw.get("ordered", False)
    if not isinstance(ordered, bool):
        problems.append(loc.problem("'ordered' must be true or false", *p, "ordered", stage=label, field="ordered"))
        ordered = False
    inputs_raw = raw.get("inputs", [])
    if isinstance(inputs_raw, str):
        inputs_raw = [inputs_raw]
    inputs = []
    if not isinstance(inputs_raw, list):
        problems.append(loc.problem("'inputs' must be a stage name or a list", *p, "inputs", stage=label, field="inputs"))
        inputs_raw = []
    for j, item in enumerate(inputs_raw):
        if isinstance(item, str):
            inputs.append(InputSpec(item))
        elif isinstance(item, dict) and isinstance(item.get("stage"), str):
            extra = set(item) - {"stage", "policy"}
            if extra:
                problems.append(loc.problem(f"unknown input key(s) {sorted(extra)}; an input has 'stage' and 'policy'", *p, "inputs", j, stage=label, field="inputs"))
            pol = item.get("policy", "round_robin")
            if not isinstance(pol, str):
                problems.append(loc.problem("input 'policy' must be a string", *p, "inputs", j, stage=label, field="inputs"))
                pol = "round_robin"
            inputs.append(InputSpec(item["stage"], pol))
        else:
            problems.append(loc.problem("an input is a stage name or {stage: NAME, policy: POLICY}", *p, "inputs", j, stage=label, field="inputs"))
    if problems:
        return None, problems
    return (
        StageSpec(
            name=name,
            type=type_,
            config=config,
            replicas=replicas,
            devices=devices,
            inputs=inputs,
            capacity=capacity,
            ordered=ordered,
        ),
        [],
    )


def load_graph(path: str | Path, overrides: list[str] | None = None) -> Graph:
    """Read, override and structure a pipeline file (no validation of stage configs yet)."""
    data, loc = read_yaml_file(path)
    data = apply_overrides(data, overrides or [])
    return graph_from_dict(data, loc)


def load_graph_text(text: str, filename: str | None = None, overrides: list[str] | None = None) -> Graph:
    data, loc = parse_yaml(text, filename)
    data = apply_overrides(data, overrides or [])
    return graph_from_dict(data, loc)
