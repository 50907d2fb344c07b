"""The one strict converter (cattrs) from parsed YAML to typed objects, with every problem located.

``CONVERTER`` structures stage configs (the public init fields of a Stage subclass), ``StageSpec`` /
``InputSpec`` / ``RuntimeOptions`` and the application sections. It is strict where YAML is loose:

- no unknown keys (each is reported with the closest known one);
- no coercion: YAML ``"3"`` is not an int, ``1`` is not a bool, ``2.5`` is not an int (an int *is* a
  float); a list is a list (not a string's characters) and a mapping a mapping;
- NaN and infinity are refused for every float, unless the field says ``cfg(..., finite=False)``;
- every field's validators (``cfg(ge=, gt=, le=, lt=, choices=)``, plain attrs validators) run on the
  structured value and are reported with that field, all fields at once.

cattrs' detailed validation collects every error of a document in one exception tree; ``problems_of``
turns that tree into one ``Problem`` per error, its path (``("stages", 3, "config", "max_tokens")``) mapped
to file:line by the ``Locator`` of the file.
"""

from __future__ import annotations

import collections.abc as abc
import difflib
import math
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import cattrs
from cattrs.cols import homogenous_tuple_structure_factory, list_structure_factory
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, make_mapping_structure_fn, override

from . import limits
from .errors import Problem
from .graph import InputSpec, StageSpec

NoneType = type(None)


class Invalid(ValueError):
    """A value does not fit its field; the message is complete as it is (no wording is added)."""


# -- describing values and types ------------------------------------------------------------------
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


# -- primitive hooks --------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _structure_int(value: Any, _: Any) -> int:
    if not _is_int(value):
        raise Invalid(f"expected an integer, got {show(value)}")
    return value


def _structure_float(value: Any, _: Any) -> float:
    number = _structure_any_float(value, _)
    if not math.isfinite(number):
        raise Invalid(f"expected a finite number, got {show(number)} (this field takes no .inf or .nan)")
    return number


def _structure_any_float(value: Any, _: Any) -> float:
    """A float that may be NaN or infinite: for ``cfg(finite=False)`` fields only."""
    if isinstance(value, float):
        return value
    if _is_int(value):
        try:
            return float(value)
        except OverflowError:
            raise Invalid(f"expected a finite number, got {show(value)} (too large for a float)") from None
    raise Invalid(f"expected a number, got {show(value)}")


def _structure_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"expected a boolean, got {show(value)}")
    return value


def _structure_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {show(value)}")
    return value


def _structure_path(value: Any, _: Any) -> Path:
    if not isinstance(value, (str, Path)):
        raise Invalid(f"expected a string, got {show(value)}")
    return Path(value)


def _structure_none(value: Any, _: Any) -> None:
    if value is not None:
        raise Invalid(f"expected null, got {show(value)}")


def _structure_literal(value: Any, tp: Any) -> Any:
    # ``type(...) is``: True must not pass for Literal[1], nor 1 for Literal[True].
    if any(value == a and type(value) is type(a) for a in typing.get_args(tp)):
        return value
    options = ", ".join(repr(a) for a in typing.get_args(tp))
    raise Invalid(f"expected one of {options}, got {show(value)}")


# -- container and union hooks ----------------------------------------------------------------------
def _origin(tp: Any) -> Any:
    return typing.get_origin(tp)


def _is_union(tp: Any) -> bool:
    return _origin(tp) in (typing.Union, types.UnionType)


def _is_literal(tp: Any) -> bool:
    return _origin(tp) is typing.Literal


def _is_list(tp: Any) -> bool:
    return tp is list or _origin(tp) in (list, abc.Sequence, abc.MutableSequence)


def _is_tuple(tp: Any) -> bool:
    return tp is tuple or _origin(tp) is tuple


def _is_set(tp: Any) -> bool:
    return tp in (set, frozenset) or _origin(tp) in (set, frozenset, abc.Set, abc.MutableSet)


def _is_mapping(tp: Any) -> bool:
    return tp is dict or _origin(tp) in (dict, abc.Mapping, abc.MutableMapping)


def _need_list(value: Any) -> None:
    if not isinstance(value, (list, tuple)):
        raise Invalid(f"expected a list, got {show(value)}")


def _list_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    inner = list_structure_factory(tp, conv)  # cattrs' own, with per-index errors

    def structure_list(value: Any, _: Any) -> list:
        _need_list(value)
        return inner(value, tp)

    return structure_list


def _set_factory(tp: Any, conv: cattrs.Converter) -> Callable:
    args = typing.get_args(tp)
    inner = list_structure_factory(list[args[0]] if args else list, conv)
    make = frozenset if frozenset in (tp, _origin(tp)) else set

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
        return _is_int(value)
    if tp is float:
        return _is_int(value) or isinstance(value, float)
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


# -- attrs classes ----------------------------------------------------------------------------------
def _validating(f: attrs.Attribute, hook: Callable) -> Callable:
    """Structure one field, then run its validators on the result, so that every field's problems are
    reported (attrs' ``__init__`` stops at the first)."""
    validator = f.validator

    def structure_field(value: Any, tp: Any) -> Any:
        out = hook(value, tp)
        if validator is not None:
            try:
                validator(None, f, out)
            except (ValueError, TypeError):
                raise
            except Exception:  # noqa: S110 - needs the instance: it runs again in __init__, reported there
                pass
        return out

    return structure_field


def _attrs_factory(cls: type, conv: cattrs.Converter) -> Callable:
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # a class whose annotations name something it cannot see
        raise Invalid(f"the field types of {cls.__qualname__} cannot be read ({type(exc).__name__}: {exc})") from None
    overrides = {}
    for f in attrs.fields(cls):
        if not f.init:
            continue
        if f.name.startswith("_"):
            overrides[f.name] = override(omit=True)
            continue
        tp = hints.get(f.name, f.type if f.type is not None else Any)
        source = _LENIENT if f.metadata.get("finite") is False and conv is CONVERTER else conv
        overrides[f.name] = override(struct_hook=_validating(f, source.get_structure_hook(tp)))
    inner = make_dict_structure_fn(cls, conv, **overrides)

    def structure_attrs(value: Any, _: Any) -> Any:
        if not isinstance(value, Mapping):
            raise Invalid(f"expected a mapping, got {show(value)}")
        return inner(value)

    return structure_attrs


# -- the pipeline's own shapes: StageSpec and InputSpec, with the wording users know ------------------
STAGE_KEYS = tuple(f.name for f in attrs.fields(StageSpec))
INPUT_FORM = "an input is a stage name or {stage: NAME, policy: POLICY}"
NEED_NAME = "stage needs a 'name' (a non-empty string)"
NEED_TYPE = "stage needs a 'type' (a registered stage type name)"


def _stage_name(value: Any, _: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(NEED_NAME)
    if not value.replace("_", "").replace("-", "").isalnum():
        raise Invalid(f"stage name {short(value)!r} may contain only letters, digits, '_' and '-'")
    if len(value) > limits.MAX_NAME_CHARS:
        raise Invalid(f"stage name {short(value, 30)!r} has {len(value)} characters; at most {limits.MAX_NAME_CHARS}")
    return value


def _stage_type(value: Any, _: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(NEED_TYPE)
    return value


def _stage_config(value: Any, _: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Invalid("'config' must be a mapping")
    return dict(value)


def _stage_int(key: str, optional: bool) -> Callable:
    def structure(value: Any, _: Any) -> int | None:
        if (value is None and optional) or _is_int(value):
            return value
        raise Invalid(f"'{key}' must be an integer, got {short(repr(value), 40)}")

    return structure


def _stage_devices(value: Any, _: Any) -> str | list[str] | list[list[str]]:
    """A device string, a flat list (one device per replica) or a list of lists (the devices of each
    replica, for stages that split a model); what the devices are is validation's business."""
    if isinstance(value, str):
        return value
    if not isinstance(value, (list, tuple)) or not value:
        raise Invalid("'devices' must be a device string or a non-empty list of them")
    if all(isinstance(d, str) for d in value):
        return list(value)
    if not all(isinstance(d, (list, tuple)) for d in value):
        if all(isinstance(d, (str, list, tuple)) for d in value):
            raise Invalid("'devices' mixes device strings and lists: write a flat list (one device per replica) "
                          "or a list of lists (the devices of each replica), e.g. [[cuda:0, cuda:1], [cuda:2, cuda:3]]")
        raise Invalid("'devices' must be a device string or a non-empty list of them")
    for j, group in enumerate(value):
        if not group or not all(isinstance(d, str) for d in group):
            raise Invalid(f"'devices' list {j} must be a non-empty list of device strings (lists nest one level)")
    return [list(g) for g in value]


def _stage_ordered(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid("'ordered' must be true or false")
    return value


def _input_stage(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise Invalid(INPUT_FORM)
    return value


def _input_policy(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise Invalid("input 'policy' must be a string")
    return value


def _input_spec_hook(conv: cattrs.Converter) -> Callable:
    inner = make_dict_structure_fn(
        InputSpec, conv, stage=override(struct_hook=_input_stage), policy=override(struct_hook=_input_policy)
    )

    def structure_input(value: Any, _: Any) -> InputSpec:
        if isinstance(value, str):
            return InputSpec(value)
        if isinstance(value, InputSpec):
            return value
        if not isinstance(value, Mapping):
            raise Invalid(INPUT_FORM)
        return inner(value)

    return structure_input


def _stage_spec_hook(conv: cattrs.Converter) -> Callable:
    inputs_hook = _list_factory(list[InputSpec], conv)

    def structure_inputs(value: Any, _: Any) -> list[InputSpec]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise Invalid("'inputs' must be a stage name or a list")
        return inputs_hook(value, list[InputSpec])

    inner = make_dict_structure_fn(
        StageSpec,
        conv,
        name=override(struct_hook=_stage_name),
        type=override(struct_hook=_stage_type),
        config=override(struct_hook=_stage_config),
        replicas=override(struct_hook=_stage_int("replicas", optional=False)),
        devices=override(struct_hook=_stage_devices),
        inputs=override(struct_hook=structure_inputs),
        capacity=override(struct_hook=_stage_int("capacity", optional=True)),
        ordered=override(struct_hook=_stage_ordered),
    )

    def structure_stage(value: Any, _: Any) -> StageSpec:
        if not isinstance(value, Mapping):
            raise Invalid("a stage must be a mapping")
        return inner(value)

    return structure_stage


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


# -- the converter ----------------------------------------------------------------------------------
def _build(*, finite: bool) -> cattrs.Converter:
    conv = cattrs.Converter(
        forbid_extra_keys=True, detailed_validation=True, structure_fallback_factory=_fallback_factory
    )
    conv.register_structure_hook(int, _structure_int)
    conv.register_structure_hook(float, _structure_float if finite else _structure_any_float)
    conv.register_structure_hook(bool, _structure_bool)
    conv.register_structure_hook(str, _structure_str)
    conv.register_structure_hook(Path, _structure_path)
    conv.register_structure_hook(NoneType, _structure_none)
    conv.register_structure_hook_func(_is_literal, _structure_literal)
    conv.register_structure_hook_factory(_is_list, _list_factory)
    conv.register_structure_hook_factory(_is_set, _set_factory)
    conv.register_structure_hook_factory(_is_tuple, _tuple_factory)
    conv.register_structure_hook_factory(_is_mapping, _mapping_factory)
    conv.register_structure_hook_factory(_is_union, _union_factory)
    conv.register_structure_hook_factory(attrs.has, _attrs_factory)
    conv.register_structure_hook(InputSpec, _input_spec_hook(conv))
    conv.register_structure_hook(StageSpec, _stage_spec_hook(conv))
    return conv


#: The strict converter.
CONVERTER = _build(finite=True)
#: The same rules but floats may be NaN or infinite: used only for the fields declared ``finite=False``.
_LENIENT = _build(finite=False)


# -- errors -> located problems -----------------------------------------------------------------------
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


def structure(
    cls: Any,
    data: Any,
    *,
    locate: Callable[[tuple], int | None] | None = None,
    file: str | None = None,
    stage: str | None = None,
    field_prefix: str = "",
    what: str = "config",
) -> tuple[Any, list[Problem]]:
    """Build ``cls`` from ``data`` with the strict converter: (the object, []) or (None, every problem).

    ``locate(path) -> line`` gives the line of a path relative to ``data``; ``field_prefix`` is put before
    each field name (``"runtime."``). ``what`` names the whole thing in messages ("config", "runtime").
    A missing mapping (``config:`` with nothing after it) is an empty one.
    """
    locate = locate or (lambda _path: None)
    if data is None and attrs.has(cls):
        data = {}
    if attrs.has(cls) and not isinstance(data, Mapping):
        line = locate(())
        return None, [Problem(f"{what} must be a mapping, got {type(data).__name__}", file=file, line=line, stage=stage, field=field_prefix.rstrip(".") or None)]
    try:
        return CONVERTER.structure(data, cls), []
    except Exception as exc:  # every error of the document, collected by cattrs
        return None, problems_of(exc, locate=locate, file=file, stage=stage, field_prefix=field_prefix, what=what)


def unstructure(obj: Any) -> Any:
    """Plain data of a structured object (the inverse of ``structure`` for the pipeline's shapes)."""
    return CONVERTER.unstructure(obj)
