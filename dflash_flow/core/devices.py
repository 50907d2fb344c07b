"""Device strings and placement of replicas. Never imports torch unless it is already imported."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")


def check_device_string(dev: str) -> str | None:
    """An error message for a malformed device string, else None."""
    if not isinstance(dev, str):
        return f"device must be a string, got {type(dev).__name__}"
    if dev == "auto" or _DEVICE_RE.match(dev):
        return None
    return f"bad device {dev!r}: expected 'cpu', 'cuda', 'cuda:K', 'mps' or 'auto'"


def visible_gpu_count() -> int:
    """CUDA devices this process may use.

    Uses torch when it is already imported; otherwise reads the driver's view so that `validate` stays
    fast (no torch import).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            return int(torch.cuda.device_count())
        except Exception:
            return 0
    gpus_dir = Path("/proc/driver/nvidia/gpus")
    try:
        count = len(list(gpus_dir.iterdir())) if gpus_dir.is_dir() else 0
    except OSError:
        count = 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
        count = min(count, len(ids)) if count else 0
    return count


def normalize_devices(devices: str | list[str] | None) -> list[str]:
    if devices is None:
        return ["cpu"]
    if isinstance(devices, str):
        return [devices]
    return list(devices)


def place(devices: list[str], replicas: int, gpu_count: int, local_rank: int = 0) -> tuple[list[str], str | None]:
    """Device of each replica, and a warning when ``auto`` fell back to cpu.

    ``auto`` spreads replicas over the visible GPUs; under torchrun each rank starts from its local rank so
    two ranks on one node do not pile onto GPU 0.
    """
    warning = None
    if devices == ["auto"]:
        if gpu_count == 0:
            return ["cpu"] * replicas, "devices: auto found no GPU; running on cpu"
        return [f"cuda:{(local_rank + i) % gpu_count}" for i in range(replicas)], None
    out = []
    for i in range(replicas):
        dev = devices[i % len(devices)]
        if dev == "cuda":
            dev = f"cuda:{local_rank}"
        out.append(dev)
    return out, warning


def missing_device(dev: str, gpu_count: int) -> str | None:
    """Why ``dev`` cannot be used on this machine, or None."""
    if dev.startswith("cuda"):
        index = int(dev.split(":", 1)[1]) if ":" in dev else 0
        if gpu_count == 0:
            return f"device {dev} requested but this machine has no visible CUDA device"
        if index >= gpu_count:
            return f"device {dev} requested but only {gpu_count} CUDA device(s) are visible"
    if dev == "mps" and sys.platform != "darwin":
        return "device mps requested but this is not a macOS machine"
    return None
