"""Config fields declared once and carried by several classes (``include``).

A knob belongs to one small attrs class (a drafter variant's settings, the optimisation recipe); a stage
whose YAML takes that knob flat includes the class's fields instead of declaring them again: the same
type, default, bounds, doc and validators, so the YAML field, its ``dflash-flow stages`` line and its
located validation all come from the one declaration.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from typing import Any

import attrs


def include(*sources: type, exclude: Iterable[str] = ()) -> Callable[[type], type]:
    """Class decorator, under ``@attrs.define``: the init fields of the attrs classes ``sources`` (less
    ``exclude``) become keyword-only fields of the decorated class, in their declaration order, after its
    own. A name declared twice is a TypeError at import (the point: one declaration per knob)."""
    skip = set(exclude)

    def decorate(cls: type) -> type:
        own = dict(cls.__dict__.get("__annotations__", {}))
        added: dict[str, typing.Any] = {}
        for src in sources:
            hints = typing.get_type_hints(src)
            for f in attrs.fields(src):
                if not f.init or f.name.startswith("_") or f.name in skip:
                    continue
                if f.name in own or f.name in added:
                    raise TypeError(f"{cls.__qualname__}.{f.name}: declared in {src.__qualname__} already")
                added[f.name] = hints.get(f.name, typing.Any)
                default = f.default
                setattr(cls, f.name, attrs.field(
                    default=default, validator=f.validator, converter=f.converter, metadata=dict(f.metadata),
                    kw_only=True,
                ))
        cls.__annotations__ = {**own, **added}
        return cls

    return decorate


def values_of(cls: type, source: typing.Any, *, exclude: Iterable[str] = (), **extra: typing.Any) -> typing.Any:
    """``cls`` built from the same-named attributes of ``source`` (an object that includes its fields),
    ``extra`` given as is."""
    skip = set(exclude) | set(extra)
    kw = {f.name: getattr(source, f.name) for f in attrs.fields(cls) if f.init and f.name not in skip}
    return cls(**kw, **extra)


def field_errors(cls: type, problems: list[tuple[str, str]]) -> Exception:
    """One error for ``(field, message)`` problems found by a check that needs the whole instance (a
    validator run once every field is set): each is reported at its own field, and so at its own YAML
    line (``convert_errors.problems_of`` reads the attribute notes cattrs puts on field errors)."""
    from cattrs.errors import AttributeValidationNote, ClassValidationError

    errors = []
    for name, message in problems:
        exc = ValueError(message)
        exc.__notes__ = [AttributeValidationNote(f"Structuring class {cls.__qualname__} @ attribute {name}", name, Any)]
        errors.append(exc)
    return ClassValidationError(f"invalid {cls.__qualname__} config", errors, cls)
