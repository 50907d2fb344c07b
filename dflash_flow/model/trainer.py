"""The drafter's training loop: building the drafter, the DFlash loss per micro-batch, gradient
accumulation, AdamW on fp32 masters under warmup + cosine, step reports, and the state that makes a
resumed run continue bit for bit on the CPU. On CUDA a resume continues from exactly the saved state, but the
steps after it are not bit-identical to an uninterrupted run's: the attention kernels' backward (and
atomics-based reductions) are not deterministic there, and nothing sets ``torch.use_deterministic_algorithms``
(docs/gpu.md).

Pure model code, no pipeline runtime: the ``DrafterStep`` stage adapts it to the DAG (items in, step
reports out, checkpoints through the run services), tests drive it directly, and data-parallel training
wraps its loss module (``model.parallel``). Building the drafter: ``model.build``; the loss: ``model.objective``.
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any

import torch

from dflash_flow.core.versioned import StateVersion
from dflash_flow.items import TargetFeatures
from dflash_flow.model.build import build_drafter, default_gamma, drafter_config, parameter_count
from dflash_flow.model.device import take, to_host
from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.lossstats import StepSums
from dflash_flow.model.objective import DFlashObjective
from dflash_flow.model.optim import (
    GradientAccumulator,
    NonFiniteError,
    allreduce_mean,
    build_optimizer,
    planned_updates,
)
from dflash_flow.model.parallel import AllReduceClock, data_parallel, is_distributed
from dflash_flow.model.recipe import DrafterShape, TrainerConfig

# The drafter's builders and recipe types are re-exported: the trainer is where its callers find them.
__all__ = [
    "DFlashObjective", "DrafterShape", "DrafterTrainer", "TrainerConfig", "build_drafter", "default_gamma",
    "drafter_config", "parameter_count",
]

STATE_VERSION = 1
TRAINER_STATE = StateVersion("trainer state", STATE_VERSION)


def _host(t: torch.Tensor) -> torch.Tensor:
    """A batch tensor in host memory (the Padder's pinned rows as they are; a device tensor is read back)."""
    return t if t.device.type == "cpu" else t.cpu()


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, a host tensor copied without blocking (pinned rows: no stream sync)."""
    return take(t).to(device, non_blocking=True)



class DrafterTrainer:
    """Trains one drafter on target features, one micro-batch at a time.

    ``train_batch`` returns the metrics of an optimizer step when one happened (every ``grad_accum``
    micro-batches, or early with ``force_step``, e.g. at the end of an epoch), else None. Metrics are means
    over the step's micro-batches, plus ``grad_norm``, ``lr`` (of the next update), throughput since the
    previous step and ``total_steps``.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: Any,
        config: TrainerConfig,
        *,
        device: str | torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.drafter = drafter
        self.head = head  # the target's frozen embedding and LM head (model.head.SharedHead)
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.gamma = config.gamma if config.gamma is not None else default_gamma(drafter.block_size)
        self.objective = DFlashObjective(drafter, head, gamma=self.gamma, config=config)
        ddp_timed = config.time_allreduce and config.data_parallel == "ddp" and is_distributed()
        self.allreduce_clock = AllReduceClock(cuda=self.device.type == "cuda") if ddp_timed else None
        self._allreduce_wait = 0.0
        self.model = data_parallel(self.objective, config.data_parallel, self.device, self.allreduce_clock)
        self.ddp = hasattr(self.model, "no_sync")
        self.accumulator = GradientAccumulator(config.grad_accum)
        self.optimizer: Any = None
        self.schedule: Any = None
        self.step = 0
        self.total_steps = config.total_steps
        self._planned = False  # the schedule's length checked against the plan of the batches (see plan)
        self.extend = False  # a resume that extends the run re-plans the schedule instead of re-spanning it
        self.sums = StepSums(self.device)  # the step's statistics, read once at the step
        self.position_accuracy: tuple[float, ...] = ()  # the last step's, per block slot k = 1..B-1
        self._last_step_t = time.perf_counter()
        self._last_batch: Any = None  # meta of the last micro-batch trained (named by a non-finite step)

    @classmethod
    def for_target(cls, target: Any, shape: DrafterShape, config: TrainerConfig, *, device: str, dtype: str,
                   seed: int, tokenizer_path: str | None = None, trust_remote_code: bool = False,
                   init_from: str | None = None) -> DrafterTrainer:
        """A trainer of a drafter for ``target`` (its config read, its frozen head loaded, under the model-load
        lock), run on ``device`` (this thread's collectives too) in ``dtype`` ("auto": bf16 on GPU, fp32 on CPU)."""
        from dflash_flow.model.device import resolve_dtype
        from dflash_flow.model.head import load_shared_head
        from dflash_flow.model.loading import MODEL_LOAD_LOCK
        from dflash_flow.model.target import load_target_config

        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))  # this thread's collectives run on its GPU
        torch_dtype = resolve_dtype(dtype, device)
        with MODEL_LOAD_LOCK:
            target_config = load_target_config(target, trust_remote_code=trust_remote_code)
            drafter = build_drafter(target_config, shape, seed=seed, device=device, dtype=torch_dtype,
                                    tokenizer_path=tokenizer_path, init_from=init_from)
            head = load_shared_head(target, device, torch_dtype, trust_remote_code=trust_remote_code)
        return cls(drafter, head, config, device=device, dtype=torch_dtype)

    def config_json(self) -> str:
        """The drafter's exported ``config.json`` text (a checkpoint carries it)."""
        import json

        from dflash_flow.model.export import drafter_config_dict

        return json.dumps(drafter_config_dict(self.drafter.config), indent=2, sort_keys=True)

    # -- schedule ----------------------------------------------------------------------------------
    def plan(self, planned_batches: int, batches_ahead: tuple[int, ...] = ()) -> None:
        """Build the optimizer and schedule once the run's length is known: ``total_steps`` from the
        config, else the optimizer steps the plan makes (``optim.planned_updates`` over ``batches_ahead``,
        the batches this rank still takes per epoch), else ``ceil(planned_batches / grad_accum)``.

        On the first batch after a resume the plan is counted again: a run resumed at another world size
        (or extended, ``extend=True``) takes another number of steps, and the schedule is retargeted to it
        (``WarmupCosineSchedule.retarget``: re-spanned, or re-planned when extended), so the learning rate
        reaches its floor at the last step the run really takes.
        """
        exact = None
        if batches_ahead and self.config.total_steps is None:
            exact = self.step + planned_updates(batches_ahead, self.config.grad_accum, accumulated=self.accumulator.micro)
        if self.optimizer is not None:
            if exact is not None and not self._planned:
                self._planned = True
                if exact != self.schedule.total_steps and exact > self.step:
                    import logging

                    logging.getLogger("dflash_flow").info(
                        "the learning-rate schedule now ends at step %d (was %d): %s", exact, self.schedule.total_steps,
                        "re-planned for the extended run" if self.extend else "the rest of the decay spread over the steps left")
                    self.schedule.retarget(exact, respan=not self.extend)
                    self.total_steps = exact
            return
        if self.total_steps is None:
            if exact is not None:
                self.total_steps = max(1, exact)
            elif planned_batches <= 0:
                raise ValueError("DrafterStep: set total_steps (the batches carry no plan size)")
            else:
                self.total_steps = max(1, math.ceil(planned_batches / self.config.grad_accum))
        self._planned = exact is not None
        from dflash_flow.model.compile_plan import plan_steps  # compile: auto weighs the planned steps

        plan_steps(self.drafter, (self.total_steps - self.step) * self.config.grad_accum)
        c = self.config
        self.optimizer, self.schedule = build_optimizer(
            self.drafter,
            total_steps=self.total_steps,
            lr=c.lr,
            weight_decay=c.weight_decay,
            max_grad_norm=c.max_grad_norm,
            warmup_ratio=c.warmup_ratio,
            min_lr_ratio=c.min_lr_ratio,
        )
        if self.optimizer.uses_masters and not self.sharded:
            # bf16 weights: each micro-batch's gradient is summed into the fp32 masters; under DDP the ranks then
            # average those sums in fp32 at the step (every backward runs under no_sync), not bf16 buckets.
            self.optimizer.accumulate_in_fp32(reduce=self._reduce_masters if self.ddp else None)

    # -- training ----------------------------------------------------------------------------------
    def check_features(self, feats: TargetFeatures) -> None:
        if feats.target_layer_ids and list(feats.target_layer_ids) != list(self.drafter.target_layer_ids):
            raise ValueError(
                f"TargetForward emits layers {list(feats.target_layer_ids)} but the drafter uses "
                f"{self.drafter.target_layer_ids}; set the same target_layer_ids (or num_layers) on both stages"
            )

    def train_batch(self, feats: TargetFeatures, *, anchor_seed: int, force_step: bool = False) -> dict[str, float] | None:
        """Forward and backward of one micro-batch; an optimizer step when the accumulation is complete
        (or ``force_step``). Anchors come from a CPU generator seeded with ``anchor_seed``: the same batch
        gets the same anchors after a resume and on every device."""
        self.check_features(feats)
        self.plan(feats.meta.total_batches, feats.meta.batches_ahead)
        self._last_batch = feats.meta
        gen = torch.Generator()
        gen.manual_seed(anchor_seed)
        # Anchors from the host rows: the shapes they set are known without reading the device (one read per
        # optimizer step, in _optimizer_step; a loss mask that arrives on the device is read back here).
        plan = self.objective.plan_on_host(_host(feats.loss_mask), _host(feats.attention_mask), gen)
        # Data parallel: gradients are all-reduced on the micro-batch that completes the step only; with fp32
        # accumulation (bf16 weights) by the optimizer at the step, so DDP never reduces in the backward.
        syncs = (force_step or self.accumulator.next_is_last) and not self.fp32_accumulation
        # Made on a target replica's own CUDA stream (model.features): marked in use on ours before we read them.
        hidden = take(feats.hidden_states).to(self.device, self.dtype)
        if self.objective.needs_input_grad:
            # FSDP registers its gradient reduction on the module inputs that require grad; without one
            # the ranks' gradients are never reduced. The price: one extra matmul (d loss / d features).
            hidden = hidden.detach().requires_grad_(True)
        if self.sharded:  # FSDP: reduce-scatter on the step's last micro-batch only (it did on every one)
            self.model.set_requires_gradient_sync(force_step or self.accumulator.next_is_last)
        with self.model.no_sync() if self.ddp and not syncs else contextlib.nullcontext():
            out = self.model(
                _on(feats.input_ids, self.device),
                _on(feats.loss_mask, self.device),
                hidden,
                _on(feats.attention_mask, self.device),
                gen,
                plan,
            )
            ready = self.accumulator.backward(out.loss)
        if syncs and self.allreduce_clock is not None:
            self._allreduce_wait += self.allreduce_clock.take() or 0.0
        if not feats.meta.filler:  # a filler keeps data-parallel ranks in step; it trains nothing
            self.sums.add(out, feats.meta)
        if not (ready or force_step):
            return None
        return self._optimizer_step()

    def _reduce_masters(self, grads: list[torch.Tensor]) -> None:
        """The masters' gradients averaged over the ranks in fp32 (``optim.allreduce_mean``), timed as the step's
        all-reduce wait (``allreduce_wait_s``): every backward ran under no_sync, so this is all the step waits."""
        clock = self.allreduce_clock
        if clock is not None:
            clock.handed = clock.stamp()
        allreduce_mean(grads)
        if clock is not None:
            clock.done = clock.stamp()
            self._allreduce_wait += clock.take() or 0.0

    @property
    def fp32_accumulation(self) -> bool:
        """Whether the step's micro-batch gradients are summed in the fp32 masters (``MasterAdamW.accumulate_in_fp32``)."""
        return self.optimizer is not None and self.optimizer.fp32_accumulation

    def _nonfinite(self, what: str) -> None:
        """A non-finite loss or gradient norm at the step being taken: stop (raise) or skip (warn)."""
        meta = self._last_batch
        batch = "no batch"
        if meta is not None:
            ids = list(meta.sample_ids)
            shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
            batch = f"batch {meta.index} of epoch {meta.epoch}, samples [{shown}]"
        where = f"{what} at optimizer step {self.step + 1} ({batch})"
        if self.config.on_nonfinite == "stop":
            raise NonFiniteError(
                f"non-finite {where}: the training diverged; the update was not applied. Lower lr "
                f"(now {self.config.lr:g}) or max_grad_norm, check that batch's data, or set on_nonfinite: skip"
            )
        import logging

        logging.getLogger("dflash_flow").warning("skipping the update of non-finite %s (on_nonfinite: skip)", where)

    def _optimizer_step(self) -> dict[str, float]:
        grad_norm, sums, pos_sums = self.sums.read(self.optimizer.prepare())
        self.optimizer.apply(math.isfinite(grad_norm))
        if self.allreduce_clock is not None:
            self._allreduce_wait += self.allreduce_clock.settle()  # CUDA events, done by the read above
        n = max(self.sums.counted, 1)
        mean_loss = sums.get("loss", 0.0) / n
        if not math.isfinite(grad_norm) or not math.isfinite(mean_loss):
            self._nonfinite(f"loss ({mean_loss})" if not math.isfinite(mean_loss) else f"gradient norm ({grad_norm})")
        self.schedule.step()
        self.step += 1
        self.accumulator.reset()
        now = time.perf_counter()
        dt = max(now - self._last_step_t, 1e-9)
        # A skipped non-finite step reports no NaN (reports and plots refuse NaN): its values are left out.
        metrics = {k: v / n for k, v in sums.items() if math.isfinite(v)}
        if "acceptance_length" in metrics:
            metrics["sim_accept_len"] = metrics.pop("acceptance_length")
        if math.isfinite(grad_norm):
            metrics["grad_norm"] = grad_norm
        metrics.update(
            lr=float(self.schedule.get_last_lr()[0]),
            tokens_per_s=self.sums.tokens / dt,
            samples_per_s=self.sums.samples / dt,
        )
        # The step's accuracy per block slot (k = 1..B-1): a sequence of its own, not keys in the metrics.
        pos = [v / n for v in pos_sums]
        self.position_accuracy = tuple(pos) if all(math.isfinite(v) for v in pos) else ()
        if self.allreduce_clock is not None:
            metrics["allreduce_wait_s"] = self._allreduce_wait
            metrics["allreduce_wait_frac"] = min(1.0, self._allreduce_wait / dt)  # of the step's wall time
            self._allreduce_wait = 0.0
        self.sums.reset()
        self._last_step_t = now
        return metrics

    def flush(self) -> None:
        """A trailing partial accumulation still updates the weights (its metrics are dropped)."""
        if self.accumulator.micro and self.optimizer is not None:
            if not math.isfinite(float(self.optimizer.step())):
                self._nonfinite("gradient norm of the last partial accumulation")
            self.schedule.step()
            self.step += 1
            self.accumulator.reset()
            self.sums.sum, self.sums.counted = None, 0  # (tokens and samples go to the next step's throughput)

    # -- state -------------------------------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        return self.config.data_parallel == "fsdp" and self.model is self.objective and is_distributed()

    def full_model_state(self) -> dict[str, torch.Tensor]:
        """The drafter's whole state dict (under fsdp a collective: every rank must call it; rank 0 gets
        full tensors on the CPU)."""
        if not self.sharded:
            return self.drafter.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def model_state(self) -> dict[str, torch.Tensor]:
        return self.full_model_state()

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer and schedule; mid-accumulation (a stop between the micro-batches of a step) also the
        partial accumulation: the gradients summed so far and the step's metric sums, so that a resumed
        run completes that step exactly as an uninterrupted one would."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.schedule.state_dict()}
        if self.accumulator.micro:
            state["accumulation"] = self._accumulation_state()
        return state

    def _accumulation_state(self) -> dict[str, Any]:
        if self.sharded or self.ddp:
            # Data-parallel ranks stop at an agreed optimizer step (services.agree_to_stop): never in between.
            raise RuntimeError("a data-parallel trainer cannot checkpoint in the middle of an accumulation")
        grads = to_host({name: g.detach() if g.is_cuda else g.detach().clone() for name, g in self._partial_grads()})
        return {"micro": self.accumulator.micro, "grads": grads, **self.sums.state()}

    def _grad_holders(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor whose ``.grad`` holds the step's partial sum): the fp32 master under fp32 accumulation,
        else the parameter."""
        masters = {}
        if self.fp32_accumulation:
            masters = {id(p): m for p, m in zip(self.optimizer.params, self.optimizer.masters, strict=True)}
        return [(name, masters.get(id(p), p)) for name, p in self.drafter.named_parameters()]

    def _partial_grads(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, t.grad) for name, t in self._grad_holders() if t.grad is not None]

    def _load_accumulation(self, acc: dict[str, Any]) -> None:
        holders = dict(self._grad_holders())
        unknown = sorted(set(acc["grads"]) - set(holders))
        if unknown:
            raise ValueError(f"the checkpoint's partial accumulation has gradients of unknown parameters: {unknown[:3]}")
        for name, t in holders.items():
            g = acc["grads"].get(name)
            t.grad = None if g is None else g.to(device=t.device, dtype=t.dtype).clone()
        self.accumulator.micro = int(acc["micro"])
        self.sums.load(acc)

    def restore(self, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
        """Weights and optimizer from a checkpoint (after ``load_state_dict``)."""
        if self.sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(self.drafter, model_state, options=StateDictOptions(full_state_dict=True))
        else:
            self.drafter.load_state_dict(model_state)
        self.plan(0 if self.total_steps else 1)
        self.optimizer.load_state_dict(optimizer_state["optimizer"])
        self.schedule.load_state_dict(optimizer_state["scheduler"])
        acc = optimizer_state.get("accumulation")
        if acc:
            self._load_accumulation(acc)
        elif self.accumulator.micro:
            raise ValueError("the checkpoint says it stopped mid-accumulation but holds no partial accumulation")

    def state_dict(self) -> dict[str, Any]:
        return TRAINER_STATE.tag({
            "step": self.step,
            "total_steps": self.total_steps,
            "accumulator": self.accumulator.state_dict(),
        })

    def load_state_dict(self, state: dict[str, Any]) -> None:
        TRAINER_STATE.check(state)
        self.step = int(state["step"])
        self.total_steps = state.get("total_steps") or self.total_steps
        self.accumulator.load_state_dict(state["accumulator"])
