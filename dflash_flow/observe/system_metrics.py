"""Host load as metrics (``system/*``): :class:`SystemSample` declared once, sampled from psutil when the
tracker flushes (at the Monitor's cadence, not mlflow's background thread)."""

from __future__ import annotations

import contextlib
from typing import Any

import attrs

from .schema import metric, mlflow_metrics

__all__ = ["SystemSample", "sample_system", "start_system_sampling"]


@attrs.frozen
class SystemSample:
    """Host load at flush time (psutil)."""

    cpu_percent: float = metric("system/cpu_percent", reduce="mean", doc="Host CPU use, %")
    memory_percent: float = metric("system/memory_percent", reduce="mean", doc="Host memory use, %")
    memory_used_gb: float = metric("system/memory_used_gb", reduce="max", doc="Host memory used, GiB")
    process_rss_gb: float | None = metric("system/process_rss_gb", reduce="sum", default=None, doc="This process's resident memory, GiB")
    process_cpu_percent: float | None = metric("system/process_cpu_percent", reduce="sum", default=None, doc="This process's CPU use, % of one core")


def start_system_sampling() -> Any | None:
    """This process's ``psutil.Process``, primed (``cpu_percent()`` measures since the previous call, so the
    first sample is meaningful); None without psutil (no system metrics then)."""
    try:
        import psutil
    except ImportError:
        return None
    proc = psutil.Process()
    psutil.cpu_percent(interval=None)
    proc.cpu_percent(interval=None)
    return proc


def sample_system(proc: Any | None) -> dict[str, float]:
    """The host's load now, and ``proc``'s (a ``psutil.Process``; None: the host's only), as metrics."""
    import psutil

    vm = psutil.virtual_memory()
    rss = cpu = None
    if proc is not None:
        with contextlib.suppress(psutil.Error):
            rss = proc.memory_info().rss / 2**30
            cpu = proc.cpu_percent(interval=None)
    sample = SystemSample(
        cpu_percent=psutil.cpu_percent(interval=None),
        memory_percent=vm.percent,
        memory_used_gb=(vm.total - vm.available) / 2**30,
        process_rss_gb=rss,
        process_cpu_percent=cpu,
    )
    return mlflow_metrics(sample)
