"""Stage types resolve by name: built-ins, classes registered in-process, and the entry-point group
``dflash_flow.stages``. A YAML file names a type; it can never name a module to import.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from .stage import Stage

ENTRY_POINT_GROUP = "dflash_flow.stages"

# name -> "module:attribute". Built-ins are imported only when resolved, so validate/graph stay fast.
_BUILTIN: dict[str, str] = {}
_REGISTERED: dict[str, type[Stage]] = {}
_entry_points_cache: dict[str, Any] | None = None


class UnknownStageType(LookupError):
    pass


def register_builtin(name: str, target: str) -> None:
    """Declare a built-in stage type by import path (used by dflash_flow.stages)."""
    _BUILTIN[name] = target


def register_stage(cls_or_name: Any = None, *, name: str | None = None):
    """Class decorator: ``@register_stage`` or ``@register_stage("Name")``."""

    def deco(cls: type[Stage], key: str | None = None) -> type[Stage]:
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            raise TypeError(f"{cls!r} is not a Stage subclass")
        key = key or name or cls.__name__
        prev = _REGISTERED.get(key)
        if prev is not None and prev is not cls and _qualname(prev) != _qualname(cls):
            raise ValueError(f"stage type '{key}' is already registered by {_qualname(prev)}")
        _REGISTERED[key] = cls
        cls.__stage_type__ = key  # type: ignore[attr-defined]
        return cls

    if isinstance(cls_or_name, str):
        return lambda cls: deco(cls, cls_or_name)
    if cls_or_name is None:
        return deco
    return deco(cls_or_name)


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _entry_points() -> dict[str, Any]:
    global _entry_points_cache
    if _entry_points_cache is None:
        _entry_points_cache = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    return _entry_points_cache


def _ensure_builtins() -> None:
    # Importing the package registers the built-in names (cheap: no torch).
    importlib.import_module("dflash_flow.stages")


def available() -> list[str]:
    _ensure_builtins()
    return sorted(set(_BUILTIN) | set(_REGISTERED) | set(_entry_points()))


def resolve(name: str) -> type[Stage]:
    """The Stage class registered under ``name``."""
    _ensure_builtins()
    if name in _REGISTERED:
        return _REGISTERED[name]
    if name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
        _REGISTERED.setdefault(name, cls)
        cls.__stage_type__ = name
        return cls
    ep = _entry_points().get(name)
    if ep is not None:
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            raise UnknownStageType(f"entry point '{name}' ({ep.value}) is not a Stage subclass")
        _REGISTERED.setdefault(name, cls)
        cls.__stage_type__ = name
        return cls
    raise UnknownStageType(name)


def type_name(cls: type[Stage]) -> str:
    """The registered name of a stage class (registering it under its class name if needed)."""
    name = getattr(cls, "__stage_type__", None)
    if name and _REGISTERED.get(name) is cls:
        return name
    for key, value in _REGISTERED.items():
        if value is cls:
            return key
    register_stage(cls)
    return cls.__name__
