"""DrafterStep: adapts ``model.trainer.DrafterTrainer`` to the pipeline. Target features in, step
reports out; the data position it has reached; checkpoints through the run services; the final export."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path, PurePath
from typing import Any, ClassVar, Literal

import attrs

from dflash_flow.core import Stage, cfg
from dflash_flow.core.fields import field_errors, include, values_of
from dflash_flow.items import StepReport, TargetFeatures
from dflash_flow.model.recipe import NOT_IN_YAML, DrafterShape, TrainerConfig
from dflash_flow.model.spec import ModelSpec, UsesModel, model_of
from dflash_flow.model.strategies import OBJECTIVES, VARIANTS, misplaced_knobs, objective_of, variant_of
from dflash_flow.model.threads import ThreadSwitchWatch
from dflash_flow.services import CheckpointPayload, CheckpointSource, services_of

log = logging.getLogger(__name__)

#: The drafter's shape fields that the model spec declares once (``model:``), not the stage.
IN_MODEL = ("num_layers", "block_size", "mask_token_id", "target_layer_ids")


def check_inside_output_dir(field: str, value: str) -> None:
    """A stage's output path is relative to the run's output directory and must stay inside it: a YAML
    cannot make the run write elsewhere (the user chooses where a run writes with ``output_dir``)."""
    p = PurePath(value)
    if not value or p.is_absolute() or value.startswith("~") or ".." in p.parts:
        raise ValueError(
            f"{field} must be a relative path inside output_dir (no '..', not absolute), got {value!r}; "
            "to write somewhere else, set output_dir"
        )


@attrs.define(kw_only=True, eq=False)
@include(DrafterShape, TrainerConfig, *VARIANTS.values(), *OBJECTIVES.values(), exclude=(*NOT_IN_YAML, *IN_MODEL))
class DrafterStep(Stage, CheckpointSource, UsesModel):
    """Trains the DFlash drafter on target features; checkpoints; exports the inference checkpoint."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.model.export  # noqa: F401
        import dflash_flow.model.target  # noqa: F401
        import dflash_flow.model.trainer  # noqa: F401

    input_type = TargetFeatures
    output_type = StepReport
    singleton = True
    moved_fields: ClassVar[dict[str, str]] = {
        "target": "model.target", "tokenizer": "model.tokenizer", "trust_remote_code": "model.trust_remote_code",
        "num_layers": "model.num_draft_layers", "target_layer_ids": "model.target_layer_ids",
        "block_size": "model.block_size", "mask_token_id": "model.mask_token_id",
    }

    # The shape's knobs (model.recipe.DrafterShape), the recipe's (TrainerConfig) and every strategy's
    # (model.strategies) are included below: declared there once, with their docs and bounds.
    variant: Literal["dflash", "dflash2"] = cfg(
        "dflash", choices=tuple(VARIANTS),
        doc="dflash, or dflash2: in-block convolutions and a candidate selector (docs/dflash2.md).",
    )
    objective: Literal["dflash", "variable_prefix"] = cfg(
        "dflash", choices=tuple(OBJECTIVES),
        doc="dflash: one real token per block; variable_prefix: D2SD VP-Drafter, each block shows l real tokens, "
        "only the masked suffix is supervised (docs/objectives.md).",
    )
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
    # The held-out walk draws no random numbers and leaves the weights as they were: result=False.
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

    # Where the data stream has got to (state; the initial values are a fresh stage's state).
    _epoch: int = attrs.field(default=0, init=False)
    _epoch_done: bool = attrs.field(default=False, init=False)  # the last batch trained ended its epoch
    _plan_state: dict[str, Any] | None = attrs.field(default=None, init=False)  # the Interleaver's, after it
    _total_consumed: int = attrs.field(default=0, init=False)  # batches trained on in the whole run (this rank)
    _fallback_at: int | None = attrs.field(default=None, init=False)  # batches consumed when threads went back
    _initial_threads: int | None = attrs.field(default=None, init=False)
    _trained: int = attrs.field(default=0, init=False)  # batches trained since the last checkpoint (this process)
    _trainer: Any = attrs.field(default=None, init=False)
    _batch_log: Any = attrs.field(default=None, init=False)
    _probe: Any = attrs.field(default=None, init=False)  # model.heldout.HeldoutProbe, when heldout_data is set
    _planned_total: int | None = attrs.field(default=None, init=False)  # the plan's batches for this rank

    @objective.validator
    def _check_strategies(self, _attribute: attrs.Attribute, _value: str) -> None:
        """A knob of another strategy than the chosen ones (``strategies.misplaced_knobs``), located at its own
        field (runs once every field is set); the checks against the block size need the model spec."""
        problems = misplaced_knobs(self)
        if problems:
            raise field_errors(type(self), problems)

    def _shape(self, spec: ModelSpec):
        ids = spec.explicit_layer_ids
        return values_of(DrafterShape, self, variant=variant_of(self), num_layers=spec.num_draft_layers,
                         block_size=spec.block_size, mask_token_id=spec.mask_token_id,
                         target_layer_ids=list(ids) if ids is not None else None)

    def _trainer_config(self):
        """The trainer's recipe: its fields are this stage's (included from ``TrainerConfig``)."""
        return values_of(TrainerConfig, self, exclude=("time_allreduce",), variant=variant_of(self),
                         objective=objective_of(self))

    def model_problems(self, spec: ModelSpec, devices: list[list[str]]) -> list[tuple[str, str]]:  # noqa: ARG002
        """(field, message): a target declared; the strategies against the block size; DFlash 2 settings that do
        not fit the target (group size against its hidden size, top-k against its vocabulary); a drafter to
        start from made for this target's hidden size and this block size. Setup would fail the same way."""
        if spec.target is None:
            return [("model.target", "DrafterStep needs the target (its embedding and LM head are shared): set "
                                     "model.target")]
        blocks = [*variant_of(self).block_problems(spec.block_size), *objective_of(self).block_problems(spec.block_size)]
        out = [("model.block_size" if f == "block_size" else f, m) for f, m in blocks]
        facts = spec.facts
        if facts is None:
            return out
        if self.variant == "dflash2" and not self.init_from:
            out += [("model.block_size" if f == "block_size" else f, m) for f, m in variant_of(self).problems(
                hidden_size=facts.hidden_size, vocab_size=facts.vocab_size, block_size=spec.block_size)]
        return out + self._init_from_problems(spec)

    def _init_from_problems(self, spec: ModelSpec) -> list[tuple[str, str]]:
        """A drafter to start from (``init_from``) was made for a target of this hidden size and this block size."""
        if not self.init_from:
            return []
        try:
            d = json.loads((Path(self.init_from).expanduser() / "config.json").read_text())
        except (OSError, ValueError):
            return []  # a missing directory is a path problem; an unreadable one, setup's
        out = []
        hidden = d.get("hidden_size")
        if isinstance(hidden, int) and hidden != spec.facts.hidden_size:
            out.append(("init_from", f"the drafter in {self.init_from} has hidden_size {hidden}, the target "
                                     f"{spec.facts.hidden_size}: it was made for another target"))
        block = (d.get("dflash_config") or {}).get("block_size", d.get("block_size"))
        if isinstance(block, int) and block != spec.block_size:
            out.append(("model.block_size", f"block_size {spec.block_size}, but the drafter in {self.init_from} was "
                                            f"made with block_size {block}"))
        return out

    # -- lifecycle --------------------------------------------------------------------------------
    def setup(self, ctx) -> None:
        import torch

        from dflash_flow.model.head import load_shared_head
        from dflash_flow.model.loading import MODEL_LOAD_LOCK
        from dflash_flow.model.target import load_target_config, resolve_dtype
        from dflash_flow.model.trainer import DrafterTrainer, build_drafter

        self._threads = None
        self._thread_watch = ThreadSwitchWatch()
        self._set_threads(epoch=0)
        if ctx.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(ctx.device))  # this thread's collectives run on its GPU
        self._ctx = ctx
        self._services = services_of(ctx)
        self._stopping = False
        dtype = resolve_dtype(self.dtype, ctx.device)
        self._spec = model_spec = model_of(ctx)
        spec = model_spec.require_target(f"stage '{ctx.name}'")
        tok_path = model_spec.tokenizer
        trust = model_spec.trust_remote_code
        with MODEL_LOAD_LOCK, ctx.busy("building the drafter and loading the target's head"):
            target_config = load_target_config(spec, trust_remote_code=trust)
            drafter = build_drafter(
                target_config, self._shape(model_spec), seed=ctx.shared_seed_for(0, "init"), device=ctx.device,
                dtype=dtype, tokenizer_path=tok_path, init_from=self.init_from,
            )
            head = load_shared_head(spec, ctx.device, dtype, trust_remote_code=trust)
        self._trainer = DrafterTrainer(drafter, head, self._trainer_config(), device=ctx.device, dtype=dtype)
        self._t_start = time.perf_counter()
        self._last_probe: tuple[int, float] | None = None  # (step, perf_counter) of the last measurement
        if self.heldout_data is not None and ctx.rank == 0 and not self._trainer.sharded:
            with MODEL_LOAD_LOCK, ctx.busy("preparing the held-out sample (one target forward per conversation)"):
                self._probe = self._prepare_probe(spec, tok_path, drafter, dtype)
        if self.record_batches:
            self._batch_log = self._services.open_batch_log(ctx)
        m = ctx.metrics
        self._m_steps = m.counter("steps", "steps", "Optimizer steps")
        self._m_tokens = m.counter("tokens", "tokens", "Real tokens trained on")
        self._m_samples = m.counter("samples", "samples", "Samples trained on")
        self._m_loss = m.gauge("loss", "nats", "Last step's loss")
        self._m_step_s = m.summary("step_s", "s", "Seconds of compute per micro-batch")
        self._m_probe_s = m.counter("heldout_probe_s", "s", "Seconds spent measuring the held-out walk")
        self._m_threads = m.gauge("torch_threads", "threads", "The drafter's torch intra-op threads (CPU; "
                                  "torch_threads_after_first_epoch, threads_fallback)")

    def _set_threads(self, epoch: int) -> None:
        """This thread's torch intra-op threads for a batch of ``epoch``: a function of the epoch and of the
        batch the threads went back at (``threads_fallback``, kept in the state), so a resumed run computes
        each step with the threads the uninterrupted run used."""
        import torch

        if self._initial_threads is None:
            self._initial_threads = torch.get_num_threads()  # the thread's own setting before any switch
        later = self.torch_threads_after_first_epoch
        fell_back = self._fallback_at is not None and self._total_consumed >= self._fallback_at
        want = later if later and epoch >= 1 and not fell_back else self._base_threads
        if want and want != self._threads:
            torch.set_num_threads(want)
            if self._threads is not None:
                self._thread_watch.switched(self._threads, want)
            self._threads = want

    @property
    def _base_threads(self) -> int | None:
        """The threads before any switch: ``torch_threads``, else what the thread had."""
        return self.torch_threads or self._initial_threads

    def _watch_threads(self, step_s: float) -> None:
        """After each step: the thread-switch watch; with ``threads_fallback``, its warning also sends the
        rest of the run back to ``torch_threads`` (from the next batch on)."""
        warning = self._thread_watch.observe(step_s)
        if not warning:
            return
        if self.threads_fallback and self.torch_threads_after_first_epoch and self._fallback_at is None:
            self._fallback_at = self._total_consumed
            back = self._base_threads
            warning += (f"; going back to {back} torch thread{'s' if back != 1 else ''} from batch "
                        f"{self._total_consumed} on, for the rest of the run (threads_fallback)")
        log.warning("%s: %s", self._ctx.name, warning)

    def _prepare_probe(self, spec: Any, tok_path: str | None, drafter: Any, dtype: Any):
        """The fixed held-out sample: the first ``heldout_limit`` conversations, the target's features over
        them (the target is loaded for this and freed)."""
        from transformers import AutoTokenizer

        from dflash_flow.data.chat import stop_token_ids
        from dflash_flow.embedded import embedded_walk_data
        from dflash_flow.model.evaluation import read_walk_conversations
        from dflash_flow.model.heldout import HeldoutProbe
        from dflash_flow.model.target import load_target

        if self.heldout_data == "embedded" and not self._spec.is_embedded:
            raise ValueError(f"stage '{self._ctx.name}': heldout_data 'embedded' holds the embedded target's "
                             "replies; with another target, give a JSONL of that target's own replies")
        if tok_path is None:
            raise ValueError(f"stage '{self._ctx.name}': heldout_data needs a tokenizer (set model.tokenizer)")
        path = embedded_walk_data() if self.heldout_data == "embedded" else Path(self.heldout_data)
        tokenizer = AutoTokenizer.from_pretrained(tok_path, local_files_only=True)
        conversations = read_walk_conversations(path, tokenizer, self.heldout_limit, stop_token_ids(tokenizer))
        target = load_target(spec, device=self._ctx.device, dtype=dtype, trust_remote_code=self._spec.trust_remote_code)
        try:
            return HeldoutProbe.prepare(target, conversations, horizon=self.heldout_horizon,
                                        layer_ids=drafter.target_layer_ids, stop_token_ids=stop_token_ids(tokenizer),
                                        device=self._ctx.device, dtype=dtype)
        finally:
            del target

    def _heldout(self, *, last: bool) -> Any:
        """The held-out walk now, when it is due: at the first step, every ``heldout_every_steps`` steps or
        ``heldout_every_s`` seconds, and at the last step."""
        if self._probe is None:
            return None
        from dflash_flow.items import HeldoutWalk

        step, now = self._trainer.step, time.perf_counter()
        if self._last_probe is not None and not last:
            prev_step, prev_t = self._last_probe
            by_steps = self.heldout_every_steps is not None and step - prev_step >= self.heldout_every_steps
            by_time = self.heldout_every_s is not None and now - prev_t >= self.heldout_every_s
            if not (by_steps or by_time):
                return None
        r = self._probe.measure(self._trainer.drafter, self._trainer.head)
        self._last_probe = (step, time.perf_counter())
        self._m_probe_s.inc(r.seconds)
        elapsed = self._services.record.elapsed_before_s + now - self._t_start  # the run's clock, across resumes
        return HeldoutWalk(tau=r.tau, elapsed_s=elapsed, probe_s=r.seconds,
                           conversations=len(self._probe.inputs), horizon=self._probe.horizon)

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
        epoch_end = meta.last_of_epoch
        self._set_threads(meta.epoch)
        if self._threads is not None:
            self._m_threads.set(self._threads)
        t0 = time.perf_counter()
        metrics = self._trainer.train_batch(
            feats, anchor_seed=self._ctx.shared_seed_for(meta.epoch, "anchors", meta.index),
            force_step=meta.ends_accumulation,
        )
        self._epoch, self._plan_state, self._epoch_done = meta.epoch, meta.plan_state, epoch_end
        self._total_consumed += 1
        self._planned_total = meta.total_batches or None
        self._trained += 1
        self._m_tokens.inc(meta.real_tokens)
        self._m_samples.inc(meta.num_samples)
        step_s = time.perf_counter() - t0
        self._m_step_s.observe(step_s)
        if not meta.filler:
            self._watch_threads(step_s)
        if self._batch_log is not None and not meta.filler:
            self._batch_log.write(meta)
        if metrics is None:
            return None
        return self._after_step(meta, metrics, epoch_end)

    def _after_step(self, meta, metrics: dict[str, float], epoch_end: bool):
        self._m_steps.inc()
        if "loss" in metrics:  # a step of filler batches only has no loss
            self._m_loss.set(metrics["loss"])
        yield StepReport(step=self._trainer.step, epoch=meta.epoch, meta=meta, metrics=metrics,
                         position_accuracy=self._trainer.position_accuracy, total_steps=self._trainer.total_steps,
                         heldout=self._heldout(last=meta.last_of_run))
        if self._services.checkpoints is not None:
            # An epoch's end and the run's last planned batch are both checkpoint points (at_epoch_end).
            if self._services.checkpoints.after_step(self, step=self._trainer.step, epoch_end=epoch_end or meta.last_of_run):
                self._trained = 0
        consensus = self._services.stop_consensus
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
        from dflash_flow.model.target import load_target_config
        from dflash_flow.model.trainer import parameter_count

        spec = spec or ModelSpec()
        target_config = None if self.init_from else load_target_config(
            spec.require_target("DrafterStep"), trust_remote_code=spec.trust_remote_code)
        return parameter_count(target_config, self._shape(spec), init_from=self.init_from)

    def output_dirs(self) -> list[str]:
        return [self.export_dir]

    def input_paths(self) -> list[tuple[str, str, str]]:
        from dflash_flow.util import local_dirs

        return local_dirs(("init_from", self.init_from))

    @property
    def inputs_per_step(self) -> int:
        return self.grad_accum

    # -- checkpoints --------------------------------------------------------------------------------
    def _position(self) -> dict[str, Any]:
        """Where the data stream continues after a resume: the epoch and the plan state of the last batch
        trained (None at the start of an epoch), and the run's total of batches on this rank."""
        if self._epoch_done:
            return {"epoch": self._epoch + 1, "plan": None, "total": self._total_consumed}
        return {"epoch": self._epoch, "plan": self._plan_state, "total": self._total_consumed}

    def checkpoint_payload(self, epoch_end: bool = False) -> CheckpointPayload:
        from dflash_flow.model.export import drafter_config_dict

        trainer = self._trainer
        return CheckpointPayload(
            step=trainer.step,
            epoch=self._epoch,
            model_state=trainer.full_model_state(),
            optimizer_state=trainer.optimizer_state(),
            data_position=self._position(),
            stage=self._ctx.name,
            stage_state=self.state_dict(),
            extra={"total_steps": trainer.total_steps},
            files={"config.json": json.dumps(drafter_config_dict(trainer.drafter.config), indent=2, sort_keys=True)},
        )

    def get_state(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "epoch_done": self._epoch_done,
            "plan": self._plan_state,
            "total_consumed": self._total_consumed,
            "threads_fallback_at": self._fallback_at,
            "trainer": self._trainer.state_dict() if self._trainer is not None else None,
        }

    def set_state(self, state: dict[str, Any]) -> None:
        self._epoch = int(state["epoch"])
        self._epoch_done = bool(state.get("epoch_done", False))
        self._plan_state = state.get("plan")
        self._total_consumed = int(state.get("total_consumed", 0))
        fallback = state.get("threads_fallback_at")
        self._fallback_at = None if fallback is None else int(fallback)
        if state.get("trainer") is not None:
            self._trainer.load_state_dict(state["trainer"])
        resume = self._services.resume
        if resume is None:
            return
        self._trainer.extend = resume.extend
        # Weights and optimizer come from the checkpoint files (safetensors / weights_only torch.load).
        self._trainer.restore(resume.model_state(str(self._trainer.device)), resume.optimizer_state())
        pos = resume.data_position
        if pos:
            # The position says where to continue; it is never an epoch's end (that is the next epoch's start).
            self._epoch, self._plan_state, self._epoch_done = int(pos["epoch"]), pos.get("plan"), False
            self._total_consumed = int(pos.get("total", self._total_consumed))

    def finish(self):
        from dflash_flow.model.export import DrafterExporter

        if self._ctx.stop_requested.is_set():
            # Stopped: the state is that of the last batch trained, a partial accumulation included (no
            # early optimizer step: a resumed run completes that step as an uninterrupted run would).
            if self._services.checkpoints is not None:
                self._services.checkpoints.at_stop(self, trained=bool(self._trained))
            return None
        self._check_trained()
        state = self._trainer.full_model_state()  # collective under fsdp: every rank takes part
        if self._ctx.rank != 0:  # one export per job, by rank 0 (the weights are the same on every rank)
            return (StepReport(step=self._trainer.step, epoch=self._epoch, meta=None, metrics={}, final=True),)
        exporter = self._services.exporter or DrafterExporter(Path(self._ctx.output_dir))
        target = self._spec.target
        done = exporter.export(self._trainer.drafter, state, self.export_dir, check_stop=self._ctx.check_stop,
                               target=target if isinstance(target, str) else None)
        self._services.record.artifacts["drafter"] = str(done.path)
        self._services.record.serve_commands = done.serve_commands
        return (StepReport(step=self._trainer.step, epoch=self._epoch, meta=None, metrics={}, final=True,
                           artifacts={"drafter": str(done.path)}),)

    def _check_trained(self) -> None:
        """A run that ends without a stop must have trained what its plan holds: no optimizer step at all,
        or a stream that ended before the plan's last batch, fails here -- before a drafter that is not
        the planned result is exported as one."""
        from dflash_flow.data.reports import DataError

        if self._trainer.step == 0:
            raise DataError(
                f"stage '{self._ctx.name}' trained no optimizer step: the pipeline delivered no batch to train on "
                "(an empty dataset, or every record skipped); nothing is exported")
        planned = self._planned_total
        if planned is not None and self._total_consumed < planned:
            raise RuntimeError(
                f"stage '{self._ctx.name}': the data stream ended after {self._total_consumed} of the {planned} "
                "batches its plan holds for this rank; nothing is exported (an upstream stage stopped early)")

    def teardown(self) -> None:
        if self._batch_log is not None:
            self._batch_log.close()
            self._batch_log = None
