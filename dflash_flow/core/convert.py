"""The one strict converter (cattrs): no unknown keys, no coercion (an int *is* a float), NaN and infinity
refused unless ``cfg(finite=False)``, every validator run; ``problems_of`` locates each error at file:line."""

from __future__ import annotations

import difflib
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.errors import (
    AttributeValidationNote,
    BaseValidationError,
    ClassValidationError,
    ForbiddenExtraKeysError,
    IterableValidationNote,
)
from cattrs.gen import make_dict_structure_fn, override

from . import limits
from .convert_types import Invalid, base_converter, config_fields, exact, is_int, list_factory, short, show
from .errors import Problem
from .graph import InputSpec, StageSpec

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
    hint = (f"; did you mean '{close[0]}'?" if close else f"; known fields: {', '.join(names)}" if names
            else "; this stage takes no config")
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
    """(path of ``("attr", name)`` / ``("item", index or key)``, leaf error, class, raised by the class itself)."""
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


def problems_of(exc: BaseException, *, locate: Callable[[tuple], int | None], file: str | None, stage: str | None,
                field_prefix: str, what: str) -> list[Problem]:
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


# -- attrs classes ----------------------------------------------------------------------------------
def _validating(f: attrs.Attribute, hook: Callable) -> Callable:
    """Structure one field, then run its validators, so that every field's problems are reported."""
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
def _stage_name(value: Any, _: Any) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(NEED_NAME)
    if not value.replace("_", "").replace("-", "").isalnum():
        raise Invalid(f"stage name {short(value)!r} may contain only letters, digits, '_' and '-'")
    if len(value) > limits.MAX_NAME_CHARS:
        raise Invalid(f"stage name {short(value, 30)!r} has {len(value)} characters; at most {limits.MAX_NAME_CHARS}")
    return value


def _stage_config(value: Any, _: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise Invalid("'config' must be a mapping")
    return dict(value)


def _stage_int(key: str, optional: bool) -> Callable:
    def structure(value: Any, _: Any) -> int | None:
        if (value is None and optional) or is_int(value):
            return value
        raise Invalid(f"'{key}' must be an integer, got {short(repr(value), 40)}")

    return structure


def _stage_devices(value: Any, _: Any) -> str | list[str] | list[list[str]]:
    """A device string, a flat list (one per replica) or a list of lists (each replica's); checked in validation."""
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


def _input_spec_hook(conv: cattrs.Converter) -> Callable:
    inner = make_dict_structure_fn(
        InputSpec, conv, stage=override(struct_hook=exact(lambda v: isinstance(v, str), message=INPUT_FORM)),
        policy=override(struct_hook=exact(lambda v: isinstance(v, str), message="input 'policy' must be a string")))

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
    inputs_hook = list_factory(list[InputSpec], conv)

    def structure_inputs(value: Any, _: Any) -> list[InputSpec]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise Invalid("'inputs' must be a stage name or a list")
        return inputs_hook(value, list[InputSpec])

    inner = make_dict_structure_fn(
        StageSpec, conv, name=override(struct_hook=_stage_name),
        type=override(struct_hook=exact(lambda v: isinstance(v, str) and v != "", message=NEED_TYPE)),
        config=override(struct_hook=_stage_config),
        replicas=override(struct_hook=_stage_int("replicas", optional=False)),
        devices=override(struct_hook=_stage_devices), inputs=override(struct_hook=structure_inputs),
        capacity=override(struct_hook=_stage_int("capacity", optional=True)),
        ordered=override(struct_hook=exact(lambda v: isinstance(v, bool), message="'ordered' must be true or false")))

    def structure_stage(value: Any, _: Any) -> StageSpec:
        if not isinstance(value, Mapping):
            raise Invalid("a stage must be a mapping")
        return inner(value)

    return structure_stage


# -- the converter ----------------------------------------------------------------------------------
def _build(*, finite: bool) -> cattrs.Converter:
    conv = base_converter(finite=finite)
    conv.register_structure_hook_factory(attrs.has, _attrs_factory)
    conv.register_structure_hook(InputSpec, _input_spec_hook(conv))
    conv.register_structure_hook(StageSpec, _stage_spec_hook(conv))
    return conv


#: The strict converter.
CONVERTER = _build(finite=True)
#: The same rules but floats may be NaN or infinite: used only for the fields declared ``finite=False``.
_LENIENT = _build(finite=False)


def structure(cls: Any, data: Any, *, locate: Callable[[tuple], int | None] | None = None, file: str | None = None,
              stage: str | None = None, field_prefix: str = "", what: str = "config") -> tuple[Any, list[Problem]]:
    """(``cls`` built from ``data``, []) or (None, every problem, located by ``locate(path) -> line``)."""
    locate = locate or (lambda _path: None)
    if data is None and attrs.has(cls):
        data = {}
    if attrs.has(cls) and not isinstance(data, Mapping):
        return None, [Problem(f"{what} must be a mapping, got {type(data).__name__}", file=file, line=locate(()),
                              stage=stage, field=field_prefix.rstrip(".") or None)]
    try:
        return CONVERTER.structure(data, cls), []
    except Exception as exc:  # every error of the document, collected by cattrs
        return None, problems_of(exc, locate=locate, file=file, stage=stage, field_prefix=field_prefix, what=what)
