"""DrafterStep: adapts a drafter's training run (``model.training.DrafterRun`` over ``model.trainer``) to the
pipeline: target features in, step reports out; the stop, checkpoints and the export through the run services.
The knobs are declared where they act (``core.fields.include``): the run's, the shape's, the recipe's, the
strategies', the threads' and the held-out walk's."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, ClassVar, Literal

import attrs

from dflash_flow.core import Stage, cfg
from dflash_flow.core.fields import include
from dflash_flow.core.metrics import Counter, Gauge, Summary, stage_metric
from dflash_flow.data.position import DataPosition
from dflash_flow.items import StepReport, TargetFeatures
from dflash_flow.model import strategies
from dflash_flow.model.heldout_schedule import HeldoutKnobs
from dflash_flow.model.recipe import NOT_IN_YAML, DrafterShape, TrainerConfig
from dflash_flow.model.spec import ModelSpec, UsesModel, model_of
from dflash_flow.model.threads import ThreadKnobs
from dflash_flow.model.training import RunKnobs, drafter_shape
from dflash_flow.services import CheckpointPayload, CheckpointSource, services_of

log = logging.getLogger(__name__)

#: The drafter's shape fields that the model spec declares once (``model:``), not the stage.
IN_MODEL = ("num_layers", "block_size", "mask_token_id", "target_layer_ids")


@attrs.define
class DrafterStepMetrics:
    steps: Counter = stage_metric("steps", "Optimizer steps")
    tokens: Counter = stage_metric("tokens", "Real tokens trained on")
    samples: Counter = stage_metric("samples", "Samples trained on")
    loss: Gauge = stage_metric("nats", "Last step's loss")
    step_s: Summary = stage_metric("s", "Seconds of compute per micro-batch")
    heldout_probe_s: Counter = stage_metric("s", "Seconds spent measuring the held-out walk")
    torch_threads: Gauge = stage_metric("threads", "The drafter's torch intra-op threads (CPU; "
                                        "torch_threads_after_first_epoch, threads_fallback)")


@attrs.define(kw_only=True, eq=False)
@include(RunKnobs, DrafterShape, TrainerConfig, *strategies.VARIANTS.values(), *strategies.OBJECTIVES.values(),
         ThreadKnobs, HeldoutKnobs, exclude=(*NOT_IN_YAML, *IN_MODEL))
class DrafterStep(Stage, CheckpointSource, UsesModel):
    """Trains the DFlash drafter on target features; checkpoints; exports the inference checkpoint."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.model.export  # noqa: F401
        import dflash_flow.model.target  # noqa: F401
        import dflash_flow.model.trainer  # noqa: F401

    input_type = TargetFeatures
    output_type = StepReport
    stage_metrics = (DrafterStepMetrics,)
    singleton = True
    moved_fields: ClassVar[dict[str, str]] = {
        "target": "model.target", "tokenizer": "model.tokenizer", "trust_remote_code": "model.trust_remote_code",
        "num_layers": "model.num_draft_layers", "target_layer_ids": "model.target_layer_ids",
        "block_size": "model.block_size", "mask_token_id": "model.mask_token_id",
    }

    variant: Literal["dflash", "dflash2"] = cfg(
        "dflash", choices=tuple(strategies.VARIANTS),
        doc="dflash, or dflash2: in-block convolutions and a candidate selector (docs/dflash2.md).",
    )
    objective: Literal["dflash", "variable_prefix"] = cfg(
        "dflash", choices=tuple(strategies.OBJECTIVES),
        doc="dflash: one real token per block; variable_prefix: D2SD VP-Drafter, each block shows l real tokens, "
        "only the masked suffix is supervised (docs/objectives.md).",
    )
    _run: Any = attrs.field(default=None, init=False)  # model.training.DrafterRun, from setup on
    _batch_log: Any = attrs.field(default=None, init=False)

    @objective.validator
    def _check_strategies(self, _attribute: attrs.Attribute, _value: str) -> None:
        strategies.refuse_misplaced_knobs(self)  # the checks against the block size need the model spec

    def model_problems(self, spec: ModelSpec, devices: list[list[str]]) -> list[tuple[str, str]]:  # noqa: ARG002
        """(field, message): a target declared; the strategies' settings against the block size and the target's
        sizes, a drafter to start from made for them (``strategies.setting_problems``)."""
        if spec.target is None:
            return [("model.target", "DrafterStep needs the target (its embedding and LM head are shared): set "
                                     "model.target")]
        return strategies.setting_problems(strategies.variant_of(self), strategies.objective_of(self),
                                           block_size=spec.block_size, facts=spec.facts, init_from=self.init_from)

    # -- lifecycle --------------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        from dflash_flow.model.training import DrafterRun

        self._ctx, self._services, self._stopping = ctx, services_of(ctx), False
        self._spec = spec = model_of(ctx)
        spec.require_target(f"stage '{ctx.name}'")
        self._run = run = DrafterRun.build(self, spec, device=ctx.device, seed=ctx.shared_seed_for(0, "init"),
                                           busy=ctx.busy)
        if self.heldout_data is not None and ctx.rank == 0 and not run.trainer.sharded:
            with ctx.busy("preparing the held-out sample (one target forward per conversation)"):
                run.prepare_heldout(spec, self._heldout_path(), device=ctx.device)
        if self.record_batches:
            self._batch_log = self._services.open_batch_log(ctx)
        self._m = ctx.metrics.declare(DrafterStepMetrics)

    def _heldout_path(self) -> Path:
        from dflash_flow.embedded import embedded_walk_data

        name = self._ctx.name
        if self.heldout_data == "embedded" and not self._spec.is_embedded:
            raise ValueError(f"stage '{name}': heldout_data 'embedded' holds the embedded target's "
                             "replies; with another target, give a JSONL of that target's own replies")
        if self._spec.tokenizer is None:
            raise ValueError(f"stage '{name}': heldout_data needs a tokenizer (set model.tokenizer)")
        return embedded_walk_data() if self.heldout_data == "embedded" else Path(self.heldout_data)

    def process(self, feats: TargetFeatures):
        """Train one micro-batch; after an optimizer step, emit its report, then checkpoint when due (the
        Monitor has the report before the checkpoint commits: its metrics are in MLflow by then).

        A stop (Ctrl-C, SIGTERM) trains at most the micro-batch in flight: from then on batches are dropped
        and the stages that only feed this one drop theirs (``abandon_upstream``); the data position stays
        the last batch trained, so a resume trains the dropped ones. In one process the stop takes effect
        at once (a partial accumulation goes into the stop checkpoint); under torchrun the ranks agree on
        the optimizer step after which they all stop (``services.stop_consensus``)."""
        if not self._stopping and self._services.stop_consensus is None and self._ctx.stop_requested.is_set():
            self._begin_stop()
        if self._stopping:
            return None  # stopping: the rest drains untrained
        meta = feats.meta
        done = self._run.train(feats, anchor_seed=self._ctx.shared_seed_for(meta.epoch, "anchors", meta.index))
        if done.threads is not None:
            self._m.torch_threads.set(done.threads)
        self._m.tokens.inc(meta.real_tokens)
        self._m.samples.inc(meta.num_samples)
        self._m.step_s.observe(done.step_s)
        if done.warning:
            log.warning("%s: %s", self._ctx.name, done.warning)
        if self._batch_log is not None and not meta.filler:
            self._batch_log.write(meta)
        return None if done.metrics is None else self._after_step(meta, done.metrics)

    def _after_step(self, meta, metrics: dict[str, float]):
        run, services = self._run, self._services
        self._m.steps.inc()
        if "loss" in metrics:  # a step of filler batches only has no loss
            self._m.loss.set(metrics["loss"])
        walk = run.heldout(last=meta.last_of_run, elapsed_before_s=services.record.elapsed_before_s)
        if walk is not None:
            self._m.heldout_probe_s.inc(walk.probe_s)
        yield StepReport(step=run.trainer.step, epoch=meta.epoch, meta=meta, metrics=metrics,
                         position_accuracy=run.trainer.position_accuracy, total_steps=run.trainer.total_steps,
                         heldout=walk)
        # An epoch's end and the run's last planned batch are both checkpoint points (at_epoch_end).
        epoch_end = meta.last_of_epoch or meta.last_of_run
        if services.checkpoints is not None and services.checkpoints.after_step(self, step=run.trainer.step,
                                                                                epoch_end=epoch_end):
            run.since_checkpoint = 0
        consensus = services.stop_consensus
        if consensus is not None and consensus.agree_to_stop(self._ctx.stop_requested.is_set()):
            self._begin_stop(reason="another rank of the job is stopping")  # every rank stops after this step

    def _begin_stop(self, reason: str | None = None) -> None:
        self._stopping = True
        runtime = self._ctx.runtime
        if runtime is not None:
            runtime.abandon_upstream(self._ctx.name)
            if reason is not None and not self._ctx.stop_requested.is_set():
                runtime.request_stop(reason)

    def parameter_count(self, spec: ModelSpec | None = None) -> int:
        """Trainable parameters of the drafter this stage builds with ``spec``, counted on the meta device (no
        memory, no weights): the application sizes the free space one checkpoint needs from it before the run
        starts."""
        from dflash_flow.model.build import parameter_count_for

        spec = spec or ModelSpec()
        target = None if self.init_from else spec.require_target("DrafterStep")
        return parameter_count_for(target, drafter_shape(self, spec), trust_remote_code=spec.trust_remote_code,
                                   init_from=self.init_from)

    def output_dirs(self) -> list[str]:
        return [self.export_dir]

    def input_paths(self) -> list[tuple[str, str, str]]:
        from dflash_flow.util import local_dirs

        return local_dirs(("init_from", self.init_from))

    @property
    def inputs_per_step(self) -> int:
        return self.grad_accum

    # -- checkpoints --------------------------------------------------------------------------------
    def checkpoint_payload(self, epoch_end: bool = False) -> CheckpointPayload:
        run = self._run
        trainer = run.trainer
        return CheckpointPayload(
            step=trainer.step, epoch=run.position.epoch, model_state=trainer.full_model_state(),
            optimizer_state=trainer.optimizer_state(), data_position=run.position.to_dict(), stage=self._ctx.name,
            stage_state=self.state_dict(), extra={"total_steps": trainer.total_steps},
            files={"config.json": trainer.config_json()},
        )

    def get_state(self) -> dict[str, Any]:
        if self._run is None:  # before setup: a fresh stage's
            return {**DataPosition().as_state(), "threads_fallback_at": None, "trainer": None}
        return self._run.state()

    def set_state(self, state: dict[str, Any]) -> None:
        # One channel: the stage's own state; a resumed checkpoint adds its weights and optimizer.
        self._run.load_state(state, self._services.resume)

    def finish(self):
        run, ctx = self._run, self._ctx
        if ctx.stop_requested.is_set():
            # Stopped: the state is that of the last batch trained, a partial accumulation included (no
            # early optimizer step: a resumed run completes that step as an uninterrupted run would).
            if self._services.checkpoints is not None:
                self._services.checkpoints.at_stop(self, trained=bool(run.since_checkpoint))
            return None
        run.check_trained(f"stage '{ctx.name}'")
        state = run.trainer.full_model_state()  # collective under fsdp: every rank takes part
        step, epoch = run.trainer.step, run.position.epoch
        if ctx.rank != 0:  # one export per job, by rank 0 (the weights are the same on every rank)
            return (StepReport(step=step, epoch=epoch, meta=None, metrics={}, final=True),)
        exporter = self._services.exporter
        if exporter is None:  # a pipeline built without the application: into the context's output_dir
            from dflash_flow.model.export import DrafterExporter

            exporter = DrafterExporter(Path(ctx.output_dir))
        target = self._spec.target
        done = exporter.export(run.trainer.drafter, state, self.export_dir, check_stop=ctx.check_stop,
                               target=target if isinstance(target, str) else None)
        return (StepReport(step=step, epoch=epoch, meta=None, metrics={}, final=True,
                           artifacts={"drafter": str(done.path)}),)

    def teardown(self) -> None:
        if self._batch_log is not None:
            self._batch_log.close()
            self._batch_log = None
