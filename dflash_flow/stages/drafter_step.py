"""DrafterStep: adapts a drafter's training run (``model.training.DrafterRun``) to the pipeline: target features in,
step reports out; the stop, checkpoints and the export through the run services. Its knobs are included from where
they act (``model.training.include_knobs``)."""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import attrs

from dflash_flow.core import Stage
from dflash_flow.core.metrics import Counter, Gauge, Summary, stage_metric
from dflash_flow.items import StepReport, TargetFeatures
from dflash_flow.model import training
from dflash_flow.model.spec import ModelSpec, UsesModel, model_of
from dflash_flow.services import CheckpointPayload, CheckpointSource, services_of

log = logging.getLogger(__name__)


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
@training.include_knobs
class DrafterStep(Stage, CheckpointSource, UsesModel):
    """Trains the DFlash drafter on target features; checkpoints; exports the inference checkpoint."""

    preload = staticmethod(training.preload)
    input_type = TargetFeatures
    output_type = StepReport
    stage_metrics = (DrafterStepMetrics,)
    singleton = True
    moved_fields: ClassVar[dict[str, str]] = {
        "target": "model.target", "tokenizer": "model.tokenizer", "trust_remote_code": "model.trust_remote_code",
        "num_layers": "model.num_draft_layers", "target_layer_ids": "model.target_layer_ids",
        "block_size": "model.block_size", "mask_token_id": "model.mask_token_id",
    }

    _run: Any = attrs.field(default=None, init=False)  # model.training.DrafterRun, from setup on
    _batch_log: Any = attrs.field(default=None, init=False)

    def model_problems(self, spec: ModelSpec, devices: list[list[str]]) -> list[tuple[str, str]]:  # noqa: ARG002
        return training.drafter_problems(self, spec)

    def setup(self, ctx) -> None:
        self._ctx, self._services, self._stopping = ctx, services_of(ctx), False
        self._spec = spec = model_of(ctx)
        spec.require_target(f"stage '{ctx.name}'")
        self._run = run = training.DrafterRun.build(self, spec, device=ctx.device,
                                                    seed=ctx.shared_seed_for(0, "init"), busy=ctx.busy)
        if self.heldout_data is not None and ctx.rank == 0 and not run.trainer.sharded:
            from dflash_flow.embedded import embedded_walk_data

            with ctx.busy("preparing the held-out sample (one target forward per conversation)"):
                run.prepare_heldout(spec, self.heldout_data, embedded_walk_data, device=ctx.device,
                                    who=f"stage '{ctx.name}'")
        if self.record_batches:
            self._batch_log = self._services.open_batch_log(ctx)
        self._m = ctx.metrics.declare(DrafterStepMetrics)

    def process(self, feats: TargetFeatures):
        """Train one micro-batch; after an optimizer step, report it, then checkpoint when due. A stop drops the
        later batches (and upstream's); under torchrun the ranks agree on the step after which all stop."""
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
        return training.parameter_count(self, spec)

    def output_dirs(self) -> list[str]:
        return [self.export_dir]

    def input_paths(self) -> list[tuple[str, str, str]]:
        from dflash_flow.util import local_dirs

        return local_dirs(("init_from", self.init_from))

    @property
    def inputs_per_step(self) -> int:
        return self.grad_accum

    def checkpoint_payload(self, epoch_end: bool = False) -> CheckpointPayload:
        return CheckpointPayload(**self._run.checkpoint(), stage=self._ctx.name, stage_state=self.state_dict())

    def get_state(self) -> dict[str, Any]:
        return training.DrafterRun.fresh_state() if self._run is None else self._run.state()

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
        artifacts = {}
        if ctx.rank == 0:  # one export per job (the weights are the same on every rank)
            artifacts["drafter"] = run.export(state, self._services.exporter, self.export_dir,
                                              output_dir=ctx.output_dir, target=self._spec.target,
                                              check_stop=ctx.check_stop)
        return (StepReport(step=run.trainer.step, epoch=run.position.epoch, meta=None, metrics={}, final=True,
                           artifacts=artifacts),)

    def teardown(self) -> None:
        if self._batch_log is not None:
            self._batch_log.close()
            self._batch_log = None
