"""A user-defined stage. Register it in-process with @register_stage, or for YAML use from any
program, through the entry-point group `dflash_flow.stages` (see pyproject.toml beside this file)."""

from __future__ import annotations

import attrs

from dflash_flow.core import Stage, cfg, register_stage


@register_stage
@attrs.define(kw_only=True, eq=False)
class Scale(Stage):
    """Multiplies every number by `factor` and counts what it saw."""

    input_type = int
    output_type = int

    factor: int = cfg(2, ge=1, doc="Multiplier.")

    def setup(self, ctx) -> None:
        self._seen = ctx.metrics.counter("seen", "items", "Numbers scaled")

    def process(self, item: int):
        self._seen.inc()
        return (item * self.factor,)
