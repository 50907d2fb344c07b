"""One drafter's training run as the pipeline drives it, batch by batch: the trainer (``model.trainer``), its
torch threads (``ThreadPolicy``), the held-out walk and its schedule, and the data position reached; its state
makes a resumed run continue bit for bit. Torch-free at import: DrafterStep includes the knobs declared here."""

from __future__ import annotations

import statistics
import time
from collections import deque
from pathlib import Path, PurePath
from typing import Any

import attrs

from dflash_flow.core.stage import cfg, include, values_of
from dflash_flow.data.epoch import DataPosition
from dflash_flow.data.reports import DataError
from dflash_flow.items import HeldoutWalk
from dflash_flow.model.spec import ModelSpec
from dflash_flow.model.strategies import (
    OBJECTIVES,
    VARIANTS,
    DrafterShape,
    StrategyChoice,
    TrainerConfig,
    objective_of,
    setting_problems,
    variant_of,
)


class ThreadSwitchWatch:
    """Whether a switch of torch's intra-op threads mid-run made steps slower (other work took the cores):
    ``observe(step_s)`` after every step, ``switched(old, new)`` at a switch. Warns once per switch when the
    median of a window of ``window`` steps after it is slower than the ``window`` before by over ``tolerance``."""

    def __init__(self, window: int = 16, tolerance: float = 0.5, streak: int = 3, spike: float = 3.0) -> None:
        self.window = int(window)
        self.tolerance = float(tolerance)
        # Sooner when it is bad: ``streak`` steps in a row each ``spike`` times the median before the switch.
        self.streak = int(streak)
        self.spike = float(spike)
        self._run = 0
        self._before: deque[float] = deque(maxlen=self.window)
        self._reference: float | None = None  # the median before the switch
        self._after: list[float] = []
        self._change: tuple[int, int] | None = None

    def switched(self, old: int, new: int) -> None:
        self._change = (old, new)
        self._reference = statistics.median(self._before) if len(self._before) == self.window else None
        self._before.clear()
        self._after, self._run = [], 0

    def observe(self, step_s: float) -> str | None:
        if self._reference is None:
            self._before.append(step_s)
            return None
        self._after.append(step_s)
        self._run = self._run + 1 if step_s > self._reference * self.spike else 0
        if self._run >= self.streak:
            before, after = self._reference, statistics.median(self._after[-self.streak:])
            n = self.streak
        elif len(self._after) < self.window:
            return None
        else:
            before, after, n = self._reference, statistics.median(self._after), self.window
            if after <= before * (1 + self.tolerance):
                self._after = []
                return None
        self._after, self._run = [], 0
        old, new = self._change or (0, 0)
        self._reference = None  # said once for this switch
        return (f"steps got slower after the switch from {old} to {new} torch threads ({before * 1e3:.0f} -> "
                f"{after * 1e3:.0f} ms median over {n} steps): other work is using the cores; set "
                f"torch_threads_after_first_epoch: {old} (or null) for runs on a shared machine")


@attrs.frozen(kw_only=True)
class ThreadKnobs:
    """The trainer's torch intra-op threads; none changes a trained weight."""

    torch_threads: int | None = cfg(None, ge=1, result=False, doc="torch intra-op threads (CPU runs).")
    torch_threads_after_first_epoch: int | None = cfg(
        None, ge=1, result=False,
        doc="torch intra-op threads from the second epoch on (default: torch_threads): with TargetForward's "
        "cache_features the target is idle after the first epoch, and its cores can go to the drafter.",
    )
    threads_fallback: bool = cfg(
        True, result=False,
        doc="When steps after the switch to torch_threads_after_first_epoch run slower than the steps before it "
        "(another process took a core: two threads then wait on each other, up to 100x slower on a 2-core box), "
        "go back to torch_threads for the rest of the run. The step is kept in the checkpoint: a resumed run "
        "uses the threads the interrupted one used at every step.",
    )


class ThreadPolicy:
    """This thread's torch threads for each batch: ``torch_threads_after_first_epoch`` from the second epoch on
    until the watch finds the switch made steps slower; a function of the epoch and of ``fallback_at`` (kept in
    the run's state), so a resumed run uses the threads the original did."""

    def __init__(self, knobs: ThreadKnobs, fallback_at: int | None = None) -> None:
        self.knobs = knobs
        self.fallback_at = fallback_at  # batches consumed when the threads went back
        self.threads: int | None = None  # what this thread runs with now (None: never set)
        self._initial: int | None = None  # the thread's own setting before any switch
        self._watch = ThreadSwitchWatch()

    @property
    def base(self) -> int | None:
        """The threads before any switch: ``torch_threads``, else what the thread had."""
        return self.knobs.torch_threads or self._initial

    def apply(self, epoch: int, consumed: int) -> int | None:
        """Set the threads for a batch of ``epoch`` after ``consumed`` batches of the run; returns them."""
        import torch

        if self._initial is None:
            self._initial = torch.get_num_threads()
        later = self.knobs.torch_threads_after_first_epoch
        fell_back = self.fallback_at is not None and consumed >= self.fallback_at
        want = later if later and epoch >= 1 and not fell_back else self.base
        if want and want != self.threads:
            torch.set_num_threads(want)
            if self.threads is not None:
                self._watch.switched(self.threads, want)
            self.threads = want
        return self.threads

    def observe(self, step_s: float, consumed: int) -> str | None:
        """After each step: the watch's warning, if any (with ``threads_fallback``, going back from the next
        batch on)."""
        warning = self._watch.observe(step_s)
        if not warning:
            return None
        k = self.knobs
        if k.threads_fallback and k.torch_threads_after_first_epoch and self.fallback_at is None:
            self.fallback_at = consumed
            back = self.base
            warning += (f"; going back to {back} torch thread{'s' if back != 1 else ''} from batch "
                        f"{consumed} on, for the rest of the run (threads_fallback)")
        return warning


@attrs.frozen(kw_only=True)
class HeldoutKnobs:
    """Acceptance over time; the walk draws no random numbers and leaves the weights as they were."""

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


def check_inside_output_dir(field: str, value: str) -> None:
    """A stage's output path is relative to the run's output directory and must stay inside it."""
    p = PurePath(value)
    if not value or p.is_absolute() or value.startswith("~") or ".." in p.parts:
        raise ValueError(
            f"{field} must be a relative path inside output_dir (no '..', not absolute), got {value!r}; "
            "to write somewhere else, set output_dir"
        )


@attrs.frozen(kw_only=True)
class RunKnobs:
    """The run's own knobs."""

    dtype: str = cfg("auto", choices=("auto", "float32", "bfloat16"), doc="auto: bf16 (fp32 masters) on GPU, fp32 on CPU.")
    init_from: str | None = cfg(None, doc="Start from an exported drafter directory instead of random weights.")
    export_dir: str = attrs.field(
        default="drafter",
        validator=lambda _inst, _attr, value: check_inside_output_dir("export_dir", value),
        metadata={"doc": "Where the final inference checkpoint goes (a path inside output_dir).", "config": True,
                  "result": False},
        kw_only=True,
    )
    record_batches: bool = cfg(
        False, result=False,
        doc="Write every trained batch (epoch, index, sample ids) to OUTPUT/batches.jsonl; a resumed run appends "
        "(after a hard kill, the lines past the checkpoint's data_position.total appear again).",
    )


#: The knob classes DrafterStep takes flat as its YAML fields (after ``strategies.StrategyChoice``'s), less
#: ``NOT_IN_STAGE`` (the shape fields that the model spec declares once, ``model:``, and those not in YAML).
KNOBS = (RunKnobs, DrafterShape, TrainerConfig, *VARIANTS.values(), *OBJECTIVES.values(), ThreadKnobs, HeldoutKnobs)
NOT_IN_STAGE = ("variant", "objective", "time_allreduce", "num_layers", "block_size", "mask_token_id", "target_layer_ids")


def include_knobs(cls: type) -> type:
    """Class decorator (under ``attrs.define``): the knobs as DrafterStep's YAML fields (``core.stage.include``)."""
    return include(*KNOBS, exclude=NOT_IN_STAGE)(include(StrategyChoice)(cls))


def preload() -> None:
    """The modules a drafter's run imports, loaded before any stage thread starts (``Stage.preload``)."""
    import dflash_flow.model.export  # noqa: F401
    import dflash_flow.model.target  # noqa: F401
    import dflash_flow.model.trainer  # noqa: F401


def drafter_problems(conf: Any, spec: ModelSpec) -> list[tuple[str, str]]:
    """(field, message): a target declared; the strategies' settings against the block and the target."""
    if spec.target is None:
        return [("model.target", "DrafterStep needs the target (its embedding and LM head are shared): set "
                                 "model.target")]
    return setting_problems(variant_of(conf), objective_of(conf), block_size=spec.block_size, facts=spec.facts,
                            init_from=conf.init_from)


def parameter_count(conf: Any, spec: ModelSpec | None) -> int:
    """Trainable parameters of the drafter ``conf`` builds with ``spec``, counted on the meta device (the
    application sizes a checkpoint's free space from it)."""
    import torch

    from dflash_flow.model.dflash2 import drafter_from_config
    from dflash_flow.model.export import load_drafter_config
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import drafter_config

    spec = spec or ModelSpec()
    target = None if conf.init_from else spec.require_target("DrafterStep")
    shape = drafter_shape(conf, spec)
    if conf.init_from:
        config = load_drafter_config(conf.init_from)
    else:
        config = drafter_config(load_target_config(target, trust_remote_code=spec.trust_remote_code), shape,
                                mask_token_id=0)
    with torch.device("meta"):
        model = drafter_from_config(config)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def drafter_shape(conf: Any, spec: Any) -> DrafterShape:
    """The shape of the drafter a config that carries the knobs flat (DrafterStep) asks for, with the model
    facts of ``spec`` (``model.spec.ModelSpec``)."""
    ids = spec.explicit_layer_ids
    return values_of(DrafterShape, conf, variant=variant_of(conf), num_layers=spec.num_draft_layers,
                     block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                     target_layer_ids=list(ids) if ids is not None else None)


@attrs.frozen
class Trained:
    """One micro-batch trained: the step's metrics (None without an optimizer step), seconds, threads, warning."""

    metrics: dict[str, float] | None
    step_s: float
    threads: int | None
    warning: str | None


class DrafterRun:
    """A trainer fed one micro-batch at a time, with its threads, its held-out walk and its data position."""

    def __init__(self, trainer: Any, threads: ThreadPolicy, heldout: HeldoutKnobs,
                 position: DataPosition | None = None) -> None:
        self.trainer = trainer
        self.threads = threads
        self.position = position or DataPosition()
        self.planned_total: int | None = None  # the plan's batches for this rank
        self.since_checkpoint = 0  # batches trained since the last checkpoint (this process)
        self.probe: Any = None  # model.walk.HeldoutProbe, when the held-out walk is measured
        self.heldout_knobs = heldout
        self._last_walk: tuple[int, float] | None = None  # (step, perf_counter) of the last measurement
        self._t_start = time.perf_counter()

    @classmethod
    def build(cls, conf: Any, spec: Any, *, device: str, seed: int, busy: Any) -> DrafterRun:
        """The run a config that carries the knobs flat (DrafterStep) asks for, for the target of ``spec``;
        ``busy(what)``: a context in which a long build tells the watchdog it is alive."""
        from dflash_flow.model.trainer import DrafterTrainer

        threads = ThreadPolicy(values_of(ThreadKnobs, conf))
        threads.apply(0, 0)
        target = spec.require_target("DrafterStep")
        config = values_of(TrainerConfig, conf, exclude=("time_allreduce",), variant=variant_of(conf),
                           objective=objective_of(conf))
        with busy("building the drafter and loading the target's head"):
            trainer = DrafterTrainer.for_target(
                target, drafter_shape(conf, spec), config, device=device, dtype=conf.dtype, seed=seed,
                tokenizer_path=spec.tokenizer, trust_remote_code=spec.trust_remote_code, init_from=conf.init_from)
        return cls(trainer, threads, values_of(HeldoutKnobs, conf))

    def prepare_heldout(self, spec: Any, data: str, embedded: Any, *, device: str, who: str) -> None:
        """The held-out walk's fixed sample of ``data`` (a JSONL, or ``"embedded"``: the path ``embedded()``
        gives), measured from now on at the schedule's steps."""
        from dflash_flow.model.evaluation import prepare_probe

        if data == "embedded" and not spec.is_embedded:
            raise ValueError(f"{who}: heldout_data 'embedded' holds the embedded target's replies; with another "
                             "target, give a JSONL of that target's own replies")
        if spec.tokenizer is None:
            raise ValueError(f"{who}: heldout_data needs a tokenizer (set model.tokenizer)")
        path = embedded() if data == "embedded" else Path(data)
        self.probe = prepare_probe(self.heldout_knobs, path, target=spec.require_target("DrafterStep"),
                                   tokenizer_path=spec.tokenizer, trust_remote_code=spec.trust_remote_code,
                                   layer_ids=self.trainer.drafter.target_layer_ids, device=device,
                                   dtype=self.trainer.dtype)

    def train(self, feats: Any, *, anchor_seed: int) -> Trained:
        """Train the micro-batch ``feats`` with the threads its epoch asks for; advance the position past it."""
        meta = feats.meta
        threads = self.threads.apply(meta.epoch, self.position.total)
        t0 = time.perf_counter()
        metrics = self.trainer.train_batch(feats, anchor_seed=anchor_seed, force_step=meta.ends_accumulation)
        self.position = self.position.after(meta)
        self.planned_total = meta.total_batches or None
        self.since_checkpoint += 1
        step_s = time.perf_counter() - t0
        warning = None if meta.filler else self.threads.observe(step_s, self.position.total)
        return Trained(metrics, step_s, threads, warning)

    def heldout(self, *, last: bool, elapsed_before_s: float = 0.0) -> HeldoutWalk | None:
        """The held-out walk when due: at the first and ``last`` step, every ``heldout_every_steps`` steps or
        ``heldout_every_s`` seconds; ``elapsed_s`` on the run's clock (``elapsed_before_s``: the runs it resumes)."""
        if self.probe is None:
            return None
        step, now = self.trainer.step, time.perf_counter()
        if self._last_walk is not None and not last:
            (prev_step, prev_t), k = self._last_walk, self.heldout_knobs
            if not ((k.heldout_every_steps is not None and step - prev_step >= k.heldout_every_steps)
                    or (k.heldout_every_s is not None and now - prev_t >= k.heldout_every_s)):
                return None
        r = self.probe.measure(self.trainer.drafter, self.trainer.head)
        self._last_walk = (step, time.perf_counter())
        return HeldoutWalk(tau=r.tau, elapsed_s=elapsed_before_s + now - self._t_start, probe_s=r.seconds,
                           conversations=len(self.probe.inputs), horizon=self.probe.horizon)

    def check_trained(self, who: str) -> None:
        """A run that ends without a stop must have trained what its plan holds, before its drafter is
        exported as the planned result."""
        if self.trainer.step == 0:
            raise DataError(
                f"{who} trained no optimizer step: the pipeline delivered no batch to train on "
                "(an empty dataset, or every record skipped); nothing is exported")
        planned, total = self.planned_total, self.position.total
        if planned is not None and total < planned:
            raise RuntimeError(
                f"{who}: the data stream ended after {total} of the {planned} batches its plan holds for this rank; "
                "nothing is exported (an upstream stage stopped early)")

    def checkpoint(self) -> dict[str, Any]:
        """The fields of the run's checkpoint (``services.CheckpointPayload``'s) that the run holds."""
        t = self.trainer
        return dict(step=t.step, epoch=self.position.epoch, model_state=t.full_model_state(),
                    optimizer_state=t.optimizer_state(), data_position=self.position.to_dict(),
                    extra={"total_steps": t.total_steps}, files={"config.json": t.config_json()})

    @staticmethod
    def fresh_state() -> dict[str, Any]:
        """``state`` before any run is built."""
        return {**DataPosition().as_state(), "threads_fallback_at": None, "trainer": None}

    def export(self, state: dict[str, Any], exporter: Any, export_dir: str, *, output_dir: str, target: Any,
               check_stop: Any) -> str:
        """Export the trained drafter's ``state`` to ``export_dir``; returns where it went. ``exporter``: the
        application's (``services.exporter``), None without the application: into ``output_dir``."""
        from dflash_flow.model.export import DrafterExporter

        exporter = DrafterExporter(Path(output_dir)) if exporter is None else exporter
        done = exporter.export(self.trainer.drafter, state, export_dir, check_stop=check_stop,
                               target=target if isinstance(target, str) else None)
        return str(done.path)

    def state(self) -> dict[str, Any]:
        return {**self.position.as_state(), "threads_fallback_at": self.threads.fallback_at,
                "trainer": self.trainer.state_dict()}

    def load_state(self, state: dict[str, Any], resume: Any = None) -> None:
        """A saved ``state``; ``resume``: the checkpoint it came from (``services.Resume``: the weights, the
        optimizer, where the data continues)."""
        self.position = DataPosition.from_state(state)
        fallback = state.get("threads_fallback_at")
        self.threads.fallback_at = None if fallback is None else int(fallback)
        if state.get("trainer") is not None:
            self.trainer.load_state_dict(state["trainer"])
        if resume is None:
            return
        self.trainer.extend = resume.extend
        # Weights and optimizer come from the checkpoint files (safetensors / weights_only torch.load).
        self.trainer.restore(resume.model_state(str(self.trainer.device)), resume.optimizer_state())
        # The position continues where the checkpoint's does: never an epoch's end (that is the next one's start).
        self.position = self.position.resume_point()
