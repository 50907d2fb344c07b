"""Devices and dtypes of the models: the default dtype and attention kernel per device, ``dtype`` names, and the
CUDA streams the stage threads run on (``side_streams``, ``take``)."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def as_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    # "cuda" and "cuda:0" must be the same cache key and the same placement.
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on accelerators (the dtype the released drafters were trained against), fp32 on CPU
    (CPU bf16 matmuls are slow and lossy, and tests compare at 1e-5)."""
    return torch.float32 if as_device(device).type == "cpu" else torch.bfloat16


def default_attn_implementation(device: str | torch.device, dtype: torch.dtype | None = None) -> str:
    """flash_attention_2 only where it can run: a CUDA device of compute capability >= 8.0, a 16-bit ``dtype``
    (None: the device's default), and the package imports; sdpa otherwise."""
    dev = as_device(device)
    if dev.type != "cuda" or (dtype or default_dtype(dev)) not in (torch.bfloat16, torch.float16):
        return "sdpa"
    try:
        if torch.cuda.get_device_capability(dev) < (8, 0):
            return "sdpa"
    except Exception:  # no driver to ask: flash-attn could not run either
        return "sdpa"
    try:
        import flash_attn  # noqa: F401
    except Exception:  # ImportError, or a broken CUDA build raising at import
        return "sdpa"
    return "flash_attention_2"


def resolve_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """A dtype from its config name; ``auto`` (or None) is :func:`default_dtype` for the device."""
    if name in (None, "auto"):
        return default_dtype(device)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16") from None


# -- streams: every thread starts on each GPU's legacy default stream, shared by all threads (a target replica's
# forward and the drafter's step would run one after the other, and a copy between two GPUs is a two-way
# barrier). A stage that runs a model enters a stream of its own per device (``side_streams``) and synchronizes
# only those; whoever takes a tensor made there marks it used on its own stream (``take``).

_streams = threading.local()


def _thread_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's own stream on ``device`` (made once per thread and device)."""
    table = _streams.__dict__.setdefault("table", {})
    if device not in table:
        table[device] = torch.cuda.Stream(device=device)
    return table[device]


@contextlib.contextmanager
def side_streams(devices: Iterable[torch.device | str]) -> Iterator[None]:
    """Run the block on this thread's own stream of each CUDA device in ``devices``: each first waits for what
    this thread queued on the device's current stream; at the end the block's work is synchronized, on those
    streams only."""
    cuda = sorted({as_device(d) for d in devices if as_device(d).type == "cuda"}, key=str)
    if not cuda:
        yield
        return
    with contextlib.ExitStack() as stack:
        streams = []
        for dev in cuda:
            stream = _thread_stream(dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            stack.enter_context(torch.cuda.stream(stream))
            streams.append(stream)
        yield
    for stream in streams:
        stream.synchronize()


def take(t: torch.Tensor) -> torch.Tensor:
    """``t`` (made on another thread's stream) marked in use on this thread's current stream before it is read,
    so the maker's stream does not reuse its memory meanwhile. A no-op off CUDA."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))
    return t


# -- threads and the allocator --------------------------------------------------------------------------------

ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def use_expandable_segments() -> None:
    """Have CUDA's caching allocator grow segments in place unless the user set ``PYTORCH_CUDA_ALLOC_CONF``
    (batches of every shape otherwise leave reserved memory far above allocated). Effective before CUDA's
    first allocation only."""
    if ALLOC_CONF not in os.environ and not torch.cuda.is_initialized():
        os.environ[ALLOC_CONF] = "expandable_segments:True"


def bind_thread_device(devices: list[str], home: str | None = None) -> None:
    """Make the calling thread's current CUDA device its own: the first GPU of ``devices``, else ``home`` (the
    rank's first GPU: a thread without one still creates contexts, and not on another rank's GPU 0). Every
    stage thread runs this before its setup; a no-op without CUDA."""
    cuda = [d for d in devices if d.startswith("cuda")] or ([home] if home else [])
    if not cuda or not torch.cuda.is_available():
        return
    use_expandable_segments()
    torch.cuda.set_device(as_device(cuda[0]))


def to_host(tree: Any) -> Any:
    """``tree`` (tensors in dicts, lists and tuples) with every CUDA tensor copied to pinned host memory without
    blocking, then one synchronization; other leaves as they are. Adds no GPU memory, the copies overlap."""
    devices: set[torch.device] = set()

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_cuda and type(x) is torch.Tensor:
            host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x.detach(), non_blocking=True)
            devices.add(x.device)
            return host
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(copy(v) for v in x)
        return x

    out = copy(tree)
    for dev in devices:
        torch.cuda.current_stream(dev).synchronize()
    return out
