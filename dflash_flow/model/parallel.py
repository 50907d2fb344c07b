"""Data-parallel training of the drafter's loss module: DDP (its all-reduce timed by a comm hook when asked)
or FSDP (one unit at the root), and the clock that measures how long a step waited for the all-reduce."""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn

__all__ = ["AllReduceClock", "data_parallel", "is_distributed", "timed_allreduce_hook"]


def is_distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class AllReduceClock:
    """When the last gradient bucket of a backward was handed to the all-reduce and when the last all-reduce
    completed (:func:`timed_allreduce_hook`), or when the optimizer's reduction of the fp32 masters' gradients
    began and ended (bf16 weights). The difference is the wait the all-reduce added to the step (backward
    compute had ended at the hand-over): the transfer not hidden behind compute, and any wait for a slower rank.

    ``cuda``: the stamps are CUDA events on the current stream, read once they are done (``settle``). Under NCCL
    an all-reduce returns, and its future completes, once it is queued, so host clocks measured the launch, not
    the transfer; on gloo (the CPU) the host clock is the real completion."""

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
        """The exposed wait of the reduction just finished in seconds (None when none was timed, or on CUDA,
        where it waits for ``settle``); resets."""
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
    """DDP comm hook: torch's default all-reduce (mean over ranks), timed into ``clock``. (No annotations
    on ``bucket`` and the result: DDP checks them, and postponed annotations are strings to it.)"""
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

        # One FSDP unit at the root: the loss reaches the drafter's layers through helper methods (chunked,
        # checkpointed), not only through their forward, so per-layer units would miss their unshard hooks.
        # Sharding still splits what dominates a drafter's memory: gradients, fp32 masters and Adam moments.
        # bf16 weights: the micro-batches' gradients accumulate and reduce-scatter in fp32 (rounded to bf16 once,
        # into the sharded gradient the fp32 masters take).
        objective.needs_input_grad = True
        low = any(p.dtype != torch.float32 for p in objective.parameters())
        fully_shard(objective, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32 if low else None))
        return objective
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    # Buffers (RoPE frequencies) are equal by construction: no broadcast before every forward (the knob's
    # name changed across torch versions).
    params = inspect.signature(DistributedDataParallel).parameters
    sync_kw = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    ddp = DistributedDataParallel(objective, device_ids=[device] if device.type == "cuda" else None, **{sync_kw: False})
    if clock is not None:
        ddp.register_comm_hook(clock, timed_allreduce_hook)
    return ddp

