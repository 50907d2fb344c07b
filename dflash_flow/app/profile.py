"""``dflash-flow profile``: run the pipeline, poll the runtime's sampler every ``interval_s`` and measure one
*window*, from the poll where the trainer has taken ``warmup`` steps and every replica is past its setup to the
poll where it has taken ``steps`` more, cut into ``windows`` equal parts; then cancel the pipeline."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from dflash_flow.app.profile_data import (  # noqa: F401 - also imported from here by splitplan and the tests
    ACTIVE,
    DEFAULT_INTERVAL_S,
    DEFAULT_WINDOWS,
    MAX_SERIES_POINTS,
    READABLE_VERSIONS,
    Profile,
    ProfileError,
    QueueSeries,
    StageProfile,
    Window,
    batch_means,
    build_profile,
    find_step_stage,
    grad_accum_of,
)
from dflash_flow.core.snapshot import RuntimeSnapshot
from dflash_flow.core.validate import Validated

if TYPE_CHECKING:
    from dflash_flow.services import RunServices


class _Sampler:
    """Polls the runtime's sampler every ``interval_s``, opens and closes the window, then cancels the pipeline."""

    def __init__(self, pipeline: Any, step_stage: str, start_at: int, end_at: int, interval_s: float,
                 windows: int = 1, precision: float | None = None, max_batches: int | None = None):
        self.pipeline = pipeline
        # With a precision: the window grows a part at a time until the rate is known that well, or max_batches.
        self.precision, self.max_batches = precision, max_batches
        self.part = 0
        self.reached: float | None = None  # the relative half-width when the window closed
        self.windows = max(1, min(int(windows), end_at - start_at))
        self.cut_at: list[int] = []  # trainer batches at which the parts after the first open
        self.cuts: list[RuntimeSnapshot] = []
        self._next_cut = 0
        self.step_stage, self.start_at, self.end_at, self.interval_s = step_stage, start_at, end_at, interval_s
        self.start: RuntimeSnapshot | None = None
        self.end: RuntimeSnapshot | None = None
        self.t0: float | None = None
        self.times: list[float] = []
        self.series: dict[tuple[str, int], list[int]] = {}
        self.window_depths: dict[str, dict[int, list[int]]] = {}
        self.cancelled = False
        self._subscription: Any = None

    def __enter__(self) -> _Sampler:
        self._subscription = self.pipeline.sampler.subscribe(self._tick, self.interval_s, owner="profile")
        return self

    def __exit__(self, *exc: object) -> None:
        self.pipeline.sampler.unsubscribe(self._subscription)

    def _taken(self, snap: RuntimeSnapshot) -> int:
        return sum(r.items_in for r in snap.stages[self.step_stage].replicas)

    def _tick(self, snap: RuntimeSnapshot) -> None:
        if not snap.elapsed_s or self.end is not None:
            return  # not started yet, or the window is closed
        self.observe(snap)
        if self.end is not None:
            self.cancelled = True
            self.pipeline.cancel(f"profile: {self.end_at - self.start_at} batches measured")

    def observe(self, snap: RuntimeSnapshot) -> None:
        """One poll: the queue depths, and the window's start or end when this poll reaches it."""
        if self.t0 is None:
            self.t0 = snap.time - snap.elapsed_s
        self.times.append(snap.time - self.t0)
        inside = self.start is not None
        for name, st in snap.stages.items():
            for r in (r for r in st.replicas if r.channel is not None):
                self.series.setdefault((name, r.replica), []).append(r.channel.depth)
                if inside:
                    self.window_depths.setdefault(name, {}).setdefault(r.replica, []).append(r.channel.depth)
        taken = self._taken(snap)
        if self.start is None:
            ready = all(r.state in ACTIVE for st in snap.stages.values() for r in st.replicas)
            if taken >= self.start_at and ready:
                self.start = snap
                # The asked-for steps from where it really opened (a poll can land past start_at).
                n = self.end_at - self.start_at
                self.end_at = taken + n
                self.cut_at = [taken + round(j * n / self.windows) for j in range(1, self.windows)]
                self.part = max(1, round(n / self.windows))
        elif taken >= self.end_at:
            if self._extend(snap, taken):
                return
            self.end = snap
        elif self._next_cut < len(self.cut_at) and taken >= self.cut_at[self._next_cut]:
            self.cuts.append(snap)  # one cut even when a poll passes several (slow polls: fewer parts)
            while self._next_cut < len(self.cut_at) and taken >= self.cut_at[self._next_cut]:
                self._next_cut += 1

    def _extend(self, snap: RuntimeSnapshot, taken: int) -> bool:
        """With a precision asked: whether the window goes on (this poll becomes a cut) because the 90%
        interval of the parts' batches/s is still wider than asked and the window may still grow."""
        if self.precision is None or self.start is None:
            return False
        snaps = [self.start, *self.cuts, snap]
        rates = [(self._taken(b) - self._taken(a)) / max(b.time - a.time, 1e-9)
                 for a, b in zip(snaps, snaps[1:], strict=False)]
        whole = (taken - self._taken(self.start)) / max(snap.time - self.start.time, 1e-9)
        iv = batch_means(whole, rates)
        self.reached = iv.half_width / whole if iv is not None and whole > 0 else None
        opened = self._taken(self.start)
        room = self.max_batches is None or taken - opened < self.max_batches
        if self.reached is not None and self.reached <= self.precision or not room:
            return False
        self.cuts.append(snap)
        self.end_at = taken + self.part if self.max_batches is None else min(taken + self.part, opened + self.max_batches)
        return True

    def queue_series(self) -> QueueSeries:
        stride = max(1, math.ceil(len(self.times) / MAX_SERIES_POINTS))
        depth = {f"{name}[{rep}]": values[::stride] for (name, rep), values in self.series.items()}
        window = (
            (self.start.time - self.t0, (self.end or self.start).time - self.t0)
            if self.start is not None and self.t0 is not None else (0.0, 0.0)
        )
        return QueueSeries(t=[round(t, 3) for t in self.times[::stride]], depth=depth, window=window)


def profile(v: Validated, steps: int, *, warmup_steps: int = 1, interval_s: float = DEFAULT_INTERVAL_S,
            step_stage: str | None = None, tracking: bool = False, output_dir: str | Path | None = None,
            services: RunServices | None = None, windows: int = DEFAULT_WINDOWS,
            precision: float | None = None, max_steps: int | None = None) -> Profile:
    """Profile the last ``steps`` of ``warmup_steps + steps`` trainer steps. ``precision``: measure on, a part at
    a time, until the rate's 90% interval is within +-precision, or up to ``max_steps`` (default 10 x ``steps``).
    Raises ``ProfileError`` when the pipeline ends before the window opens, and the runtime's errors."""
    from dflash_flow.core.errors import PipelineInterrupted
    from dflash_flow.core.runtime import Pipeline
    from dflash_flow.services import RunServices

    step_stage, max_steps = _checked(v, steps, warmup_steps, windows, precision, max_steps, step_stage)
    accum = grad_accum_of(v, step_stage)
    start_at, end_at = warmup_steps * accum, (warmup_steps + steps) * accum
    out_dir = Path(output_dir) if output_dir else v.graph.run_dir
    tracker = None
    if tracking:
        from dflash_flow.observe.tracking import Tracker

        section = v.graph.sections["tracking"]
        tracker = Tracker.start(
            enabled=True, tracking_uri=section.tracking_uri, experiment=section.experiment,
            run_name=f"{section.run_name or v.graph.name}-profile", params=v.graph.to_dict(),
            tags={"dflash_flow.kind": "profile"}, system_metrics=False, spool_dir=out_dir / "mlflow-spool")
    if services is None:
        from dflash_flow.app.model_spec import build_model_spec

        services = RunServices(model=build_model_spec(v.graph), tracker=tracker)
    elif tracker is not None:
        services = attrs.evolve(services, tracker=tracker)  # the caller's services, complete, not patched
    pipeline = Pipeline(v, services=services, output_dir=out_dir)
    status = "FAILED"
    try:
        with _Sampler(pipeline, step_stage, start_at, end_at, interval_s, windows, precision,
                      max_steps * accum if precision is not None else None) as sampler:
            try:
                pipeline.run()
            except PipelineInterrupted:
                if not sampler.cancelled:
                    status = "KILLED"
                    raise
        final = pipeline.snapshot()
        if sampler.start is None:
            raise ProfileError(
                f"the pipeline ended before its trainer '{step_stage}' took {start_at} batch(es) (warmup): "
                f"it took {sampler._taken(final)}; shorten the warmup or let the pipeline run longer"
            )
        result = build_profile(
            v, sampler.start, sampler.end or final, step_stage=step_stage, steps=steps, warmup_batches=start_at,
            complete=sampler.end is not None, elapsed_s=final.elapsed_s, depths=sampler.window_depths,
            series=sampler.queue_series(), interval_s=interval_s, cuts=sampler.cuts,
        )
        if precision is not None:
            # The steps the window grew to; a pipeline that ended while it grew is complete past the asked ones.
            grown = (sampler.end_at - sampler._taken(sampler.start)) // accum if sampler.end is not None else steps
            result = attrs.evolve(result, steps=max(steps, grown), precision=precision, reached=sampler.reached,
                                  complete=result.complete or result.batches >= steps * accum)
        status = "FINISHED"
        if tracker is not None:  # the metrics, profile.json and the bottleneck tag into the tracked run
            from dflash_flow.observe.schema import mlflow_metrics

            tracker.log_metrics(mlflow_metrics(result), step=0)
            tracker.log_artifact(save_profile(result, out_dir / "profile.json"))
            if result.bottleneck is not None:
                tracker.set_tags({"bottleneck": result.bottleneck.stage})
        return result
    finally:
        if tracker is not None:
            tracker.end(status)


def _checked(v: Validated, steps: int, warmup_steps: int, windows: int, precision: float | None,
             max_steps: int | None, step_stage: str | None) -> tuple[str, int]:
    """``profile``'s arguments checked (else ``ProfileError``); returns the trainer stage and the step limit."""
    if steps < 1 or warmup_steps < 0:
        raise ProfileError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup_steps}")
    if windows < 1:
        raise ProfileError(f"--windows must be >= 1 (2 or more for an interval), got {windows}")
    if precision is not None and not (0 < precision < 1 and windows >= 2):
        raise ProfileError(f"--precision must be a fraction between 0 and 1 (0.05: +-5%) with --windows 2 or more, "
                           f"got {precision} with {windows} window(s)")
    max_steps = max_steps if max_steps is not None else 10 * steps
    if max_steps < steps:
        raise ProfileError(f"--max-steps ({max_steps}) must be at least --steps ({steps})")
    step_stage = step_stage or find_step_stage(v)
    if step_stage not in v.classes:
        raise ProfileError(f"--step-stage: no stage named '{step_stage}' (stages: {', '.join(v.order)})")
    return step_stage, max_steps


def to_json(p: Profile) -> dict[str, Any]:
    return attrs.asdict(p)


def save_profile(p: Profile, path: str | Path) -> Path:
    from dflash_flow.util import atomic_write_text

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return atomic_write_text(Path(path), json.dumps(to_json(p), indent=1, default=str) + "\n")


def load_profile(path: str | Path) -> Profile:
    """A profile written by :func:`save_profile`, else ``ProfileError`` naming the file."""
    import cattrs

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read the profile: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise ProfileError(f"{path}: not a profile (invalid JSON: {exc})") from exc
    if not isinstance(data, dict) or data.get("version") not in READABLE_VERSIONS:
        found = data.get("version") if isinstance(data, dict) else type(data).__name__
        known = " or ".join(str(n) for n in READABLE_VERSIONS)
        raise ProfileError(f"{path}: not a profile of version {known} (found {found!r}); "
                           "write one with `dflash-flow profile`")
    try:
        return cattrs.Converter().structure(data, Profile)
    except Exception as exc:  # cattrs raises a group of located errors; one line is what the user needs
        raise ProfileError(f"{path}: not a valid profile: {exc}") from exc


def _short(x: float | None) -> str | None:
    return None if x is None else f"{x:.2g}"


def render_profile(p: Profile, *, width: int = 130) -> str:
    """The profile as plain-text tables: stages (and their replicas), queues, the verdict, the balance."""
    from dflash_flow.observe.console import pct, render_table

    head = (
        f"profile of {p.pipeline}: {p.batches} batches of '{p.step_stage}' in {p.window_s:.2f} s "
        f"(after {p.warmup_batches} warm-up), {p.batches_per_s:.3g} batches/s, {p.steps_per_s:.3g} steps/s"
    )
    if p.tokens_per_s is not None:
        head += f", {p.tokens_per_s:,.0f} tokens/s"
    if p.cpu_s_per_batch is not None and p.cores:
        used = p.cpu_s_per_batch * p.batches_per_s
        head += f"; CPU {p.cpu_s_per_batch:.3g} s per batch ({used:.2g} of {p.cores} cores busy)"
    if not p.complete:
        head += f"; the pipeline ended before {p.steps} steps"
    if p.precision is not None:
        got = f"+-{100 * p.reached:.1f}%" if p.reached is not None else "no interval"
        head += (f"; measured until the rate was known to {got} (asked +-{100 * p.precision:g}%)"
                 if p.reached is not None and p.reached <= p.precision else
                 f"; the rate is known to {got} after {p.steps} steps, not the asked +-{100 * p.precision:g}%: "
                 "this machine's speed varies more than that (raise --max-steps, or profile with nothing else running)")
    head += (f"; spread over {len(p.windows)} parts of the window" if len(p.windows) > 1 else
             "; no spread measured (one part)" if p.version >= 2 else
             "; no spread measured: re-profile with this version for an interval")
    rows = []
    for s in p.stages.values():
        sd = pct(s.work_s_sd / s.work_s_per_batch) if s.work_s_sd is not None and s.work_s_per_batch > 0 else None
        rows.append([s.name, s.replicas, pct(s.busy), pct(s.blocked_in), pct(s.blocked_out), s.items_per_s,
                     s.service_s, s.items_per_batch, s.work_s_per_batch, sd, _short(s.cpu_s_per_batch),
                     _short(s.cpu_wait_s_per_batch)])
        if s.replicas > 1:
            for r in s.per_replica:
                handled = r.items_in or r.items_out
                rows.append([f"  [{r.replica}] {r.device}", None, pct(r.busy), pct(r.blocked_in), pct(r.blocked_out),
                             r.items_per_s, r.busy_s / handled if handled else None, None, None, None, None, None])
    parts = [head, render_table(rows, ["stage", "replicas", "busy", "starved", "blocked out", "items/s", "s/item",
                                       "items/batch", "work s/batch", "sd", "cpu s", "core wait s"], width=width)]
    qrows = [[f"{s.name}[{r.replica}]", r.queue.capacity, r.queue.min, round(r.queue.mean, 2), r.queue.max]
             for s in p.stages.values() for r in s.per_replica if r.queue is not None]
    if qrows:
        parts.append(f"queue depths over the window ({p.interval_s:g} s polls)")
        parts.append(render_table(qrows, ["input queue", "capacity", "min", "mean", "max"], width=width))
    if p.bottleneck is not None:
        parts.append(f"bottleneck: {p.bottleneck.sentence}")
    changes = [f"{n} {p.stages[n].replicas} -> {r}" for n, r in p.balanced_replicas.items() if r != p.stages[n].replicas]
    parts.append("balanced replicas: " + (", ".join(changes) if changes else "the current counts are balanced"))
    return "\n".join(parts)


def profile_command(file: Path, v: Validated, *, out: Path | None, **options: Any) -> int:
    """``dflash-flow profile``: run (``options``: :func:`profile`'s), print the tables, write the JSON; an exit code."""
    from dflash_flow.app import exits
    from dflash_flow.app.runner import quiet_libraries
    from dflash_flow.core.errors import PipelineInterrupted, PipelineStalled, StageError

    quiet_libraries()
    out_dir = v.graph.run_dir
    try:
        result = profile(v, output_dir=out_dir, **options)
    except ProfileError as exc:
        print(f"error: {file}: {exc}", file=sys.stderr)
        return exits.EXIT_USER_ERROR
    except (StageError, PipelineStalled) as exc:
        print(f"error: {exc}", file=sys.stderr)
        user = isinstance(exc, StageError) and exits.is_user_input_error(exc.original)
        return exits.EXIT_USER_ERROR if user else exits.EXIT_FAILED
    except PipelineInterrupted as exc:
        print(f"stopped: {exc}", file=sys.stderr)
        return exits.EXIT_INTERRUPTED
    path = save_profile(result, out or out_dir / "profile.json")
    print(render_profile(result))
    print(f"wrote {path}", file=sys.stderr)
    return exits.EXIT_OK
