"""Device strings and placement of replicas. Never imports torch unless it is already imported."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?|mps)$")


def check_device_string(dev: str) -> str | None:
    """An error message for a malformed device string, else None."""
    if not isinstance(dev, str):
        return f"device must be a string, got {type(dev).__name__}"
    if dev == "auto" or _DEVICE_RE.match(dev):
        return None
    return f"bad device {dev!r}: expected 'cpu', 'cuda', 'cuda:K', 'mps' or 'auto'"


def visible_gpu_count() -> int:
    """CUDA devices this process may use: torch's count when it is imported, else the driver's (no torch import)."""
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


@attrs.frozen(kw_only=True)
class RankLayout:
    """Which of a node's visible GPUs one rank owns: ``gpus_per_rank`` consecutive ones (default: ``visible //
    local_world_size``), so slices never overlap; ``cuda:K`` in YAML is the K-th GPU of the rank's slice."""

    visible: int
    local_world_size: int = 1
    local_rank: int = 0
    gpus_per_rank: int | None = None
    shared: bool = False

    @property
    def size(self) -> int:
        if self.gpus_per_rank is not None:
            return self.gpus_per_rank
        if self.visible and self.local_world_size > self.visible and self.shared:
            return 1
        return self.visible // max(self.local_world_size, 1)

    def problem(self) -> str | None:
        """Why this layout cannot run (None when it can)."""
        if self.visible == 0:
            return None  # CPU-only machine: GPU devices are reported one by one
        if self.gpus_per_rank is not None and self.gpus_per_rank < 1:
            return f"gpus_per_rank must be >= 1, got {self.gpus_per_rank}"
        need = self.size * self.local_world_size
        if self.size == 0 or (need > self.visible and not self.shared):
            per = self.size or 1
            return (f"{self.local_world_size} ranks per node x {per} GPU(s) per rank need {self.local_world_size * per} "
                    f"GPUs but {self.visible} are visible: ranks would share GPUs (set runtime.share_gpus: true to "
                    "allow it, or runtime.gpus_per_rank / fewer ranks per node)")
        return None

    def gpus(self) -> list[int]:
        """The visible-GPU indices of this rank's slice, in order."""
        if self.visible == 0 or self.size == 0:
            return []
        start = self.local_rank * self.size
        return [(start + i) % self.visible for i in range(self.size)]

    def describe(self) -> str:
        g = self.gpus()
        span = f"GPU {g[0]}" if len(g) == 1 else f"GPUs {g[0]}-{g[-1]}" if g else "no GPU"
        return f"{span} of {self.visible} visible (local rank {self.local_rank} of {self.local_world_size})"


def _map_device(dev: str, slice_: list[int], layout: RankLayout) -> tuple[str | None, str | None]:
    """(physical device, problem) of one device string of a pipeline file, relative to the rank's slice."""
    if dev == "mps" and sys.platform != "darwin":
        return None, "device mps requested but this is not a macOS machine"
    if not dev.startswith("cuda"):
        return dev, None
    index = int(dev.split(":", 1)[1]) if ":" in dev else 0
    if not slice_:
        return None, f"device {dev} requested but this machine has no visible CUDA device"
    if index >= len(slice_) and layout.local_world_size == 1 and layout.gpus_per_rank is None:
        return None, f"device {dev} requested but only {layout.visible} CUDA device(s) are visible"
    if index >= len(slice_):
        return None, (f"device {dev} is beyond this rank's {len(slice_)} GPU(s) ({layout.describe()}); cuda:K means "
                      "the K-th GPU of the rank's slice")
    return f"cuda:{slice_[index]}", None


def plan_groups(groups: list[list[str]], replicas: int, layout: RankLayout) -> tuple[list[list[str]], list[str], str | None]:
    """(devices of each replica, problems, warning). Replica ``i`` runs on ``groups[i % len(groups)]`` mapped
    into the rank's slice; ``auto`` (alone) spreads the replicas over the slice (cpu, with a warning, without)."""
    slice_ = layout.gpus()
    problems: list[str] = []
    if groups == [["auto"]]:
        if not slice_:
            return [["cpu"]] * replicas, [], "devices: auto found no GPU; running on cpu"
        return [[f"cuda:{slice_[i % len(slice_)]}"] for i in range(replicas)], [], None
    mapped = []
    for group in groups:
        out = []
        for requested in group:
            dev, err = _map_device(requested, slice_, layout)
            if err and err not in problems:
                problems.append(err)
            out.append(dev or requested)  # unmapped: kept as written, so the problem names it
        mapped.append(out)
    return [list(mapped[i % len(mapped)]) for i in range(replicas)], problems, None


# -- several devices per replica --------------------------------------------------------------------
def is_nested(devices: Any) -> bool:
    """True for a list of device lists (one per replica): ``[[cuda:0, cuda:1], [cuda:2, cuda:3]]``."""
    return isinstance(devices, list) and any(isinstance(d, list) for d in devices)


def device_groups(devices: str | list | None) -> list[list[str]]:
    """The device lists replicas run on: a string or a flat list gives one device per list."""
    if devices is None:
        return [["cpu"]]
    if isinstance(devices, str):
        return [[devices]]
    return [list(d) if isinstance(d, (list, tuple)) else [d] for d in devices]


def nesting_problems(groups: list[list[str]], replicas: int, *, multi_device: bool,
                     stage_type: str = "this stage type") -> list[tuple[int | None, str]]:
    """``(index of the inner list or None, message)`` for each problem of a nested ``devices`` value."""
    out: list[tuple[int | None, str]] = []
    if len(groups) not in (1, replicas):
        out.append((None, f"devices gives {len(groups)} device lists (one per replica) but the stage has {replicas} "
                          "replica(s): give one list per replica, or a single list that every replica shares"))
    owner: dict[str, int] = {}
    for j, group in enumerate(groups):
        if "auto" in group:
            out.append((j, "'auto' cannot be used in a list of devices per replica; name the devices (cuda:K)"))
            continue
        if len(group) > 1 and not multi_device:
            out.append((j, f"device list {j} has {len(group)} devices, but {stage_type} runs each replica on one "
                            "device; several devices per replica are for stage types that split a model (TargetForward)"))
        seen: set[str] = set()
        for dev in group:
            key = "cuda:0" if dev == "cuda" else dev  # one spelling per device
            if key == "cpu":
                continue
            if key in seen:
                out.append((j, f"device {dev} appears twice in device list {j}; a replica splits its model over "
                                "distinct devices (only cpu may repeat)"))
            seen.add(key)
            if key in owner and owner[key] != j:
                out.append((j, f"device lists {owner[key]} and {j} both use {key}: give each replica its own devices, "
                                "or write a single list for every replica to share"))
            owner.setdefault(key, j)
    return out


# -- binding threads to their GPU (the application registers how: the core knows no torch) -------------------
_THREAD_SETUP: list[Callable[[list[str], str | None], None]] = []


def register_thread_setup(fn: Callable[[list[str], str | None], None]) -> None:
    """Have ``fn(devices, home)`` called in each replica's thread before its setup and in the thread that starts
    a pipeline (``devices`` empty); ``home``: the first GPU of this rank's slice (None without one). Idempotent."""
    if fn not in _THREAD_SETUP:
        _THREAD_SETUP.append(fn)


def setup_thread(devices: list[str], home: str | None) -> None:
    for fn in list(_THREAD_SETUP):
        fn(devices, home)
