"""Optimizer pieces of the drafter recipe (SpecForge's): AdamW on fp32 masters (most late updates are far below
a bf16 ulp), warmup + cosine, clipping, accumulation, each resumable exactly (``state_dict``); and data-parallel
training: DDP (its all-reduce timed by a comm hook when asked) or FSDP (one unit at the root)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from dflash_flow.core.errors import DflashFlowError
from dflash_flow.core.stage import StateVersion

STATE_VERSION = 1
OPTIMIZER_STATE = StateVersion("optimizer state", STATE_VERSION)
# Version 1 was written before the schedule ran on torch's LambdaLR (step_count, base_lrs): still read.
SCHEDULE_STATE = StateVersion("scheduler state", STATE_VERSION + 1, older=(STATE_VERSION,))
ACCUMULATOR_STATE = StateVersion("accumulator state", STATE_VERSION)


class NonFiniteError(DflashFlowError, FloatingPointError):
    """The loss or the gradient norm of a step is NaN or infinite (the training diverged); a user's problem
    (learning rate, data), so the run ends with one line naming the step and the batch."""


class MasterAdamW:
    """AdamW whose state and update live on fp32 masters (an fp32 parameter is its own); ``step()`` moves the
    gradients to the masters, clips, updates, copies the masters back into the parameters, clears gradients."""

    def __init__(self, params: Iterable[nn.Parameter], *, lr: float = 6e-4,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = 1.0, skip_nonfinite: bool = True) -> None:
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("no trainable parameters")
        self.masters = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                        for p in self.params]
        self.max_grad_norm = max_grad_norm
        self.skip_nonfinite = skip_nonfinite
        self.optimizer = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.skipped_steps = 0
        self.fp32_accumulation = False
        self.reduce: Any = None  # callable(list of fp32 gradients): averages them over the ranks in place
        self._hooks: list[Any] = []

    def accumulate_in_fp32(self, reduce: Any = None) -> None:
        """Add every backward's gradient of a bf16 parameter into its master's fp32 ``.grad`` right away (a hook,
        not summed in bf16); ``reduce`` then averages the masters' gradients over the ranks in fp32."""
        if self.fp32_accumulation:
            return
        self.fp32_accumulation, self.reduce = True, reduce
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                self._hooks.append(p.register_post_accumulate_grad_hook(_into_master(m)))

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def uses_masters(self) -> bool:
        return any(m is not p for m, p in zip(self.masters, self.params, strict=True))

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            p.grad = None
            m.grad = None

    def step(self) -> torch.Tensor:
        """One update; returns the global gradient norm before clipping (a 0-d tensor). A non-finite norm skips
        the update (counted in ``skipped_steps``). ``prepare`` then ``apply`` are the same in two halves."""
        norm = self.prepare()
        self.apply(bool(torch.isfinite(norm)))
        return norm

    def prepare(self) -> torch.Tensor:
        """The first half of ``step``: gradients onto the masters (averaged over the ranks with ``reduce``),
        clipped; returns their norm before clipping, unread."""
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p and p.grad is not None:  # (already in the master under fp32 accumulation)
                _add_grad(m, p.grad)
        if self.reduce is not None:
            for m in self.masters:  # every rank reduces the same list, a parameter no loss reached as zeros
                if m.grad is None:
                    m.grad = torch.zeros_like(m)
            self.reduce([m.grad for m in self.masters])
        grads = [m for m in self.masters if m.grad is not None]
        if self.max_grad_norm and self.max_grad_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(grads, self.max_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([m.grad for m in grads]) if grads else torch.zeros(())
        return norm

    def apply(self, finite: bool) -> None:
        """The second half of ``step``: the update (skipped when not ``finite`` and ``skip_nonfinite``)."""
        if self.skip_nonfinite and not finite:
            self.skipped_steps += 1
            self.zero_grad()
            return
        self.optimizer.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
        self.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        """The state, a copy (GPU tensors copied to host memory in one synchronization, others cloned)."""
        from dflash_flow.model.device import to_host

        def copy(m: torch.Tensor) -> torch.Tensor:
            m = m.detach()
            return m if m.is_cuda and type(m) is torch.Tensor else m.clone()  # (to_host copies the CUDA ones)

        return to_host(OPTIMIZER_STATE.tag({
            "optimizer": self.optimizer.state_dict(),
            # Masters are saved: the bf16 weights of a checkpoint have lost the low bits.
            "masters": [copy(m) if m is not p else None for m, p in zip(self.masters, self.params, strict=True)],
            "skipped_steps": self.skipped_steps,
        }))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        OPTIMIZER_STATE.check(state)
        masters = state["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(f"optimizer state has {len(masters)} params, model has {len(self.masters)}")
        with torch.no_grad():
            for p, m, saved in zip(self.params, self.masters, masters, strict=True):
                if (saved is None) != (m is p):
                    raise ValueError("optimizer state does not match the parameter dtypes (fp32 vs bf16)")
                if saved is not None:
                    m.copy_(saved)
                    p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
        self.skipped_steps = int(state.get("skipped_steps", 0))


def _add_grad(master: torch.Tensor, g: torch.Tensor) -> None:
    master.grad = g.detach().float() if master.grad is None else master.grad.add_(g.detach())


def _into_master(master: torch.Tensor):
    """The post-accumulate-grad hook of a bf16 parameter: its gradient goes into ``master.grad`` (fp32)."""

    def hook(p: torch.Tensor) -> None:
        if p.grad is not None:
            _add_grad(master, p.grad)
            p.grad = None

    return hook


def allreduce_mean(grads: list[torch.Tensor], *, bucket_bytes: int = 256 * 2**20, group: Any = None) -> None:
    """Average ``grads`` over the ranks in place, in their own dtype (fp32 masters' gradients), a few flat
    buckets at a time (one collective per bucket, not per tensor)."""
    import torch.distributed as dist

    world = dist.get_world_size(group)
    bucket: list[torch.Tensor] = []
    size = 0

    def flush() -> None:
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket.clear()

    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= bucket_bytes:
            flush()
            size = 0
    flush()


# -- data parallel
def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class AllReduceClock:
    """When the last gradient bucket of a backward was handed to the all-reduce and when the last all-reduce
    completed (or the fp32 masters' reduction began and ended): the wait the all-reduce added to the step.
    ``cuda``: the stamps are CUDA events, read once done (``settle``): under NCCL an all-reduce returns once
    queued, so a host clock would measure the launch."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self.handed: Any = None
        self.done: Any = None
        self._pending: list[tuple[Any, Any]] = []

    def stamp(self) -> Any:
        """Now: a host clock reading, or a CUDA event recorded on the current stream."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def take(self) -> float | None:
        """The exposed wait of the reduction just finished in seconds (None when none was timed, or on CUDA:
        see ``settle``); resets."""
        handed, done = self.handed, self.done
        self.handed = self.done = None
        if handed is None or done is None:
            return None
        if self.cuda:
            self._pending.append((handed, done))
            return None
        return max(done - handed, 0.0)

    def settle(self) -> float:
        """The CUDA-timed waits taken so far, in seconds (after the step's device read their events are done)."""
        total = 0.0
        for handed, done in self._pending:
            done.synchronize()
            total += max(handed.elapsed_time(done), 0.0) / 1000.0
        self._pending.clear()
        return total


def timed_allreduce_hook(clock: AllReduceClock, bucket):
    """DDP comm hook: torch's default all-reduce, timed into ``clock`` (no annotations: DDP checks them)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    clock.handed = clock.stamp()

    def finished(fut: torch.futures.Future) -> torch.Tensor:
        clock.done = clock.stamp()  # (on CUDA the callback's stream waits for the work: the event marks its end)
        return fut.value()

    return allreduce_hook(None, bucket).then(finished)


def data_parallel(objective: nn.Module, mode: str, device: torch.device,
                  clock: AllReduceClock | None = None) -> nn.Module:
    """``objective`` wrapped for the process group torch.distributed has (itself when there is none)."""
    if not is_distributed():
        return objective
    if mode == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # One FSDP unit at the root: the loss reaches the layers through helper methods, not only their forward,
        # so per-layer units would miss their unshard hooks. bf16 weights: gradients reduce-scatter in fp32.
        objective.needs_input_grad = True
        low = any(p.dtype != torch.float32 for p in objective.parameters())
        fully_shard(objective, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32 if low else None))
        return objective
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # Buffers (RoPE frequencies) are equal by construction: no broadcast before every forward.
    params = inspect.signature(DistributedDataParallel).parameters
    sync_kw = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    ddp = DistributedDataParallel(objective, device_ids=[device] if device.type == "cuda" else None, **{sync_kw: False})
    if clock is not None:
        ddp.register_comm_hook(clock, timed_allreduce_hook)
    return ddp


class WarmupCosineSchedule(torch.optim.lr_scheduler.LambdaLR):
    """torch's ``LambdaLR`` with the recipe's factor: linear warmup to the base lr, then cosine decay to
    ``min_lr_ratio * base``, reaching the floor at ``total_steps``. Step s of the warmup runs at
    ``(s+1)/warmup`` of the lr (the first update is not wasted at lr 0). ``optimizer``: torch's or ``MasterAdamW``.
    """

    def __init__(self, optimizer: Any, *, total_steps: int, warmup_ratio: float = 0.04,
                 warmup_steps: int | None = None, min_lr_ratio: float = 0.0) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"warmup_ratio must be in [0, 1), got {warmup_ratio}")
        self.total_steps = int(total_steps)
        self.warmup_steps = int(warmup_steps if warmup_steps is not None else math.ceil(total_steps * warmup_ratio))
        self.min_lr_ratio = float(min_lr_ratio)
        self.respan_from: tuple[int, float] | None = None
        super().__init__(getattr(optimizer, "optimizer", optimizer), lr_lambda=self.factor)

    def factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = self.progress(step)
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def progress(self, step: int) -> float:
        """How far the cosine is at ``step`` (0 after the warmup, 1 at ``total_steps``); after a re-span at step
        s0 (progress p0), linearly from p0 to 1 at the new total."""
        if self.respan_from is not None:
            s0, p0 = self.respan_from
            if step >= s0:
                return min(1.0, p0 + (1.0 - p0) * (step - s0) / max(1, self.total_steps - s0))
        span = max(1, self.total_steps - self.warmup_steps)
        return min(1.0, max(0.0, (step - self.warmup_steps) / span))

    def retarget(self, total_steps: int, *, respan: bool) -> None:
        """A new length for a run in progress. ``respan``: the decay goes on from where it is to the floor at the
        new total, with no jump (a resume at another world size); else re-planned: from this step on the lr is
        that of a run planned with the new length from the start (an extended run)."""
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        step = self.step_count
        if respan and step >= self.warmup_steps and step < total_steps:
            self.respan_from = (step, self.progress(step))
        else:  # (the warmup stays as it was planned)
            self.respan_from = None
        self.total_steps = int(total_steps)
        self._set_lrs(step)

    def _set_lrs(self, step: int) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
            group["lr"] = base * self.factor(step)
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    @property
    def step_count(self) -> int:
        """Optimizer updates scheduled so far (torch's ``last_epoch``)."""
        return int(self.last_epoch)

    def state_dict(self) -> dict[str, Any]:
        """torch's state (the step count and lrs) and the schedule's shape, plain values only."""
        state = {k: v for k, v in super().state_dict().items() if k != "lr_lambdas"}
        return SCHEDULE_STATE.tag({**state, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "min_lr_ratio": self.min_lr_ratio,
                "respan_from": list(self.respan_from) if self.respan_from is not None else None})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if SCHEDULE_STATE.check(state) in SCHEDULE_STATE.older:  # before LambdaLR: step_count, base_lrs
            count = int(state["step_count"])
            state = {"last_epoch": count, "_step_count": count + 1, "base_lrs": list(state["base_lrs"]),
                     "version": SCHEDULE_STATE.version, "total_steps": state["total_steps"],
                     "warmup_steps": state["warmup_steps"], "min_lr_ratio": state["min_lr_ratio"]}
        self.total_steps = int(state["total_steps"])
        self.warmup_steps = int(state["warmup_steps"])
        self.min_lr_ratio = float(state["min_lr_ratio"])
        respan = state.get("respan_from")
        self.respan_from = (int(respan[0]), float(respan[1])) if respan is not None else None
        torch_state = {k: v for k, v in state.items()
                       if k not in ("version", "total_steps", "warmup_steps", "min_lr_ratio", "respan_from")}
        super().load_state_dict({**torch_state, "lr_lambdas": [None] * len(self.base_lrs)})
        self._set_lrs(self.last_epoch)


def planned_updates(batches_ahead: Iterable[int], grad_accum: int, *, accumulated: int = 0) -> int:
    """Optimizer updates still to come: every epoch's batches make ``ceil(n / grad_accum)`` updates (a last,
    partial accumulation is stepped early), the current epoch's with the ``accumulated`` micro-batches.
    ``batches_ahead``: this rank's batches per epoch from now on, this epoch's rest first."""
    if grad_accum < 1:
        raise ValueError(f"accumulation steps must be >= 1, got {grad_accum}")
    return sum(-(-(int(n) + (accumulated if i == 0 else 0)) // grad_accum) for i, n in enumerate(batches_ahead))


class GradientAccumulator:
    """Counts micro-batches and scales their losses by ``1 / steps`` (the mean of the micro-batch means,
    SpecForge's per-rank convention); ``reset()`` after every optimizer step, which may come early."""

    def __init__(self, steps: int = 1) -> None:
        if steps < 1:
            raise ValueError(f"accumulation steps must be >= 1, got {steps}")
        self.steps = int(steps)
        self.micro = 0

    def backward(self, loss: torch.Tensor) -> bool:
        """Backward of ``loss / steps``; True when the accumulated gradients are ready for ``step()``."""
        (loss / self.steps).backward()
        self.micro += 1
        return self.ready

    @property
    def ready(self) -> bool:
        return self.micro >= self.steps

    @property
    def next_is_last(self) -> bool:
        """Whether the next micro-batch completes the accumulation."""
        return self.micro + 1 >= self.steps

    def reset(self) -> None:
        self.micro = 0

    def state_dict(self) -> dict[str, Any]:
        return ACCUMULATOR_STATE.tag({"steps": self.steps, "micro": self.micro})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ACCUMULATOR_STATE.check(state)
        if int(state["steps"]) != self.steps:
            raise ValueError(f"accumulation steps changed from {state['steps']} to {self.steps}")
        self.micro = int(state["micro"])


def build_optimizer(model: nn.Module, *, total_steps: int, lr: float = 6e-4, weight_decay: float = 0.0,
                    betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                    max_grad_norm: float | None = 1.0, warmup_ratio: float = 0.04,
                    min_lr_ratio: float = 0.0) -> tuple[MasterAdamW, WarmupCosineSchedule]:
    """The recipe defaults: AdamW (fp32 masters) lr 6e-4, wd 0, clip 1.0, 4% warmup, cosine to 0."""
    opt = MasterAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                      max_grad_norm=max_grad_norm)
    return opt, WarmupCosineSchedule(opt, total_steps=total_steps, warmup_ratio=warmup_ratio, min_lr_ratio=min_lr_ratio)
