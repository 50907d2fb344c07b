"""The one strict converter (cattrs): attrs classes, StageSpec/InputSpec, structure(); hooks in convert_types.

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

import typing
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import cattrs
from cattrs.gen import make_dict_structure_fn, override

from . import limits
from .convert_errors import INPUT_FORM, NEED_NAME, NEED_TYPE, STAGE_KEYS, error_message, problems_of
from .convert_types import base_converter, is_int, list_factory
from .errors import Problem
from .graph import InputSpec, StageSpec
from .wording import Invalid, NoneType, config_fields, describe_type, field_types, short, show

# The converter's names keep this module as their documented home; each is defined in the module named above.
__all__ = [
    "CONVERTER",
    "INPUT_FORM",
    "NEED_NAME",
    "NEED_TYPE",
    "STAGE_KEYS",
    "Invalid",
    "NoneType",
    "config_fields",
    "describe_type",
    "error_message",
    "field_types",
    "problems_of",
    "short",
    "show",
    "structure",
    "unstructure",
]


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
        if (value is None and optional) or is_int(value):
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
    inputs_hook = list_factory(list[InputSpec], conv)

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
