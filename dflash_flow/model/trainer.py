"""The drafter's training loop (the DFlash loss per micro-batch, accumulation, AdamW on fp32 masters, step
reports; a resumed run continues bit for bit on the CPU, not on CUDA: docs/gpu.md), and building the drafter
it trains (fresh or ``init_from``) with its shape-dependent defaults (``gamma``, the mask token)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from dflash_flow.core.stage import StateVersion
from dflash_flow.items import TargetFeatures
from dflash_flow.model.device import take, to_host
from dflash_flow.model.dflash2 import drafter_from_config, drafter_variant, variant_config
from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.lossstats import StepSums
from dflash_flow.model.objective import DFlashObjective
from dflash_flow.model.optim import (
    AllReduceClock,
    GradientAccumulator,
    NonFiniteError,
    allreduce_mean,
    build_optimizer,
    data_parallel,
    is_distributed,
    planned_updates,
)
from dflash_flow.model.strategies import DrafterShape, TrainerConfig

log = logging.getLogger("dflash_flow")
STATE_VERSION = 1
TRAINER_STATE = StateVersion("trainer state", STATE_VERSION)


# -- building the drafter: fresh for a target's config, or loaded from an exported directory
# Loss decay by block size from the DFlash recipes (gamma 7 for B=16, 5 for B=10, 4 for B=8).
_GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    if block_size in _GAMMA_BY_BLOCK:
        return _GAMMA_BY_BLOCK[block_size]
    # Between the published points, keep gamma proportional to the block size (7/16 per slot).
    return max(1.0, round(block_size * 7.0 / 16.0, 2))


def resolve_mask_token_id(explicit: int | None, tokenizer_path: str | None, vocab_size: int) -> int:
    """Explicit id, else the tokenizer's mask token, else the first embedding row past the tokenizer,
    else its pad token (SpecForge's order; the id is written into the exported config)."""
    if explicit is not None:
        return explicit
    if tokenizer_path:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        if getattr(tok, "mask_token_id", None) is not None:
            return int(tok.mask_token_id)
        if len(tok) < vocab_size:
            return len(tok)
        if tok.pad_token_id is not None:
            return int(tok.pad_token_id)
    raise ValueError(
        "cannot choose a mask token: set mask_token_id (the target's embedding has no free row past the "
        "tokenizer and the tokenizer has no mask or pad token)"
    )


def drafter_config(target_config: Any, shape: DrafterShape, *, mask_token_id: int) -> Any:
    """The config of a fresh drafter of ``shape`` for ``target_config``."""
    return variant_config(
        target_config, shape.variant, num_layers=shape.num_layers, block_size=shape.block_size,
        mask_token_id=mask_token_id, target_layer_ids=shape.target_layer_ids, layer_types=shape.layer_types,
        sliding_window=shape.sliding_window,
    )


def build_drafter(target_config: Any, shape: DrafterShape, *, seed: int, device: str | torch.device,
                  dtype: torch.dtype, tokenizer_path: str | None = None,
                  init_from: str | Path | None = None) -> DFlashDrafter:
    """A drafter for ``target_config``: loaded from an exported directory (``init_from``), or fresh with
    weights drawn from ``seed`` under a private RNG (so nothing else in the process changes them)."""
    from dflash_flow.model.export import load_drafter

    if init_from:
        drafter = load_drafter(init_from, device=device, dtype=dtype, target_config=target_config)
        found = drafter_variant(drafter.config)
        if found != shape.variant.name:
            raise ValueError(f"init_from {init_from} holds a {found} drafter, but variant is {shape.variant.name}")
    else:
        tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
        mask_id = resolve_mask_token_id(shape.mask_token_id, tokenizer_path, int(tc.vocab_size))
        config = drafter_config(target_config, shape, mask_token_id=mask_id)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            drafter = drafter_from_config(config)
        drafter.to(device=torch.device(device), dtype=dtype)
    drafter.train()
    return drafter


def _host(t: torch.Tensor) -> torch.Tensor:
    """A batch tensor in host memory (pinned rows as they are; a device tensor is read back)."""
    return t if t.device.type == "cpu" else t.cpu()


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``, a host tensor copied without blocking (pinned rows: no stream sync)."""
    return take(t).to(device, non_blocking=True)


class DrafterTrainer:
    """Trains one drafter on target features, one micro-batch at a time; ``train_batch`` returns the metrics of
    an optimizer step when one happened (means over its micro-batches, ``grad_norm``, the next ``lr``,
    throughput), else None."""

    def __init__(self, drafter: DFlashDrafter, head: Any, config: TrainerConfig, *,
                 device: str | torch.device, dtype: torch.dtype) -> None:
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
        """A trainer of a drafter for ``target`` (its frozen head loaded under the model-load lock) on ``device``
        in ``dtype`` ("auto": bf16 on GPU, fp32 on CPU)."""
        from dflash_flow.model import MODEL_LOAD_LOCK
        from dflash_flow.model.device import resolve_dtype
        from dflash_flow.model.head import load_shared_head
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
        """Build the optimizer and schedule once the run's length is known: ``total_steps`` from the config,
        else the optimizer steps the plan makes over ``batches_ahead``, else ``ceil(planned_batches /
        grad_accum)``. After a resume (another world size, or ``extend``) the schedule is retargeted to the
        steps the run really takes, so the learning rate reaches its floor at its last step."""
        exact = None
        if batches_ahead and self.config.total_steps is None:
            exact = self.step + planned_updates(batches_ahead, self.config.grad_accum, accumulated=self.accumulator.micro)
        if self.optimizer is not None:
            if exact is not None and not self._planned:
                self._planned = True
                if exact != self.schedule.total_steps and exact > self.step:
                    log.info(
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
        self.optimizer, self.schedule = build_optimizer(self.drafter, total_steps=self.total_steps, lr=c.lr,
                                                        weight_decay=c.weight_decay,
                                                        max_grad_norm=c.max_grad_norm,
                                                        warmup_ratio=c.warmup_ratio,
                                                        min_lr_ratio=c.min_lr_ratio)
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
        """Forward and backward of one micro-batch; an optimizer step when the accumulation is complete (or
        ``force_step``). Anchors come from a CPU generator seeded with ``anchor_seed`` (the same after a resume)."""
        self.check_features(feats)
        self.plan(feats.meta.total_batches, feats.meta.batches_ahead)
        self._last_batch = feats.meta
        gen = torch.Generator()
        gen.manual_seed(anchor_seed)
        # Anchors from the host rows: the shapes they set are known without reading the device.
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
            out = self.model(_on(feats.input_ids, self.device), _on(feats.loss_mask, self.device), hidden,
                             _on(feats.attention_mask, self.device), gen, plan)
            ready = self.accumulator.backward(out.loss)
        if syncs and self.allreduce_clock is not None:
            self._allreduce_wait += self.allreduce_clock.take() or 0.0
        if not feats.meta.filler:  # a filler keeps data-parallel ranks in step; it trains nothing
            self.sums.add(out, feats.meta)
        if not (ready or force_step):
            return None
        return self._optimizer_step()

    def _reduce_masters(self, grads: list[torch.Tensor]) -> None:
        """The masters' gradients averaged over the ranks in fp32, timed as the step's all-reduce wait."""
        clock = self.allreduce_clock
        if clock is not None:
            clock.handed = clock.stamp()
        allreduce_mean(grads)
        if clock is not None:
            clock.done = clock.stamp()
            self._allreduce_wait += clock.take() or 0.0

    @property
    def fp32_accumulation(self) -> bool:
        """Whether the step's micro-batch gradients are summed in the fp32 masters."""
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
        log.warning("skipping the update of non-finite %s (on_nonfinite: skip)", where)

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
        metrics.update(lr=float(self.schedule.get_last_lr()[0]), tokens_per_s=self.sums.tokens / dt,
                       samples_per_s=self.sums.samples / dt)
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
        """The drafter's whole state dict (under fsdp a collective; rank 0 gets full tensors on the CPU)."""
        if not self.sharded:
            return self.drafter.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.drafter, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def optimizer_state(self) -> dict[str, Any]:
        """Optimizer and schedule; mid-accumulation also the gradients and metric sums so far, so a resumed run
        completes that step exactly as an uninterrupted one would."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.schedule.state_dict()}
        if self.accumulator.micro:
            state["accumulation"] = self._accumulation_state()
        return state

    def _accumulation_state(self) -> dict[str, Any]:
        if self.sharded or self.ddp:
            # Data-parallel ranks stop at an agreed optimizer step (services.agree_to_stop): never in between.
            raise RuntimeError("a data-parallel trainer cannot checkpoint in the middle of an accumulation")
        grads = to_host({name: t.grad.detach() if t.grad.is_cuda else t.grad.detach().clone()
                         for name, t in self._grad_holders() if t.grad is not None})
        return {"micro": self.accumulator.micro, "grads": grads, **self.sums.state()}

    def _grad_holders(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor whose ``.grad`` holds the step's partial sum: the fp32 master, else the parameter)."""
        masters = {}
        if self.fp32_accumulation:
            masters = {id(p): m for p, m in zip(self.optimizer.params, self.optimizer.masters, strict=True)}
        return [(name, masters.get(id(p), p)) for name, p in self.drafter.named_parameters()]

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
