"""How values and types read in messages (describe_type, show, short), a config class's fields, Invalid."""

from __future__ import annotations

import math
import types
import typing
from typing import Any

import attrs

__all__ = ["NoneType", "Invalid", "config_fields", "describe_type", "field_types", "short", "show"]

NoneType = type(None)


class Invalid(ValueError):
    """A value does not fit its field; the message is complete as it is (no wording is added)."""


def describe_type(tp: Any) -> str:
    """A type as a user reads it in messages and in `dflash-flow stages`: ``int | null``, ``list[str]``."""
    if tp is NoneType:
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
        inner = ", ".join(describe_type(a) for a in args if a is not Ellipsis)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return str(tp).replace("typing.", "")


def show(value: Any) -> str:
    """A value in a message: its type and a short repr (``str '12'``), YAML's spelling for non-finite
    numbers, only the type of a container."""
    if isinstance(value, (dict, list, tuple)):
        return type(value).__name__
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return "float " + (".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf")
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def short(value: Any, limit: int = 60) -> str:
    """``str(value)`` cut to ``limit`` characters (keys and names from a hostile file can be huge)."""
    text = str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of an attrs class (``{}`` when they cannot be resolved)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a stage class with unresolvable annotations: described as untyped
        return {}


def config_fields(cls: type) -> list[attrs.Attribute]:
    """The fields a YAML mapping gives: public ``__init__`` fields (``_private`` ones are state)."""
    return [f for f in attrs.fields(cls) if f.init and not f.name.startswith("_")]
