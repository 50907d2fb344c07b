"""Safe, bounded YAML reading. The composer counts nodes (an alias as the whole node it repeats) and depth *as
it composes*, so alias bombs are refused before expansion; number literals are bounded in length (YAML 1.1
base-60 integers cost quadratic time). PyYAML's pure-Python parser words syntax errors best."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.parser import Parser
from yaml.reader import Reader, ReaderError
from yaml.resolver import Resolver
from yaml.scanner import Scanner

from . import limits
from .convert_types import short
from .errors import ConfigError, Problem


class YAMLLimitError(yaml.MarkedYAMLError):
    """A document asks for more work than the limits allow (reported without the "invalid YAML" prefix)."""

    def __init__(self, problem: str, mark: Any = None):
        super().__init__(problem=problem, problem_mark=mark)


class _BoundedComposer(Composer):
    """PyYAML's composer, counting nodes (aliases expanded) and depth as it goes."""

    def _init_bounds(self, depth_offset: int) -> None:
        self._depth = depth_offset  # lists and mappings around the node being composed
        self._deepest = depth_offset  # deepest such nesting reached inside it so far
        self._nodes = 0  # nodes so far, every alias counted as the node it repeats
        self._expanded: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, height) once composed
        self._repeated = 0  # nodes counted through aliases

    def compose_node(self, parent: Any, index: Any) -> Any:
        is_key = isinstance(parent, yaml.MappingNode) and index is None  # how Composer composes a key
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            if event.anchor in self.anchors:  # an undefined alias is the base class's error
                if event.anchor not in self._expanded:
                    raise YAMLLimitError(f"alias '*{event.anchor}' refers to a node that contains it (a structure "
                                         "that contains itself cannot be read)", event.start_mark)
                if is_key:
                    self._plain_key(self.anchors[event.anchor], event.start_mark)
                nodes, height = self._expanded[event.anchor]
                self._repeated += nodes
                self._count(nodes, event.start_mark)
                self._reach(self._depth + height, event.start_mark)
            return super().compose_node(parent, index)
        event = self.peek_event()
        if is_key:
            self._plain_key(event, event.start_mark)
        self._count(1, event.start_mark)
        nested = not isinstance(event, yaml.ScalarEvent)  # depth counts lists and mappings
        if nested:
            self._depth += 1
            self._reach(self._depth, event.start_mark)
        outer_deepest, self._deepest = self._deepest, self._depth
        before = self._nodes
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= nested
        if event.anchor is not None:  # what an alias of it will repeat: its nodes and its levels
            self._expanded[event.anchor] = (self._nodes - before + 1, self._deepest - self._depth)
        self._deepest = max(outer_deepest, self._deepest)
        return node

    @staticmethod
    def _plain_key(what: Any, mark: Any) -> None:
        """A mapping key must be a scalar: a list or mapping key cannot be a Python dict key."""
        if isinstance(what, (yaml.SequenceNode, yaml.SequenceStartEvent)):
            kind = "list"
        elif isinstance(what, (yaml.MappingNode, yaml.MappingStartEvent)):
            kind = "mapping"
        else:
            return
        raise YAMLLimitError(f"a mapping key must be a plain value such as a name, not a {kind} (YAML '? ' keys are "
                             "not supported)", mark)

    def _count(self, n: int, mark: Any) -> None:
        self._nodes += n
        if self._nodes > limits.MAX_YAML_NODES:
            what = ("values once its aliases are expanded (an alias repeats the whole node it names)" if self._repeated
                    else "values (lists, mappings and scalars)")
            raise YAMLLimitError(f"the document stands for more than {limits.MAX_YAML_NODES} {what}; a pipeline file "
                                 "is far smaller", mark)

    def _reach(self, depth: int, mark: Any) -> None:
        self._deepest = max(self._deepest, depth)
        if depth > limits.MAX_YAML_DEPTH:
            raise YAMLLimitError(f"lists and mappings nest deeper than {limits.MAX_YAML_DEPTH} levels", mark)


class _BoundedConstructor(SafeConstructor):
    """SafeConstructor whose value errors (an impossible date, an over-long number) are located YAML errors."""

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except yaml.YAMLError:
            raise
        except (ValueError, TypeError, OverflowError) as exc:
            raise ConstructorError(None, None, f"cannot read this value: {exc}", node.start_mark) from None

    def construct_yaml_int(self, node: Any) -> Any:
        self._bounded_number(node)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: Any) -> Any:
        self._bounded_number(node)
        return super().construct_yaml_float(node)

    @staticmethod
    def _bounded_number(node: Any) -> None:
        if len(node.value) > limits.MAX_NUMBER_CHARS:
            raise YAMLLimitError(f"a number literal of {len(node.value)} characters (at most {limits.MAX_NUMBER_CHARS})",
                                 node.start_mark)


_BoundedConstructor.add_constructor("tag:yaml.org,2002:int", _BoundedConstructor.construct_yaml_int)
_BoundedConstructor.add_constructor("tag:yaml.org,2002:float", _BoundedConstructor.construct_yaml_float)


class _Loader(Reader, Scanner, Parser, _BoundedComposer, _BoundedConstructor, Resolver):
    """The one loader of pipeline files and ``--set`` values; it also reads ``6e-4`` as a float (YAML 1.1 does not)."""

    def __init__(self, text: str, depth_offset: int = 0):
        Reader.__init__(self, text)
        Scanner.__init__(self)
        Parser.__init__(self)
        Composer.__init__(self)
        _BoundedConstructor.__init__(self)
        Resolver.__init__(self)
        self._init_bounds(depth_offset)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


# -- locating -------------------------------------------------------------------------------------
class Locator:
    """Line numbers of every key and value of a YAML document, by path."""

    def __init__(self, filename: str | None, lines: dict[tuple, int] | None = None):
        self.filename = filename
        self.lines = lines or {}

    def line(self, *path: Any) -> int | None:
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)

    def problem(self, message: str, *path: Any, stage: str | None = None, field: str | None = None) -> Problem:
        return Problem(message, file=self.filename, line=self.line(*path), stage=stage, field=field)


def _record(node: yaml.Node, path: tuple, lines: dict[tuple, int], problems: list[Problem], fname: str) -> None:
    """Line of every path, and duplicate keys."""
    lines[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        seen: set[Any] = set()
        for key_node, value_node in node.value:
            key = key_node.value  # a scalar: the composer refused list and mapping keys
            if key in seen:
                problems.append(Problem(f"duplicate key '{short(key)}'", file=fname, line=key_node.start_mark.line + 1))
            seen.add(key)
            _record(value_node, path + (key,), lines, problems, fname)
            lines[path + (key,)] = key_node.start_mark.line + 1  # the key's line, not its value's
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _record(item, path + (i,), lines, problems, fname)


def _load(text: str, depth_offset: int = 0, on_node: Callable[[yaml.Node], None] | None = None) -> Any:
    """The data of one document; ``on_node`` sees the composed root first (before merge keys are flattened)."""
    loader = _Loader(text, depth_offset)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        if on_node is not None:
            on_node(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _too_big(what: str) -> str:
    return f"{what} is larger than {limits.MAX_YAML_BYTES // 1024} KiB, the most a pipeline file may have"


def parse_yaml(text: str, filename: str | None = None) -> tuple[Any, Locator]:
    """Safe-load ``text`` within the limits; syntax errors, Python tags and limits become located ConfigErrors."""
    fname = filename or "<string>"
    if len(text) > limits.MAX_YAML_BYTES:
        raise ConfigError(Problem(_too_big("the text"), file=fname))
    problems: list[Problem] = []
    lines: dict[tuple, int] = {}
    try:
        data = _load(text, on_node=lambda node: _record(node, (), lines, problems, fname))
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_problem(exc, fname, text=text)) from None
    if problems:
        raise ConfigError(problems)
    return data, Locator(fname, lines)


def yaml_problem(exc: yaml.YAMLError, fname: str | None, prefix: str = "", text: str | None = None) -> Problem:
    """One located Problem for a YAML error of this module's loader."""
    if isinstance(exc, YAMLLimitError):
        mark = exc.problem_mark
        return Problem(f"{prefix}{exc.problem}", file=fname, line=mark.line + 1 if mark is not None else None)
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        what = exc.problem or str(exc)
        if "python/" in str(exc) or "could not determine a constructor" in str(exc):
            what = f"{what} (YAML tags that build Python objects are not allowed)"
        return Problem(f"{prefix}invalid YAML: {what}", file=fname, line=line)
    if isinstance(exc, ReaderError):  # a control character: its line, on one line
        line = text.count("\n", 0, exc.position) + 1 if text is not None else None
        char = exc.character if isinstance(exc.character, int) else ord(exc.character or "\0")
        return Problem(f"{prefix}invalid YAML: character #x{char:04x} is not allowed ({exc.reason})", file=fname, line=line)
    return Problem(f"{prefix}invalid YAML: {' '.join(str(exc).split())}", file=fname)


def read_yaml_file(path: str | Path) -> tuple[Any, Locator]:
    """Read and parse a pipeline file, reading no more than the size limit (a device or a huge file is refused)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            raw = f.read(limits.MAX_YAML_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(Problem("file not found", file=str(path))) from None
    except OSError as exc:
        raise ConfigError(Problem(f"cannot read file: {exc.strerror or exc}", file=str(path))) from None
    if len(raw) > limits.MAX_YAML_BYTES:
        raise ConfigError(Problem(_too_big("the file"), file=str(path)))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(Problem(f"file is not UTF-8 (byte {exc.start})", file=str(path))) from None
    return parse_yaml(text, str(path))


def load_value(text: str, depth_offset: int = 0) -> Any:
    """One ``--set`` value under the same loader and limits as a file; ``depth_offset``: the nesting where it goes."""
    if len(text) > limits.MAX_YAML_BYTES:
        raise YAMLLimitError(_too_big("the value"))
    return _load(text, depth_offset)
