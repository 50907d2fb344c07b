"""Stage types resolve by name: classes registered in-process (``@register_stage``), then the entry-point group
``dflash_flow.stages`` (the built-ins too: listing them imports no stage module; YAML names no module)."""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from .stage import Stage

ENTRY_POINT_GROUP = "dflash_flow.stages"

_REGISTERED: dict[str, type[Stage]] = {}
_entry_points_cache: dict[str, Any] | None = None


class UnknownStageType(LookupError):
    pass


def register_stage(cls_or_name: Any = None, *, name: str | None = None):
    """Class decorator: ``@register_stage`` or ``@register_stage("Name")``."""

    def deco(cls: type[Stage], key: str | None = None) -> type[Stage]:
        if not (isinstance(cls, type) and issubclass(cls, Stage)):
            raise TypeError(f"{cls!r} is not a Stage subclass")
        key = key or name or cls.__name__
        prev = _REGISTERED.get(key)
        if prev is not None and prev is not cls and _qualname(prev) != _qualname(cls):
            raise ValueError(f"stage type '{key}' is already registered by {_qualname(prev)}")
        ep = _entry_points().get(key)
        if prev is None and ep is not None and ep.value != f"{cls.__module__}:{cls.__qualname__}":
            raise ValueError(f"stage type '{key}' is already declared by the entry point {ep.value}")
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


def available() -> list[str]:
    return sorted(set(_REGISTERED) | set(_entry_points()))


def resolve(name: str) -> type[Stage]:
    if name in _REGISTERED:
        return _REGISTERED[name]
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
