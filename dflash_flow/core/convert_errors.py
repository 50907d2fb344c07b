"""The converter's errors located: cattrs' error tree turned into one Problem per error (``problems_of``)."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterator
from typing import Any

import attrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)

from .errors import Problem
from .graph import InputSpec, StageSpec
from .wording import Invalid, config_fields, short

__all__ = ["INPUT_FORM", "NEED_NAME", "NEED_TYPE", "STAGE_KEYS", "error_message", "problems_of"]

# The pipeline's own shapes, with the wording users know (``convert``'s hooks say the same).
STAGE_KEYS = tuple(f.name for f in attrs.fields(StageSpec))
INPUT_FORM = "an input is a stage name or {stage: NAME, policy: POLICY}"
NEED_NAME = "stage needs a 'name' (a non-empty string)"
NEED_TYPE = "stage needs a 'type' (a registered stage type name)"


def _unknown_key(cls: type, key: Any) -> str:
    if cls is StageSpec:
        close = difflib.get_close_matches(short(key), STAGE_KEYS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else f"; stage keys are {', '.join(STAGE_KEYS)} (stage settings go under 'config')"
        return f"unknown stage key '{short(key)}'{hint}"
    if cls is InputSpec:
        return f"unknown input key '{short(key)}'; an input has 'stage' and 'policy'"
    names = [f.name for f in config_fields(cls)]
    close = difflib.get_close_matches(short(key), names, n=1)
    if close:
        hint = f"; did you mean '{close[0]}'?"
    else:
        hint = f"; known fields: {', '.join(names)}" if names else "; this stage takes no config"
    return f"unknown field '{short(key)}'{hint}"


def _missing_message(cls: type, name: str) -> str:
    if cls is StageSpec and name == "name":
        return NEED_NAME
    if cls is StageSpec and name == "type":
        return NEED_TYPE
    if cls is InputSpec:
        return INPUT_FORM
    return f"missing required field '{name}'"


def _leaves(exc: BaseException, path: tuple) -> Iterator[tuple[tuple, BaseException, type | None, bool]]:
    """(path, leaf error, class being structured, raised by the class itself) for every error in a
    cattrs error tree. A path segment is ``("attr", name)`` or ``("item", index or key)``."""
    if not isinstance(exc, BaseValidationError):
        yield path, exc, None, False
        return
    for sub in exc.exceptions:
        seg = _segment(sub)
        if isinstance(sub, BaseValidationError):
            yield from _leaves(sub, path + seg)
        else:
            own = isinstance(exc, ClassValidationError) and not seg
            yield path + seg, sub, exc.cl, own


def _segment(exc: BaseException) -> tuple:
    for note in reversed(getattr(exc, "__notes__", ())):
        if isinstance(note, AttributeValidationNote):
            return (("attr", note.name),)
        if isinstance(note, IterableValidationNote):
            return (("item", note.index),)
    return ()


def _where(segs: tuple) -> tuple[str, str]:
    """(field, message prefix): ``(("attr","sizes"),("item",1))`` -> ``("sizes", "item 1: ")``."""
    last = max((i for i, (kind, _) in enumerate(segs) if kind == "attr"), default=-1)
    field = ""
    for kind, value in segs[: last + 1]:
        if kind == "attr":
            field = f"{field}.{value}" if field else str(value)
        else:
            field += f"[{short(value, 30)}]"
    prefix = "".join(f"item {v}: " if isinstance(v, int) else f"key {short(v, 30)!r}: " for _, v in segs[last + 1 :])
    return field, prefix


def error_message(exc: BaseException) -> str:
    """The user's message of a validator or constructor error."""
    if isinstance(exc, (ValueError, TypeError)) and exc.args and isinstance(exc.args[0], str):
        return exc.args[0]
    return str(exc) or type(exc).__name__


def problems_of(
    exc: BaseException,
    *,
    locate: Callable[[tuple], int | None],
    file: str | None,
    stage: str | None,
    field_prefix: str,
    what: str,
) -> list[Problem]:
    """One Problem per error in a cattrs error tree, in document order."""
    out: list[tuple[int, int, Problem]] = []

    def add(message: str, segs: tuple, field: str) -> None:
        path = tuple(value for _, value in segs)
        line = locate(path)
        full = f"{field_prefix}{field}" if field else field_prefix.rstrip(".") or None
        out.append((line or 0, len(out), Problem(message, file=file, line=line, stage=stage, field=full)))

    for segs, leaf, cls, own in _leaves(exc, ()):
        field, prefix = _where(segs)
        if isinstance(leaf, ForbiddenExtraKeysError):
            for key in sorted(leaf.extra_fields, key=str):
                key_field = f"{field}.{short(key)}" if field else short(key)
                add(prefix + _unknown_key(leaf.cl, key), segs + (("item", key),), key_field)
        elif isinstance(leaf, KeyError) and segs and segs[-1] == ("attr", leaf.args[0] if leaf.args else None):
            add(prefix + _missing_message(cls, segs[-1][1]), segs, field)
        elif isinstance(leaf, Invalid):
            add(prefix + str(leaf), segs, field)
        elif own:
            add(f"{prefix}invalid {what}: {error_message(leaf)}", segs, field)
        else:
            add(prefix + error_message(leaf), segs, field)
    return [p for _, _, p in sorted(out, key=lambda t: (t[0], t[1]))]
