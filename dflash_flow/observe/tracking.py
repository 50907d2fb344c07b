"""MLflow tracking for a pipeline run, robust to a tracking server that goes away: the :class:`Tracker`.

The rest of tracking lives next to it, one job a module: ``runinfo`` (params, tags, redaction),
``store`` (URIs, the pre-flight check, transient errors, the store ops), ``delivery`` (ops sent in order,
spooled and replayed through an outage: the Tracker's base class), ``spool`` (the local outbox and
``import_spool``).

Design (why it looks like this):

- ``import mlflow`` costs ~1.3 s, so it is imported inside methods only; a disabled tracker never
  imports it and never creates a store.
- Per-call logging is expensive (4 ms per ``mlflow.log_metrics`` on sqlite) while one
  ``MlflowClient.log_batch`` with many metrics costs ~0.3 ms per metric-set. So ``log_metrics`` only
  appends to an in-memory buffer (cheap, never touches the network) and ``flush``/``flush_async`` --
  called by the Monitor once per sample -- sends the buffer in ``log_batch`` calls of at most 1000
  metrics (mlflow's per-request limit). ``flush_async`` does the store writes on one writer thread, so
  a slow store never stalls the pipeline.
- Every write to the store is an *op* (``observe.store``). When an op fails with a transient error
  (connection refused, timeout, 5xx, locked database) the tracker enters *spool mode*: that op and
  every later one is appended, in order, to a JSONL file in ``spool_dir`` (artifacts are copied next
  to it), ONE warning is logged, and later flushes retry the head of the spool with exponential
  backoff. Ops are replayed strictly in order and removed from the spool only once the store accepted
  them, so nothing is lost and nothing is sent twice by the live tracker. Metric timestamps are fixed
  when the metric is logged, which makes a replay after an ambiguous failure idempotent on mlflow's
  SQL stores: they drop rows whose (key, timestamp, step, value) already exist.
- If the process ends with ops still spooled, the file stays; ``dflash-flow import-spool PATH``
  replays it.
- mlflow's HTTP client retries for minutes by default; the tracker bounds that around its own calls
  (``store.bounded_http``): 0 transport retries -- our own backoff does the retrying -- and a short
  timeout.
- Credentials never leave the process: warnings, params, tags and the spool carry
  ``redact_uri(tracking_uri)``.
- Status: ``end("FINISHED" | "FAILED" | "KILLED")``; used as a context manager the status follows
  the exception (none -> FINISHED, KeyboardInterrupt / non-zero SystemExit -> KILLED, other ->
  FAILED). A process killed with SIGKILL leaves its run RUNNING (nothing can run at that point).
- System metrics come from psutil at flush time (``system/*``, declared in ``system_metrics.SystemSample``),
  at the Monitor's cadence, instead of mlflow's background thread with its own cadence and logging.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import uuid
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .delivery import SpooledDelivery
from .runinfo import (
    MAX_METRICS_PER_BATCH,
    MAX_PARAMS_TAGS_PER_BATCH,
    config_hash,
    flatten_params,
    hide_mlflow_urls,
    redact_text,
    redact_uri,
    run_tags,
    sanitize_key,
    tag_values,
    uri_secrets,
)
from .spool import SpoolFile
from .store import (
    check_tracking_uri,
    chunks,
    default_artifact_location,
    first_line,
    now_ms,
    resolve_tracking_uri,
)
from .system_metrics import sample_system, start_system_sampling

# config_hash and run_tags live in observe.runinfo; importable from here too for the application.
__all__ = ["RUN_STATUSES", "Tracker", "TrackingError", "config_hash", "run_tags", "status_for_exception"]

log = logging.getLogger(__name__)

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")


class TrackingError(Exception):
    """The tracking store cannot be used at all (the pre-flight check failed); one line, names the path."""


class Tracker(SpooledDelivery):
    """One MLflow run. Construct with :meth:`start`; ``Tracker(enabled=False)`` is a no-op tracker.

    Thread-safety: ``log_metrics`` may be called from any thread (it only appends under a lock);
    ``flush``/``log_artifact``/``end`` serialize their store writes on a second lock, so a slow store
    never blocks ``log_metrics``.
    """

    def __init__(
        self,
        enabled: bool = True,
        *,
        http_timeout_s: int = 5,
        http_max_retries: int = 0,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 30.0,
        artifact_timeout_s: int = 120,
        drain_budget_s: float = 2.0,
    ) -> None:
        self.enabled = bool(enabled)
        self.drain_budget_s = float(drain_budget_s)
        self.http_timeout_s = int(http_timeout_s)
        # A server may take a while to answer after receiving a large file (a checkpoint): uploads get
        # a longer socket timeout than the small metric/param requests.
        self.artifact_timeout_s = int(artifact_timeout_s)
        self.http_max_retries = int(http_max_retries)
        self.retry_initial_s = float(retry_initial_s)
        self.retry_max_s = float(retry_max_s)
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
        self._outages = 0
        self._last_step = 0
        self._system_metrics = False
        self._proc: Any = None
        self._ended = False
        self._local_id = uuid.uuid4().hex[:12]
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._order_lock = threading.Lock()  # taking rows from the buffer and queueing or sending them: one step
        self._writer_warned = False
        self._spool_write_failed = False
        self._secrets: tuple[str, ...] = ()

    # ---------------------------------------------------------------- construction
    @classmethod
    def start(
        cls,
        *,
        tracking_uri: str | os.PathLike | None = None,
        experiment: str,
        run_name: str | None = None,
        params: Mapping[str, Any] | None = None,
        tags: Mapping[str, Any] | None = None,
        resume_run_id: str | None = None,
        system_metrics: bool = True,
        spool_dir: str | os.PathLike | None = None,
        enabled: bool = True,
        http_timeout_s: int = 5,
        http_max_retries: int = 0,
        retry_initial_s: float = 1.0,
        retry_max_s: float = 30.0,
        artifact_timeout_s: int = 120,
        drain_budget_s: float = 2.0,
    ) -> Tracker:
        """Create (or resume) a run and log its params and tags.

        ``tracking_uri``: None -> mlflow's default; a plain path -> sqlite file. ``spool_dir``
        (default ``<cwd>/mlflow-spool``) is only written to when the store is unreachable. With
        ``enabled=False`` nothing is imported or created and every method is a no-op.
        If the store is unreachable at start, the run is created when it comes back. A local store
        that cannot be written at all (``store.check_tracking_uri``) raises :class:`TrackingError`
        at once instead of failing slowly on every write.
        """
        self = cls(
            enabled,
            http_timeout_s=http_timeout_s,
            http_max_retries=http_max_retries,
            retry_initial_s=retry_initial_s,
            retry_max_s=retry_max_s,
            artifact_timeout_s=artifact_timeout_s,
            drain_budget_s=drain_budget_s,
        )
        if not self.enabled:
            return self
        problem = check_tracking_uri(tracking_uri)
        if problem:
            raise TrackingError(problem)
        from .store import open_client

        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self._secrets = uri_secrets(self.tracking_uri)
        hide_mlflow_urls(self.tracking_uri)  # MLflow's "View run at http://alice:PASSWORD@..." lines
        self.experiment = experiment
        self.spool_dir = Path(spool_dir) if spool_dir is not None else Path.cwd() / "mlflow-spool"
        self._client = open_client(self.tracking_uri)
        self._system_metrics = bool(system_metrics)
        if self._system_metrics:
            self._proc = start_system_sampling()
            self._system_metrics = self._proc is not None

        ops: list[dict] = []
        tags_ = tag_values(tags or {})
        if resume_run_id:
            ops.append({"op": "run", "run_id": resume_run_id})
            ops.append({"op": "resume"})
            if tags_:
                ops.append({"op": "tags", "tags": tags_})
        else:
            ops.append(
                {
                    "op": "create_run",
                    "experiment": experiment,
                    "run_name": run_name,
                    "tags": tags_,
                    "start_time": now_ms(),
                    "artifact_location": default_artifact_location(self.tracking_uri, experiment),
                }
            )
        flat = flatten_params(params)
        for chunk in chunks(list(flat.items()), MAX_PARAMS_TAGS_PER_BATCH):
            ops.append({"op": "params", "params": dict(chunk)})
        self._submit(ops)
        return self

    # ---------------------------------------------------------------- properties
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

    # ---------------------------------------------------------------- logging
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer metrics for ``step`` (no I/O). Non-numeric values are skipped."""
        if not self.enabled or self._ended:
            return
        ts = now_ms()
        step = int(step)
        rows = []
        for k, v in metrics.items():
            try:
                fv = float(v)
            except (TypeError, ValueError):
                continue
            rows.append((sanitize_key(k), fv, ts, step))
        with self._buf_lock:
            self._buf.extend(rows)
            if step > self._last_step:
                self._last_step = step

    def _take_metric_ops(self) -> list[dict]:
        if self._system_metrics and not self._ended:
            self.log_metrics(sample_system(self._proc), step=self._last_step)
        with self._buf_lock:
            rows, self._buf = self._buf, []
        return [
            {"op": "metrics", "metrics": [list(r) for r in chunk]}
            for chunk in chunks(rows, MAX_METRICS_PER_BATCH)
        ]

    def flush(self) -> None:
        """Send buffered metrics (plus a ``system/*`` sample) in ``log_batch`` calls of <= 1000.

        While the store is unreachable this is a local file append, plus one quick retry of the spool
        when the backoff has elapsed. Waits for anything handed to the background writer first, so
        the store sees metrics in the order they were logged.
        """
        if not self.enabled:
            return
        with self._order_lock:
            self._wait_writer()
            self._submit(self._take_metric_ops())

    def flush_async(self) -> None:
        """Like ``flush`` but the store writes happen on the tracker's writer thread.

        The Monitor calls this once per sample so that a slow store (sqlite commits, a remote server)
        never stalls the pipeline; ``flush``/``end`` wait for the writer to finish.
        """
        if not self.enabled or self._ended:
            return
        with self._order_lock:  # rows reach the store in the order they were taken (steps rise per metric)
            ops = self._take_metric_ops()
            if not ops:
                return
            with self._writer_lock:
                if self._writer is None:
                    import queue

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

    def _wait_writer(self) -> None:
        if self._writer is not None:
            self._writes.join()

    def _stop_writer(self) -> None:
        with self._writer_lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            self._writes.put(None)
            writer.join()

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Log (nested) params, flattened, in batches of 100."""
        if not self.enabled or self._ended:
            return
        flat = flatten_params(params)
        self._submit(
            [
                {"op": "params", "params": dict(c)}
                for c in chunks(list(flat.items()), MAX_PARAMS_TAGS_PER_BATCH)
            ]
        )

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled or self._ended:
            return
        vals = tag_values(tags)
        self._submit(
            [{"op": "tags", "tags": dict(c)} for c in chunks(list(vals.items()), MAX_PARAMS_TAGS_PER_BATCH)]
        )

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Upload a file or a directory (its contents) under ``artifact_path``.

        While spooling, the file is copied into the spool directory first, so later changes to (or
        removal of) the original do not affect what is uploaded.
        """
        if not self.enabled or self._ended:
            return
        self._submit([{"op": "artifact", "path": str(Path(path).absolute()), "artifact_path": artifact_path}])

    def log_text(self, text: str, name: str) -> None:
        """Store ``text`` as artifact ``name`` (e.g. ``"config/resolved.yaml"``)."""
        if not self.enabled or self._ended:
            return
        parent, base = os.path.split(name)
        with tempfile.TemporaryDirectory(prefix="dflash-artifact-") as tmp:
            p = Path(tmp) / base
            p.write_text(redact_text(text, self._secrets), encoding="utf-8")  # no credential in an artifact
            self.log_artifact(p, parent or None)

    def log_dict(self, d: Mapping[str, Any], name: str) -> None:
        """Store ``d`` as JSON (or YAML when ``name`` ends with .yaml/.yml and PyYAML is present)."""
        if not self.enabled or self._ended:
            return
        if name.endswith((".yaml", ".yml")):
            try:
                import yaml

                text = yaml.safe_dump(json.loads(json.dumps(d, default=str)), sort_keys=False)
            except ImportError:
                text = json.dumps(d, indent=2, default=str)
        else:
            text = json.dumps(d, indent=2, default=str, sort_keys=False)
        self.log_text(text, name)

    def end(self, status: str = "FINISHED") -> None:
        """Flush everything and set the final status (FINISHED, FAILED or KILLED). Idempotent.

        One last replay of the spool is attempted regardless of the backoff; whatever still cannot be
        sent stays in the spool file, and a warning says how to import it.
        """
        if not self.enabled or self._ended:
            return
        status = status.upper()
        if status not in RUN_STATUSES:
            raise ValueError(f"status must be one of {RUN_STATUSES}, got {status!r}")
        self.flush()
        self._stop_writer()
        self._ended = True
        with self._io_lock:
            self._submit([{"op": "end", "status": status, "end_time": now_ms()}], force_retry=True)
            if self._pending:
                log.warning(
                    "MLflow tracking at %s is still unreachable at the end of the run; %d pending "
                    "operations are kept in %s. Import them later with: dflash-flow import-spool %s",
                    self.display_uri,
                    len(self._pending),
                    self.spool_path,
                    self.spool_path,
                )

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.end(status_for_exception(exc))


def status_for_exception(exc: BaseException | None) -> str:
    """FINISHED for no exception, KILLED for an interrupt (Ctrl-C, SIGTERM -> SystemExit), else FAILED."""
    if exc is None:
        return "FINISHED"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return "FINISHED"
        return "KILLED"
    return "FAILED"
