"""What a run has recorded so far (STUB: the metric-schema work replaces this file)."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.define(eq=False)
class RunRecord:
    """Filled by the Monitor (and the trainer's final report) while the pipeline runs; read by the
    application's end of run (summary files, plots, artifact uploads, the printed table)."""

    step: int = 0
    epoch: int | None = None
    history: dict[str, list[tuple[float, float]]] = attrs.field(factory=dict)
    train: dict[str, float] = attrs.field(factory=dict)
    evals: dict[str, dict[str, float]] = attrs.field(factory=dict)
    artifacts: dict[str, str] = attrs.field(factory=dict)
    bottleneck: Any = None
