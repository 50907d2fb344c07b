"""One versioned state: a plain dict carrying a ``version`` field, written and checked in one place.

The trainer, the optimizer, the learning-rate schedule, the gradient accumulator and the epoch plan each
declare one :class:`StateVersion` (what the state is, the version written, the older ones still read);
a state of another version, or no mapping at all, raises :class:`~dflash_flow.core.errors.StateVersionError`
(a ``ValueError``) naming what it is and both versions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from dflash_flow.core.errors import StateVersionError


@attrs.frozen
class StateVersion:
    """``what``: the state's name in messages ("optimizer state"); ``version``: the one written; ``older``:
    earlier versions that still load (the loader converts them)."""

    what: str
    version: int
    older: tuple[int, ...] = ()

    @property
    def readable(self) -> tuple[int, ...]:
        return (*self.older, self.version)

    def tag(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """``{"version": version, **body}``."""
        return {"version": self.version, **body}

    def problem(self, state: Any) -> str | None:
        """What keeps ``state`` from loading (None: it is a mapping of a version this code reads)."""
        if not isinstance(state, Mapping):
            return f"{self.what} must be a mapping, got {type(state).__name__}"
        found = state.get("version")
        if found in self.readable and not isinstance(found, bool):
            return None
        reads = " or ".join(map(str, self.readable))
        return f"{self.what} version {found!r:.40} is not supported (this version reads {reads})"

    def check(self, state: Any) -> int:
        """The version of ``state``; :class:`StateVersionError` when it cannot load (:meth:`problem`)."""
        problem = self.problem(state)
        if problem is not None:
            raise StateVersionError(f"{problem}; resume with the dflash-flow version that wrote the checkpoint, "
                                    "or start afresh")
        return int(state["version"])
