"""MLflow tracking for a pipeline run, robust to a store that goes away (:class:`Tracker`). ``log_metrics``
only buffers; ``flush`` sends batches. A transient failure sends that op and every later one, in order, to a
spool file with ONE warning; later flushes replay it with backoff (timestamps fixed when logged: idempotent),
``dflash-flow import-spool`` one left at exit. Credentials never leave the process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import uuid
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .schema import metric, mlflow_metrics
from .spool import SpooledDelivery, SpoolFile
from .store import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    check_tracking_uri,
    chunks,
    default_artifact_location,
    first_line,
    flatten_params,
    hide_mlflow_urls,
    now_ms,
    open_client,
    redact_uri,
    resolve_tracking_uri,
    sanitize_key,
    tag_values,
    uri_secrets,
)

log = logging.getLogger(__name__)

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")


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


def sample_system(proc: Any) -> dict[str, float]:
    """The host's load now, and ``proc``'s (a ``psutil.Process``), as metrics."""
    import psutil

    vm = psutil.virtual_memory()
    rss = cpu = None
    with contextlib.suppress(psutil.Error):
        rss = proc.memory_info().rss / 2**30
        cpu = proc.cpu_percent(interval=None)
    return mlflow_metrics(SystemSample(psutil.cpu_percent(interval=None), vm.percent,
                                       (vm.total - vm.available) / 2**30, rss, cpu))


class TrackingError(Exception):
    """The tracking store cannot be used at all (the pre-flight check failed); one line, names the path."""


class Tracker(SpooledDelivery):
    """One MLflow run, made by :meth:`start` (``Tracker(enabled=False)``: a no-op). ``log_metrics`` may be
    called from any thread; store writes serialize on a second lock, so a slow store never blocks it."""

    def __init__(self, enabled: bool = True, *, http_timeout_s: int = 5, http_max_retries: int = 0,
                 retry_initial_s: float = 1.0, retry_max_s: float = 30.0, artifact_timeout_s: int = 120,
                 drain_budget_s: float = 2.0) -> None:
        self.enabled, self.drain_budget_s = bool(enabled), float(drain_budget_s)
        # A server may take a while to answer a large upload (a checkpoint): a longer timeout for uploads.
        self.http_timeout_s, self.artifact_timeout_s = int(http_timeout_s), int(artifact_timeout_s)
        self.http_max_retries = int(http_max_retries)
        self.retry_initial_s, self.retry_max_s = float(retry_initial_s), float(retry_max_s)
        self.tracking_uri: str | None = None
        self.experiment: str | None = None
        self.spool_dir: Path | None = None
        self._client: Any = None
        self._state: dict = {"run_id": None}
        self._buf: list[tuple[str, float, int, int]] = []
        self._buf_lock = threading.Lock()
        self._io_lock = threading.RLock()
        self._pending: deque[dict] = deque()  # spooled ops, oldest first
        self._spool: SpoolFile | None = None
        self._retry_at = 0.0
        self._retry_delay = self.retry_initial_s
        self._last_step = 0
        self._proc: Any = None  # the psutil.Process of system metrics (None: none sampled)
        self._ended = False
        self._local_id = uuid.uuid4().hex[:12]
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._order_lock = threading.Lock()  # taking rows from the buffer and queueing or sending them: one step
        self._writer_warned = False
        self._spool_write_failed = False
        self._secrets: tuple[str, ...] = ()

    @classmethod
    def start(cls, *, tracking_uri: str | os.PathLike | None = None, experiment: str,
              run_name: str | None = None, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, Any] | None = None, resume_run_id: str | None = None,
              system_metrics: bool = True, spool_dir: str | os.PathLike | None = None, enabled: bool = True,
              **options: Any) -> Tracker:
        """Create (or resume) a run and log its params and tags (``options``: the constructor's).
        ``spool_dir`` (default ``<cwd>/mlflow-spool``) is written only while the store is unreachable."""
        self = cls(enabled, **options)
        if not self.enabled:
            return self
        if problem := check_tracking_uri(tracking_uri):
            raise TrackingError(problem)
        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self._secrets = uri_secrets(self.tracking_uri)
        hide_mlflow_urls(self.tracking_uri)  # MLflow's "View run at http://alice:PASSWORD@..." lines
        self.experiment = experiment
        self.spool_dir = Path(spool_dir) if spool_dir is not None else Path.cwd() / "mlflow-spool"
        self._client = open_client(self.tracking_uri)
        self._proc = start_system_sampling() if system_metrics else None

        tags_ = tag_values(tags or {})
        if resume_run_id:
            ops = [{"op": "run", "run_id": resume_run_id}, {"op": "resume"}]
            ops += [{"op": "tags", "tags": tags_}] if tags_ else []
        else:
            ops = [{"op": "create_run", "experiment": experiment, "run_name": run_name, "tags": tags_,
                    "start_time": now_ms(),
                    "artifact_location": default_artifact_location(self.tracking_uri, experiment)}]
        self._submit(ops + _batched("params", flatten_params(params)))
        return self

    @property
    def run_id(self) -> str | None:
        """The run id; None when disabled, or while the run could not yet be created."""
        return self._state.get("run_id")

    @property
    def spooling(self) -> bool:
        """True while some ops wait in the local spool for the store to come back."""
        return bool(self._pending)

    @property
    def spool_path(self) -> Path | None:
        """The spool file, if one was written (it is deleted once fully replayed)."""
        return self._spool.path if self._spool is not None else None

    @property
    def display_uri(self) -> str | None:
        """The tracking URI without credentials (what to print)."""
        return redact_uri(self.tracking_uri) if self.tracking_uri else None

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer metrics for ``step`` (no I/O). Non-numeric values are skipped."""
        if not self.enabled or self._ended:
            return
        ts, step = now_ms(), int(step)
        rows = []
        for k, v in metrics.items():
            with contextlib.suppress(TypeError, ValueError):
                rows.append((sanitize_key(k), float(v), ts, step))
        with self._buf_lock:
            self._buf.extend(rows)
            if step > self._last_step:
                self._last_step = step

    def _take_metric_ops(self) -> list[dict]:
        if self._proc is not None and not self._ended:
            self.log_metrics(sample_system(self._proc), step=self._last_step)
        with self._buf_lock:
            rows, self._buf = self._buf, []
        return [{"op": "metrics", "metrics": [list(r) for r in c]} for c in chunks(rows, MAX_METRICS_PER_BATCH)]

    def flush(self) -> None:
        """Send buffered metrics (plus a ``system/*`` sample), after what the writer thread holds (the store
        sees metrics in the order they were logged); while spooling, a file append and a retry when due."""
        if not self.enabled:
            return
        with self._order_lock:
            if self._writer is not None:
                self._writes.join()
            self._submit(self._take_metric_ops())

    def flush_async(self) -> None:
        """``flush`` on the writer thread (a slow store never stalls the Monitor); ``flush``/``end`` wait."""
        if not self.enabled or self._ended:
            return
        with self._order_lock:  # rows reach the store in the order they were taken (steps rise per metric)
            ops = self._take_metric_ops()
            if not ops:
                return
            with self._writer_lock:
                if self._writer is None:
                    self._writes = queue.Queue()
                    self._writer = threading.Thread(target=self._writer_loop, name="mlflow-writer", daemon=False)
                    self._writer.start()
            self._writes.put(ops)

    def _writer_loop(self) -> None:
        while True:
            ops = self._writes.get()
            try:
                if ops is None:
                    return
                self._submit(ops)
            except Exception as exc:  # a rejected write must not kill the writer; say it once
                if not self._writer_warned:
                    self._writer_warned = True
                    log.warning("MLflow write failed (later failures are not reported): %s", first_line(exc, secrets=self._secrets))
            finally:
                self._writes.task_done()

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if self.enabled and not self._ended:
            self._submit(_batched("tags", tag_values(tags)))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or a directory's contents under ``artifact_path`` (spooling: a copy of it now)."""
        if not self.enabled or self._ended:
            return
        self._submit([{"op": "artifact", "path": str(Path(path).absolute()), "artifact_path": artifact_path}])

    def end(self, status: str = "FINISHED") -> None:
        """Flush everything and set the final status (FINISHED, FAILED or KILLED). Idempotent. One last
        replay of the spool is tried; what still cannot be sent stays in the spool file, with a warning."""
        if not self.enabled or self._ended:
            return
        status = status.upper()
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        self.flush()
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._writes.put(None)
            writer.join()
        self._ended = True
        with self._io_lock:
            self._submit([{"op": "end", "status": status, "end_time": now_ms()}], force_retry=True)
            if self._pending:
                log.warning("MLflow tracking at %s is still unreachable at the end of the run; %d pending "
                            "operations are kept in %s. Import them later with: dflash-flow import-spool %s",
                            self.display_uri, len(self._pending), self.spool_path, self.spool_path)


def _batched(op: str, values: Mapping[str, str]) -> list[dict]:
    """``values`` as ``op`` ops of at most mlflow's 100 params or tags each."""
    return [{"op": op, op: dict(c)} for c in chunks(list(values.items()), MAX_PARAMS_TAGS_PER_BATCH)]
