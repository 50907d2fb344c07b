"""When the held-out walk (``model.heldout``) is measured while the drafter trains, and its knobs: torch-free,
so the DrafterStep includes them as YAML fields without importing torch (``core.fields.include``)."""

from __future__ import annotations

import time

import attrs

from dflash_flow.core.stage import cfg

__all__ = ["HeldoutKnobs", "HeldoutSchedule"]


@attrs.frozen(kw_only=True)
class HeldoutKnobs:
    """Acceptance over time (declared once here; DrafterStep's YAML fields, ``core.fields.include``). The walk
    draws no random numbers and leaves the weights as they were: ``result=False``."""

    heldout_data: str | None = cfg(
        None, result=False, doc="Acceptance over time: JSONL of held-out conversations whose last turn is the target's own greedy "
        "reply ('embedded': the embedded dataset's eval split; null: off). The teacher-forced walk on a fixed sample "
        "of them is measured during training and logged as heldout/tau (one target forward per conversation at "
        "setup, then drafter calls only).",
    )
    heldout_limit: int = cfg(8, ge=1, result=False, doc="Held-out conversations walked at each measurement (the first ones of heldout_data).")
    heldout_horizon: int = cfg(64, ge=1, result=False, doc="New tokens each held-out walk covers (real decoding's max_new_tokens).")
    heldout_every_steps: int | None = cfg(
        None, ge=1, result=False, doc="Measure the held-out walk every this many optimizer steps (also at the first and last step).",
    )
    heldout_every_s: float | None = cfg(
        60.0, gt=0, result=False, doc="... and whenever this many seconds passed since the last measurement (null: by steps only).",
    )


class HeldoutSchedule:
    """When the held-out walk is measured: at the first step, every ``heldout_every_steps`` steps or
    ``heldout_every_s`` seconds, and at the last step."""

    def __init__(self, knobs: HeldoutKnobs) -> None:
        self.knobs = knobs
        self.last: tuple[int, float] | None = None  # (step, perf_counter) of the last measurement

    def due(self, step: int, now: float, *, last: bool) -> bool:
        if self.last is None or last:
            return True
        prev_step, prev_t = self.last
        every_steps, every_s = self.knobs.heldout_every_steps, self.knobs.heldout_every_s
        return (every_steps is not None and step - prev_step >= every_steps) or (
            every_s is not None and now - prev_t >= every_s)

    def measured(self, step: int) -> None:
        self.last = (step, time.perf_counter())
