"""``compile: auto``: torch.compile the training step (CPU only) when the run's planned steps repay the compiling.

Decided once per run and rank, by measurement: the first ``WARMUP`` eager steps are timed, and it compiles when
the saving over the micro-batches left exceeds ``MARGIN`` times the compiling (per shape, stretched by wall /
CPU time when other work holds the cores). Cost and saving come from this machine's record (``RECORD`` in the
cache directory, written by the last run that compiled), else the defaults below. A compiled run times its
next ``CALIBRATE`` steps, records them, and goes back to eager when it turned out slower.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from dflash_flow.util import atomic_path, cache_root

__all__ = ["AUTO", "CompilePlan", "Estimate", "plan_steps"]

AUTO = "auto"
MIN_MICRO_BATCHES = 300  # below: never compile, measure nothing (a test, the README's 50-batch run)
WARMUP = 8  # eager steps timed before deciding (after the first, which warms up)
CALIBRATE = 24  # compiled steps timed after the switch (the record for the next run)
MARGIN = 1.5  # the saving must exceed the compiling by this factor (the estimates are rough)
DEFAULT_COMPILE_S = 40.0  # per compiled shape, inductor cache cold: 12-57 s on the 2-core boxes
# Share of a step compiling saves, by drafter class: DFlash's layers compile before and after their attention
# (10-19% measured); other variants (DFlash 2's layers run eager) compile only the context and the loss head.
DEFAULT_SAVING = {"DFlashDrafter": 0.12}
OTHER_SAVING = 0.03
RECORD = "compile_plan.json"

log = logging.getLogger("dflash_flow")


class Estimate:
    """What compiling costs (seconds per compiled shape) and saves (share of a step), and where from."""

    def __init__(self, compile_s: float, saving: float, source: str) -> None:
        self.compile_s, self.saving, self.source = float(compile_s), float(saving), source


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


class CompilePlan:
    """One run's ``compile: auto`` decision for one drafter; ``tick`` at the start of every training step."""

    def __init__(self, drafter: Any, *, record: str | Path | None = None, clock=time.perf_counter,
                 cpu_clock=time.process_time) -> None:
        self.drafter = drafter
        self.record = Path(record) if record is not None else cache_root() / RECORD
        self.clock, self.cpu_clock = clock, cpu_clock
        self.steps_left: int | None = None  # micro-batches the run plans from here (plan_steps)
        self.state = "waiting"  # -> "eager" (decided off) | "calibrating" -> "compiled" | "reverted"
        self.message: str | None = None  # what was said at the decision
        self._last: float | None = None
        self._last_cpu = 0.0
        self._gaps: list[float] = []
        self._cpu_gaps: list[float] = []
        self._shapes: set[tuple[int, ...]] = set()
        self._eager_s: float | None = None
        self._compiles = 1

    def planned(self, micro_batches_left: int) -> None:
        if self.steps_left is None:
            self.steps_left = max(0, int(micro_batches_left))

    def tick(self, shape: tuple[int, ...]) -> None:
        """A training step starts (with a batch of ``shape``)."""
        if self.state in ("eager", "compiled", "reverted"):
            return
        now, cpu = self.clock(), self.cpu_clock()
        gap = None if self._last is None else now - self._last
        cpu_gap = cpu - self._last_cpu
        self._last, self._last_cpu = now, cpu
        if self.state == "calibrating":
            self._gaps.append(gap)
            if len(self._gaps) >= CALIBRATE:
                self._calibrated()
            return
        self._shapes.add(tuple(shape))
        if self.steps_left is None:
            return  # no plan yet: nothing to weigh the compiling against
        if self.drafter.device.type != "cpu":
            self._decide_off(f"compile: auto compiles on CPU only (this drafter is on {self.drafter.device.type}); "
                             "set compile: true to compile here")
            return
        if self.steps_left < MIN_MICRO_BATCHES:
            self._decide_off(None)  # a test or a short run: silent, nothing measured
            return
        if gap is not None:
            self._gaps.append(gap)
            self._cpu_gaps.append(cpu_gap)
        if len(self._gaps) > WARMUP:  # the first gap holds the first step's warm-up
            step_s = statistics.median(self._gaps[1:])
            # Steps that took longer than the CPU they got waited for a core: compiling would wait as much.
            slowdown = max(1.0, step_s / max(statistics.median(self._cpu_gaps[1:]), 1e-9))
            self._decide(step_s, slowdown)

    def estimate(self) -> Estimate:
        saving = DEFAULT_SAVING.get(type(self.drafter).__name__, OTHER_SAVING)
        found = self._records().get(self.key())
        if found:
            return Estimate(found["compile_s"], found["saving"], f"measured here {found.get('measured', '')}".strip())
        return Estimate(DEFAULT_COMPILE_S, saving, "defaults: no run has compiled on this machine yet")

    def key(self) -> str:
        d = self.drafter
        size = f"H{d.config.hidden_size}xL{len(d.layers)}"
        return (f"torch {torch.__version__} | {d.device.type} | {_cpu_model()} | threads {torch.get_num_threads()} | "
                f"{type(d).__name__} {size}")

    def _decide(self, step_s: float, slowdown: float = 1.0) -> None:
        est = self.estimate()
        left = max(0, self.steps_left - len(self._gaps))  # this step (the next tick) on, compiled if so
        self._compiles = 1 if len(self._shapes) == 1 else 2
        cost = est.compile_s * self._compiles * slowdown
        saves = est.saving * step_s * left
        busy = f", x{slowdown:.1f}: steps wait for a core" if slowdown >= 1.05 else ""
        figures = (f"~{cost:.0f} s, saves ~{saves:.0f} s over {left} steps ({step_s * 1e3:.0f} ms each eager, "
                   f"{est.saving:.0%} saved, {self._compiles} shape{'s' if self._compiles > 1 else ''} compiled{busy}; "
                   f"{est.source})")
        if saves > MARGIN * cost:
            self._eager_s = step_s
            self.state, self._gaps = "calibrating", []
            self.message = f"compile: auto: compiling: {figures}"
            log.info("%s", self.message)
            self.drafter._set_compiled(True)
        else:
            self._decide_off(f"compile: auto: not compiling: {figures}")

    def _decide_off(self, message: str | None) -> None:
        self.state, self.message, self._gaps = "eager", message, []
        if message:
            log.info("%s", message)

    def _calibrated(self) -> None:
        gaps = self._gaps
        eager = self._eager_s
        steady = statistics.median(gaps[self._compiles :] or gaps)  # the first steps compile
        slow = [g for g in gaps if g > max(2 * eager, steady + 1.0)]
        compile_s = max(1.0, sum(g - steady for g in slow) / len(slow)) if slow else 1.0
        saving = max(-1.0, min(0.9, 1.0 - steady / eager))
        self.state = "compiled"
        line = (f"compile: auto: compiling took ~{compile_s:.0f} s per shape ({len(slow)} compiled); steps "
                f"{eager * 1e3:.0f} -> {steady * 1e3:.0f} ms ({saving:.0%} saved)")
        if saving <= 0:
            self.state = "reverted"
            self.drafter._set_compiled(False)
            line += ": slower compiled, back to eager for the rest of the run"
        log.info("%s", line)
        self.message = line
        records = self._records()
        records[self.key()] = dict(compile_s=round(compile_s, 2), saving=round(saving, 4), eager_ms=round(eager * 1e3, 2),
                                   compiled_ms=round(steady * 1e3, 2), measured=time.strftime("%Y-%m-%d"))
        try:
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with atomic_path(self.record, durable=False) as tmp:
                tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
        except OSError as exc:  # a read-only cache costs the next run its measurement, nothing else
            log.info("compile: auto: could not record the measurement in %s: %s", self.record, exc)

    def _records(self) -> dict:
        try:
            data = json.loads(self.record.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


def plan_steps(drafter: Any, micro_batches_left: int) -> None:
    """The trainer's hook: the run plans ``micro_batches_left`` more micro-batches (unless ``compile: auto``, a no-op)."""
    plan = getattr(drafter, "compile_plan", None)
    if plan is not None:
        plan.planned(micro_batches_left)
