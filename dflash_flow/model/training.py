"""One drafter's training run as the pipeline drives it, batch by batch: the trainer (``model.trainer``), the
threads it computes with (``model.threads``), the held-out walk and its schedule (``model.heldout``), and the
data position it has reached (``data.position``). Torch-free at import: the DrafterStep stage includes the
run's own knobs (``RunKnobs``) and adapts the run to the DAG (metrics, the stop, checkpoints, reports).

The state a run keeps (``state``/``load_state``: the position, the batch the threads went back at, the
trainer's step and accumulator) is what makes a resumed run continue bit for bit.
"""

from __future__ import annotations

import time
from pathlib import PurePath
from typing import Any

import attrs

from dflash_flow.core.fields import values_of
from dflash_flow.core.stage import cfg
from dflash_flow.data.position import DataPosition
from dflash_flow.data.reports import DataError
from dflash_flow.items import HeldoutWalk
from dflash_flow.model.heldout_schedule import HeldoutKnobs, HeldoutSchedule
from dflash_flow.model.recipe import DrafterShape, TrainerConfig
from dflash_flow.model.strategies import objective_of, variant_of
from dflash_flow.model.threads import ThreadKnobs, ThreadPolicy

__all__ = ["DrafterRun", "RunKnobs", "Trained", "check_inside_output_dir", "drafter_shape"]


def check_inside_output_dir(field: str, value: str) -> None:
    """A stage's output path is relative to the run's output directory and must stay inside it: a YAML
    cannot make the run write elsewhere (the user chooses where a run writes with ``output_dir``)."""
    p = PurePath(value)
    if not value or p.is_absolute() or value.startswith("~") or ".." in p.parts:
        raise ValueError(
            f"{field} must be a relative path inside output_dir (no '..', not absolute), got {value!r}; "
            "to write somewhere else, set output_dir"
        )


@attrs.frozen(kw_only=True)
class RunKnobs:
    """The run's own knobs (declared once here; DrafterStep's YAML fields, ``core.fields.include``); the variant
    and the objective are the stage's own (their knobs are the strategies', ``model.strategies``)."""

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


def drafter_shape(conf: Any, spec: Any) -> DrafterShape:
    """The shape of the drafter a config that carries the knobs flat (DrafterStep) asks for, with the model
    facts of ``spec`` (``model.spec.ModelSpec``: the drafter's depth, block size, mask token, layers)."""
    ids = spec.explicit_layer_ids
    return values_of(DrafterShape, conf, variant=variant_of(conf), num_layers=spec.num_draft_layers,
                     block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                     target_layer_ids=list(ids) if ids is not None else None)


@attrs.frozen
class Trained:
    """What training one micro-batch gave: the step's metrics when it completed an optimizer step (else None),
    its seconds of compute, the torch threads it ran with, and the thread watch's warning, if any."""

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
        self.probe: Any = None  # model.heldout.HeldoutProbe, when the held-out walk is measured
        self.schedule = HeldoutSchedule(heldout)
        self._t_start = time.perf_counter()

    @classmethod
    def build(cls, conf: Any, spec: Any, *, device: str, seed: int, busy: Any) -> DrafterRun:
        """The run a config that carries the knobs flat (DrafterStep) asks for, for the target of ``spec``: this
        thread's torch threads set, the drafter built (``seed``) and its trainer, on ``device``; ``busy(what)``: a
        context in which a long build tells the watchdog it is alive."""
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

    def prepare_heldout(self, spec: Any, path: Any, *, device: str) -> None:
        """The held-out walk's fixed sample of ``path`` (``model.heldout.prepare_probe``), for the target of
        ``spec``: measured from now on at the schedule's steps."""
        from dflash_flow.model.heldout import prepare_probe

        self.probe = prepare_probe(self.schedule.knobs, path, target=spec.require_target("DrafterStep"),
                                   tokenizer_path=spec.tokenizer, trust_remote_code=spec.trust_remote_code,
                                   layer_ids=self.trainer.drafter.target_layer_ids, device=device,
                                   dtype=self.trainer.dtype)

    def train(self, feats: Any, *, anchor_seed: int) -> Trained:
        """Train the micro-batch ``feats`` (an optimizer step when its accumulation completes) with the threads
        its epoch asks for, and advance the position past it."""
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
        """The held-out walk now, when it is due (``HeldoutSchedule``); ``elapsed_s`` on the run's clock (the runs
        it resumes included: ``elapsed_before_s``)."""
        if self.probe is None:
            return None
        step, now = self.trainer.step, time.perf_counter()
        if not self.schedule.due(step, now, last=last):
            return None
        r = self.probe.measure(self.trainer.drafter, self.trainer.head)
        self.schedule.measured(step)
        return HeldoutWalk(tau=r.tau, elapsed_s=elapsed_before_s + now - self._t_start, probe_s=r.seconds,
                           conversations=len(self.probe.inputs), horizon=self.probe.horizon)

    def check_trained(self, who: str) -> None:
        """A run that ends without a stop must have trained what its plan holds: no optimizer step at all,
        or a stream that ended before the plan's last batch, fails here -- before a drafter that is not
        the planned result is exported as one."""
        if self.trainer.step == 0:
            raise DataError(
                f"{who} trained no optimizer step: the pipeline delivered no batch to train on "
                "(an empty dataset, or every record skipped); nothing is exported")
        planned, total = self.planned_total, self.position.total
        if planned is not None and total < planned:
            raise RuntimeError(
                f"{who}: the data stream ended after {total} of the {planned} batches its plan holds for this rank; "
                "nothing is exported (an upstream stage stopped early)")

    def state(self) -> dict[str, Any]:
        return {**self.position.as_state(), "threads_fallback_at": self.threads.fallback_at,
                "trainer": self.trainer.state_dict()}

    def load_state(self, state: dict[str, Any], resume: Any = None) -> None:
        """A saved ``state``; ``resume``: the checkpoint it came from (``services.Resume``), whose files hold the
        weights and the optimizer, and whose position says where the data continues (its resume point)."""
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
