"""What identifies a run's result (what a resume must match), and stage configs as a run records them. A
stage's name, type, inputs, ``ordered`` and ``seed`` always count; devices, ``capacity`` and runtime options
never do; the rest is declared where the setting is (``cfg(result=False)``, ``Stage.affects_result``, ...)."""

from __future__ import annotations

import contextlib
import json
import typing
from typing import Any

import attrs

from .convert_types import field_default, short
from .graph import registered_sections, result_sections
from .redact import redact_value
from .registry import resolve
from .stage import to_plain


def moved_field_message(field: str, path: str) -> str:
    """One line for a pipeline that sets a field that moved into a section."""
    return (f"'{field}' moved to {path}, which declares it once for every stage: remove it from this stage and "
            f"set {path} (see the README's YAML reference)")


def _class_of(spec: Any) -> Any:
    """The stage class of ``spec``; None when its type does not resolve (validation reports it)."""
    try:
        return resolve(spec.type)
    except Exception:  # noqa: BLE001
        return None


def moved_fields_of(graph: Any) -> dict[str, dict[str, str]]:
    """``{stage name: {field: "section.key"}}`` for the stages whose type moved fields into a section."""
    return {spec.name: dict(cls.moved_fields) for spec in graph.stages
            if (cls := _class_of(spec)) is not None and cls.moved_fields}


def legacy_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config with its moved fields filled from their sections (for the hash of old checkpoints)."""
    moved = moved_fields_of(graph)
    out = {}
    for spec in graph.stages:
        filled = {}
        for field, path in moved.get(spec.name, {}).items():
            key, _, attr = path.partition(".")
            value = to_plain(getattr(graph.sections.get(key), attr, None)) if attr else None
            if value is not None:
                filled[field] = value
        out[spec.name] = {**filled, **spec.config}
    return out


def complete_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config with every default written out, as plain JSON: what the run records."""
    out = {}
    for spec in graph.stages:
        config = dict(spec.config)
        if (cls := _class_of(spec)) is None:  # its own values are all there is
            out[spec.name] = config
            continue
        full = {f.name: config[f.name] if f.name in config else field_default(f) for f in cls.config_fields()
                if f.name in config or f.default is not attrs.NOTHING}
        full.update({k: v for k, v in config.items() if k not in full})  # undeclared keys: validation's to refuse
        out[spec.name] = json.loads(json.dumps(full, default=str))
    return out


def run_length_keys(graph: Any) -> set[str]:
    """The keys of :func:`result_settings` a resume with ``--extend`` may change (``cfg(run_length=True)``)."""
    out = set()
    for spec in graph.stages:
        if (cls := _class_of(spec)) is not None and cls.affects_result:
            out.update(f"stages.{spec.name}.{f.name}" for f in cls.config_fields() if f.metadata.get("run_length"))
    return out


def result_settings(graph: Any) -> dict[str, Any]:
    """Every setting that can change what ``graph`` trains, keyed as ``--set`` names them, defaults filled in."""
    out: dict[str, Any] = {"seed": graph.seed}
    out.update(_section_settings(graph))
    for spec in graph.stages:
        key = f"stages.{spec.name}"
        config = dict(spec.config)
        cls = _class_of(spec)  # None: all of it counts
        if cls is not None and not cls.affects_result:
            continue  # an observer: adding, removing or changing it leaves the trained weights alone
        out[f"{key}.type"] = spec.type
        out[f"{key}.inputs"] = [i.stage if i.policy == "round_robin" else f"{i.stage} ({i.policy})" for i in spec.inputs]
        out[f"{key}.ordered"] = spec.ordered
        if cls is None:
            out[f"{key}.replicas"] = spec.replicas
            out[f"{key}.config"] = config
            continue
        if cls.replicas_affect_result:
            out[f"{key}.replicas"] = spec.replicas
        out.update({f"{key}.{f.name}": config[f.name] if f.name in config else field_default(f)
                    for f in cls.config_fields() if f.metadata.get("result", True) is not False})
        # A key the class does not declare (validation refuses it; here it still counts).
        for name in sorted(set(config) - {f.name for f in cls.config_fields()}):
            out[f"{key}.{name}"] = config[name]
    # As JSON holds it (what a checkpoint reads back), and with no credential (a server URL's) in it.
    return redact_value(json.loads(json.dumps(out, default=str, sort_keys=True)))


def _section_settings(graph: Any) -> dict[str, Any]:
    """``{"model.target": ..., "model.features.mode": ...}``: the result fields of the sections, defaults filled."""
    out: dict[str, Any] = {}
    known = registered_sections()
    for name in sorted(result_sections()):
        _fields_of(known.get(name), graph.sections.get(name), name, out)
    return out


def _fields_of(cls: Any, value: Any, prefix: str, out: dict[str, Any]) -> None:
    if cls is None or not attrs.has(cls):
        return
    with contextlib.suppress(Exception):  # string annotations -> types (unresolvable: recorded as plain values)
        attrs.resolve_types(cls)
    for f in attrs.fields(cls):
        if f.metadata.get("result", True) is False:
            continue
        v = getattr(value, f.name) if value is not None and hasattr(value, f.name) else field_default(f)
        if attrs.has(type(v)):
            _fields_of(type(v), v, f"{prefix}.{f.name}", out)
        elif v is not None or not _is_section_type(f.type):
            out[f"{prefix}.{f.name}"] = to_plain(v)


def _is_section_type(tp: Any) -> bool:
    """``X | None`` where X is an attrs class: a nested section (an unset one records no keys)."""
    args = typing.get_args(tp) if not isinstance(tp, str) else ()
    return any(isinstance(a, type) and attrs.has(a) for a in args)


def moved_setting_keys(graph: Any) -> dict[str, str]:
    """``{"stages.drafter.target": "model.target", ...}``: for reading checkpoints written before a move."""
    return {f"stages.{stage}.{field}": path for stage, moved in moved_fields_of(graph).items()
            for field, path in moved.items()}


def recorded_as_today(recorded: dict[str, Any], moved: dict[str, str], current: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded settings in today's keys: a stage field since moved into a section reads as that
    key, from the first stage that recorded a value ("" is unset); one whose key is no result setting is dropped."""
    out = dict(recorded)
    found: dict[str, Any] = {}
    for key, path in moved.items():
        if key not in out:
            continue
        value = out.pop(key)
        if path not in found or (found[path] in (None, "") and value not in (None, "")):
            found[path] = value
    for path, value in found.items():
        if path in current and path not in out:
            out[path] = None if value == "" else value
    return out


_ABSENT = object()


def _show(value: Any) -> str:
    return short(json.dumps(value, sort_keys=True), 80)


def settings_differences(recorded: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """One phrase per setting that differs: ``stages.drafter.lr: 0.0006 in the checkpoint, 0.001 now``."""
    out = []
    for key in sorted(set(recorded) | set(current), key=lambda k: (k != "seed", k)):
        old, new = recorded.get(key, _ABSENT), current.get(key, _ABSENT)
        if old == new:
            continue
        if old is _ABSENT:
            out.append(f"{key}: not in the checkpoint, {_show(new)} now")
        elif new is _ABSENT:
            out.append(f"{key}: {_show(old)} in the checkpoint, not in this pipeline")
        else:
            out.append(f"{key}: {_show(old)} in the checkpoint, {_show(new)} now")
    return out
