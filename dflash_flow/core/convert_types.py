"""Type conversion's strict hooks (no coercion) and how values and types read in messages."""

from __future__ import annotations

import collections.abc as abc
import math
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory, list_structure_factory
from cattrs.errors import IterableValidationError, IterableValidationNote
from cattrs.gen import make_mapping_structure_fn

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
    """A value in a message: its type and a short repr (``str '12'``); a container's type only."""
    if isinstance(value, (dict, list, tuple)):
        return type(value).__name__
    if value is None:
        return "null"
    if isinstance(value, float) and not math.isfinite(value):
        return "float " + (".nan" if math.isnan(value) else ".inf" if value > 0 else "-.inf")
    return f"{type(value).__name__} {short(repr(value), 40)}"


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


def field_default(f: attrs.Attribute) -> Any:
    """A config field's default value (None for a required field or a default computed from the instance)."""
    if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
        return f.default.factory() if not f.default.takes_self else None
    return None if f.default is attrs.NOTHING else f.default


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def exact(check: Callable[[Any], bool], what: str = "", *, message: str = "") -> Callable:
    """A hook that passes what ``check`` accepts, as it is, and refuses anything else."""
    def hook(value: Any, _: Any) -> Any:
        if not check(value):
            raise Invalid(message or f"expected {what}, got {show(value)}")
        return value

    return hook


def _structure_float(value: Any, _: Any) -> float:
    number = _structure_any_float(value, _)
    if not math.isfinite(number):
        raise Invalid(f"expected a finite number, got {show(number)} (this field takes no .inf or .nan)")
    return number


def _structure_any_float(value: Any, _: Any) -> float:
    """A float that may be NaN or infinite: for ``cfg(finite=False)`` fields only."""
    if isinstance(value, float):
        return value
    if is_int(value):
        try:
            return float(value)
        except OverflowError:
            raise Invalid(f"expected a finite number, got {show(value)} (too large for a float)") from None
    raise Invalid(f"expected a number, got {show(value)}")


def _structure_path(value: Any, _: Any) -> Path:
    if not isinstance(value, (str, Path)):
        raise Invalid(f"expected a string, got {show(value)}")
    return Path(value)


def _structure_literal(value: Any, tp: Any) -> Any:
    # ``type(...) is``: True must not pass for Literal[1], nor 1 for Literal[True].
    if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
        return value
    options = ", ".join(repr(a) for a in typing.get_args(tp))
    raise Invalid(f"expected one of {options}, got {show(value)}")


# -- container and union hooks ----------------------------------------------------------------------
def _kind(bare: tuple, origins: tuple) -> Callable[[Any], bool]:
    """A predicate on types: one of ``bare``, or a generic alias whose origin is one of ``origins``."""
    return lambda tp: tp in bare or typing.get_origin(tp) in origins


_is_union = _kind((), (typing.Union, types.UnionType))
_is_literal = _kind((), (typing.Literal,))
_is_list = _kind((list,), (list, abc.Sequence, abc.MutableSequence))
_is_tuple = _kind((tuple,), (tuple,))
_is_set = _kind((set, frozenset), (set, frozenset, abc.Set, abc.MutableSet))
_is_mapping = _kind((dict,), (dict, abc.Mapping, abc.MutableMapping))


def _need_list(value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise Invalid(f"expected a list, got {show(value)}")


def list_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    inner = list_structure_factory(tp, conv)  # cattrs' own, with per-index errors

    def structure_list(value: Any, _: Any) -> list:
        _need_list(value)
        return inner(value, tp)

    return structure_list


def _set_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    args = typing.get_args(tp)
    inner = list_structure_factory(list[args[0]] if args else list, conv)
    make = frozenset if frozenset in (tp, typing.get_origin(tp)) else set

    def structure_set(value: Any, _: Any) -> Any:
        if not isinstance(value, (list, tuple, set, frozenset)):
            raise Invalid(f"expected a list, got {show(value)}")
        return make(inner(list(value), tp))

    return structure_set


def _tuple_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    args = typing.get_args(tp)
    if not args or (len(args) == 2 and args[1] is Ellipsis):
        inner = homogenous_tuple_structure_factory(tuple[args[0], ...] if args else tuple, conv)

        def structure_tuple(value: Any, _: Any) -> tuple:
            _need_list(value)
            return inner(value, tp)

        return structure_tuple
    hooks = [conv.get_structure_hook(a) for a in args]

    def structure_fixed_tuple(value: Any, _: Any) -> tuple:
        _need_list(value)
        if len(value) != len(args):
            raise Invalid(f"expected a list of {len(args)} items ({describe_type(tp)}), got {len(value)}")
        out, errors = [], []
        for i, (hook, a, v) in enumerate(zip(hooks, args, value, strict=True)):
            try:
                out.append(hook(v, a))
            except Exception as exc:
                exc.__notes__ = [*getattr(exc, "__notes__", []), IterableValidationNote(f"item {i}", i, a)]
                errors.append(exc)
        if errors:
            raise IterableValidationError(f"While structuring {tp!r}", errors, tuple)
        return tuple(out)

    return structure_fixed_tuple


def _mapping_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    inner = make_mapping_structure_fn(tp, conv)  # cattrs' own, with per-key errors

    def structure_mapping(value: Any, _: Any) -> dict:
        if not isinstance(value, Mapping):
            raise Invalid(f"expected a mapping, got {show(value)}")
        return inner(value, tp)

    return structure_mapping


def _fits(value: Any, tp: Any) -> bool:
    """A cheap look at the outer shape: which members of a union are worth trying."""
    if tp is Any or tp is object:
        return True
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return is_int(value)
    if tp is float:
        return is_int(value) or isinstance(value, float)
    if tp in (str, Path):
        return isinstance(value, str)
    if _is_literal(tp):
        return value in typing.get_args(tp)
    if _is_list(tp) or _is_tuple(tp) or _is_set(tp):
        return isinstance(value, (list, tuple))
    if _is_mapping(tp) or (isinstance(tp, type) and attrs.has(tp)):
        return isinstance(value, Mapping)
    return not isinstance(tp, type) or isinstance(value, tp)


def _union_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    args = typing.get_args(tp)
    nullable = NoneType in args
    members = [(a, conv.get_structure_hook(a)) for a in args if a is not NoneType]

    def structure_union(value: Any, _: Any) -> Any:
        if value is None and nullable:
            return None
        # ``X | None`` given something: X's own message ("expected an integer") says more than the union's.
        fitting = members if len(members) == 1 else [(a, h) for a, h in members if _fits(value, a)]
        # The member of the value's own type first: 3 stays an int in ``float | int``.
        fitting.sort(key=lambda m: m[0] is not type(value))
        if len(fitting) == 1:
            return fitting[0][1](value, fitting[0][0])  # its own detailed errors are the useful ones
        for a, hook in fitting:
            try:
                return hook(value, a)
            except Exception:  # noqa: S112 - the next member may fit
                continue
        raise Invalid(f"expected {describe_type(tp)}, got {show(value)}")

    return structure_union


def _fallback_factory(tp: Any) -> Callable:
    """Types without a hook of their own (a custom class): the value must already be one."""
    if isinstance(tp, type):

        def structure_instance(value: Any, _: Any) -> Any:
            if not isinstance(value, tp):
                raise Invalid(f"expected {tp.__name__}, got {show(value)}")
            return value

        return structure_instance
    return lambda value, _: value


def base_converter(*, finite: bool) -> cattrs.Converter:
    """A strict converter with this module's hooks (``convert`` adds attrs classes and the pipeline's shapes)."""
    conv = cattrs.Converter(forbid_extra_keys=True, detailed_validation=True,
                            structure_fallback_factory=_fallback_factory)
    conv.register_structure_hook(int, exact(is_int, "an integer"))
    conv.register_structure_hook(float, _structure_float if finite else _structure_any_float)
    conv.register_structure_hook(bool, exact(lambda v: isinstance(v, bool), "a boolean"))
    conv.register_structure_hook(str, exact(lambda v: isinstance(v, str), "a string"))
    conv.register_structure_hook(Path, _structure_path)
    conv.register_structure_hook(NoneType, exact(lambda v: v is None, "null"))
    conv.register_structure_hook_func(_is_literal, _structure_literal)
    conv.register_structure_hook_factory(_is_list, list_factory)
    conv.register_structure_hook_factory(_is_set, _set_factory)
    conv.register_structure_hook_factory(_is_tuple, _tuple_factory)
    conv.register_structure_hook_factory(_is_mapping, _mapping_factory)
    conv.register_structure_hook_factory(_is_union, _union_factory)
    return conv
