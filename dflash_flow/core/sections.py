"""Application sections of a pipeline file (beside ``stages``): the registry both YAML loading and
``Graph`` use. A layer above the core registers its sections (``tracking:``, ``checkpoint:``) here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

_SECTIONS: dict[str, type] = {}


def register_section(name: str, cls: type) -> None:
    """Make ``name:`` a valid top-level YAML key, structured into the attrs class ``cls``."""
    _SECTIONS[name] = cls


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
