"""What identifies a run's result (what a resume must match), and stage configs as a run records them.

The rule is declared where the setting is: ``cfg(result=False)``, ``cfg(run_length=True)`` (``--extend`` may
change it), ``Stage.affects_result`` / ``replicas_affect_result``. A stage's name, type, inputs and ``ordered``
always count, and so does ``seed``; devices, ``capacity`` and runtime options never do; of the sections only
those registered ``affects_result``. Also: fields that moved from the stages into a section (``moved_fields``).
"""

from __future__ import annotations

import json
import typing
from typing import Any

import attrs

from .convert_types import short
from .graph import registered_sections, result_sections, section_to_dict
from .redact import redact_value
from .registry import resolve


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


def section_value(graph: Any, path: str) -> Any:
    """The value of ``section.key`` in ``graph`` as plain data (None when the section or key is absent)."""
    key, _, attr = path.partition(".")
    section = graph.sections.get(key)
    return section_to_dict(getattr(section, attr, None)) if section is not None and attr else None


def legacy_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config as releases before the move gave it (moved fields filled from their sections): only
    for the hash of checkpoints that predate recorded settings (``app.prepare.legacy_config_hash``)."""
    moved = moved_fields_of(graph)
    out = {}
    for spec in graph.stages:
        filled = {field: section_value(graph, path) for field, path in moved.get(spec.name, {}).items()}
        out[spec.name] = {**{k: v for k, v in filled.items() if v is not None}, **spec.config}
    return out


def field_default(f: attrs.Attribute) -> Any:
    """A config field's default value (None for a required field or a default computed from the instance)."""
    if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
        return f.default.factory() if not f.default.takes_self else None
    return None if f.default is attrs.NOTHING else f.default


def complete_stage_configs(graph: Any) -> dict[str, dict[str, Any]]:
    """Every stage's config with every default written out (a required field left out stays out), as plain JSON:
    what the run records (MLflow params, ``pipeline.resolved.yaml``), so runs compare field by field."""
    out = {}
    for spec in graph.stages:
        config = dict(spec.config)
        if (cls := _class_of(spec)) is None:  # its own values are all there is
            out[spec.name] = config
            continue
        full = {}
        for f in cls.config_fields():
            if f.name in config:
                full[f.name] = config[f.name]
            elif f.default is not attrs.NOTHING:
                full[f.name] = field_default(f)
        full.update({k: v for k, v in config.items() if k not in full})  # undeclared keys: validation's to refuse
        out[spec.name] = json.loads(json.dumps(full, default=str))
    return out


def run_length_keys(graph: Any) -> set[str]:
    """The keys of :func:`result_settings` that only set how long the run trains (``cfg(run_length=True)``):
    what a resume that extends the run may change."""
    out = set()
    for spec in graph.stages:
        if (cls := _class_of(spec)) is not None and cls.affects_result:
            out.update(f"stages.{spec.name}.{f.name}" for f in cls.config_fields() if f.metadata.get("run_length"))
    return out


def _canonical(value: Any) -> Any:
    """The value as JSON holds it (tuples become lists, paths strings): what a checkpoint reads back."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def result_settings(graph: Any) -> dict[str, Any]:
    """``{"seed": 7, "stages.drafter.type": "DrafterStep", "stages.drafter.lr": 0.003, ...}``: every setting that
    can change what ``graph`` trains, keyed as ``--set`` names them, defaults filled in, JSON-plain."""
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
        for f in cls.config_fields():
            if f.metadata.get("result", True) is False:
                continue
            out[f"{key}.{f.name}"] = config[f.name] if f.name in config else field_default(f)
        # A key the class does not declare (validation refuses it; here it still counts).
        for name in sorted(set(config) - {f.name for f in cls.config_fields()}):
            out[f"{key}.{name}"] = config[name]
    return redact_value(_canonical(out))  # checkpoints write them down: no credential (a server URL's) in them


def _section_settings(graph: Any) -> dict[str, Any]:
    """``{"model.target": ..., "model.features.mode": ...}``: the fields of the sections that can change the
    result, defaults filled, a nested section field by field (an unset nested section: no keys)."""
    out: dict[str, Any] = {}
    known = registered_sections()
    for name in sorted(result_sections()):
        _fields_of(known.get(name), graph.sections.get(name), name, out)
    return out


def _fields_of(cls: Any, value: Any, prefix: str, out: dict[str, Any]) -> None:
    if cls is None or not attrs.has(cls):
        return
    try:
        attrs.resolve_types(cls)  # string annotations (``from __future__ import annotations``) -> types
    except Exception:  # noqa: BLE001 - unresolvable: the field is then recorded as a plain value
        pass
    for f in attrs.fields(cls):
        if f.metadata.get("result", True) is False:
            continue
        v = getattr(value, f.name) if value is not None and hasattr(value, f.name) else field_default(f)
        if attrs.has(type(v)):
            _fields_of(type(v), v, f"{prefix}.{f.name}", out)
        elif v is not None or not _is_section_type(f.type):
            out[f"{prefix}.{f.name}"] = section_to_dict(v)


def _is_section_type(tp: Any) -> bool:
    """``X | None`` where X is an attrs class: a nested section (an unset one records no keys)."""
    args = typing.get_args(tp) if not isinstance(tp, str) else ()
    return any(isinstance(a, type) and attrs.has(a) for a in args)


def moved_setting_keys(graph: Any) -> dict[str, str]:
    """``{"stages.drafter.target": "model.target", ...}``: for reading checkpoints written before a move."""
    return {f"stages.{stage}.{field}": path for stage, moved in moved_fields_of(graph).items()
            for field, path in moved.items()}


def recorded_as_today(recorded: dict[str, Any], moved: dict[str, str], current: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded settings in today's keys: a stage field that has since moved into a section
    (``moved``: ``stages.drafter.target`` -> ``model.target``) reads as that section key, from the first stage
    that recorded a value ("" counts as unset); one whose new key is not a result setting is dropped."""
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
