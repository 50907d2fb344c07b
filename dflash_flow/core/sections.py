"""Application sections of a pipeline file (beside ``stages``): the registry both YAML loading and
``Graph`` use. A layer above the core registers its sections (``tracking:``, ``checkpoint:``) here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

_SECTIONS: dict[str, type] = {}
_RESULT_SECTIONS: set[str] = set()


def register_section(name: str, cls: type, *, affects_result: bool = False) -> None:
    """Make ``name:`` a valid top-level YAML key, structured into the attrs class ``cls``. ``affects_result``:
    its fields can change what a run trains (``model:``), so a resume must match them (per field,
    ``cfg(result=False)`` says otherwise); a section that only says where things go (``tracking:``) cannot."""
    _SECTIONS[name] = cls
    if affects_result:
        _RESULT_SECTIONS.add(name)
    else:
        _RESULT_SECTIONS.discard(name)


def result_sections() -> set[str]:
    """The registered sections whose fields can change a run's result."""
    return set(_RESULT_SECTIONS)


def registered_sections() -> dict[str, type]:
    return dict(_SECTIONS)


def section_to_dict(value: Any) -> Any:
    if attrs.has(type(value)):
        return {k: section_to_dict(v) for k, v in attrs.asdict(value, recurse=False).items()}
    if isinstance(value, (list, tuple)):
        return [section_to_dict(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value
