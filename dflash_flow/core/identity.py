"""What identifies a run's result: the settings that can change the trained weights or the data order.

A resume must continue the same computation, so it is refused when one of these differs; everything
else (thread counts, queue capacities, devices, how often a monitor samples, evaluation settings) may
change between a run and its resume. The rule is declared where the setting is, never listed here:

* a config field: ``cfg(..., result=False)`` when its value cannot change the result (default: it can);
* a stage: ``Stage.affects_result = False`` when nothing in its spec can (a monitor, an evaluation of
  the trained drafter); ``Stage.replicas_affect_result = False`` when its replica count cannot;
* ``cfg(..., run_length=True)`` marks a field that only sets how long the run trains (``--extend``);
* a stage's name, type, inputs (with their fan-out policy) and ``ordered`` always count, and so does the
  graph's ``seed``; devices, ``capacity`` and the runtime options never do; of the application sections only
  those registered with ``affects_result`` count (``model:``, keyed ``model.target``), field by field.

:func:`result_settings` returns them flat, keyed the way ``--set`` names them (``stages.drafter.lr``), with
every default filled in, so two pipelines that differ only in writing a default out compare equal and a
refused resume can name each field that differs, with both values (:func:`settings_differences`).
"""

from __future__ import annotations

import json
from typing import Any

from .fill import field_default, moved_fields_of
from .redact import redact_value
from .registry import resolve


def run_length_keys(graph: Any) -> set[str]:
    """The keys of :func:`result_settings` that only set how long the run trains (``cfg(run_length=True)``:
    epochs, a batch budget, a schedule length): what a resume that extends the run may change."""
    out = set()
    for spec in graph.stages:
        try:
            cls = resolve(spec.type)
        except Exception:  # noqa: BLE001 - validation reports it
            continue
        if cls.affects_result:
            out.update(f"stages.{spec.name}.{f.name}" for f in cls.config_fields() if f.metadata.get("run_length"))
    return out


def _canonical(value: Any) -> Any:
    """The value as JSON holds it (tuples become lists, paths strings): what a checkpoint reads back."""
    return json.loads(json.dumps(value, default=str, sort_keys=True))


def result_settings(graph: Any) -> dict[str, Any]:
    """``{"seed": 7, "stages.drafter.type": "DrafterStep", "stages.drafter.lr": 0.003, ...}``: every
    setting of ``graph`` that can change what it trains (see the module doc), JSON-plain."""
    out: dict[str, Any] = {"seed": graph.seed}
    out.update(_section_settings(graph))
    for spec in graph.stages:
        key = f"stages.{spec.name}"
        config = dict(spec.config)
        try:
            cls = resolve(spec.type)
        except Exception:  # noqa: BLE001 - a type that does not resolve (validation reports it): all of it counts
            cls = None
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
        known = {f.name for f in cls.config_fields()}
        for name in sorted(set(config) - known):
            out[f"{key}.{name}"] = config[name]
    return redact_value(_canonical(out))  # checkpoints write them down: no credential (a server URL's) in them


def _section_settings(graph: Any) -> dict[str, Any]:
    """``{"model.target": ..., "model.features.mode": ...}``: the fields of the sections that can change the
    result, defaults filled, a nested section field by field (an unset nested section: no keys)."""
    from .sections import registered_sections, result_sections

    out: dict[str, Any] = {}
    known = registered_sections()
    for name in sorted(result_sections()):
        _fields_of(known.get(name), graph.sections.get(name), name, out)
    return out


def _fields_of(cls: Any, value: Any, prefix: str, out: dict[str, Any]) -> None:
    import attrs

    from .sections import section_to_dict

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
    import typing

    import attrs

    args = typing.get_args(tp) if not isinstance(tp, str) else ()
    return any(isinstance(a, type) and attrs.has(a) for a in args)


def moved_setting_keys(graph: Any) -> dict[str, str]:
    """``{"stages.drafter.target": "model.target", ...}``: the setting keys of stage fields that moved into a
    section (``Stage.moved_fields``), for reading checkpoints written before the move."""
    return {f"stages.{stage}.{field}": path for stage, moved in moved_fields_of(graph).items()
            for field, path in moved.items()}


def recorded_as_today(recorded: dict[str, Any], moved: dict[str, str], current: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's recorded settings in today's keys: a stage field that has since moved into a section
    (``moved``, from :func:`moved_setting_keys`: ``stages.drafter.target`` -> ``model.target``) reads as that
    section key, taken from the first stage that recorded a value ("" counts as unset); a moved field whose new
    key is not a result setting is dropped. Settings recorded after the move pass unchanged."""
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
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


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
