"""MLflow tracking for a pipeline run, robust to a tracking server that goes away.

Design (why it looks like this):

- ``import mlflow`` costs ~1.3 s, so it is imported inside methods only; a disabled tracker never
  imports it and never creates a store.
- Per-call logging is expensive (4 ms per ``mlflow.log_metrics`` on sqlite) while one
  ``MlflowClient.log_batch`` with many metrics costs ~0.3 ms per metric-set. So ``log_metrics`` only
  appends to an in-memory buffer (cheap, never touches the network) and ``flush`` -- called by the
  Monitor once per sample -- sends the buffer in ``log_batch`` calls of at most 1000 metrics
  (mlflow's per-request limit).
- Every write to the store is an *op* (create_run, params, tags, metrics, artifact, end). When an op
  fails with a transient error (connection refused, timeout, 5xx, locked database) the tracker enters
  *spool mode*: that op and every later one is appended, in order, to a JSONL file in ``spool_dir``
  (artifacts are copied next to it), ONE warning is logged, and later flushes retry the head of the
  spool with exponential backoff. Ops are replayed strictly in order and removed from the spool only
  once the store accepted them, so nothing is lost and nothing is sent twice by the live tracker.
  Metric timestamps are fixed when the metric is logged, which makes a replay after an ambiguous
  failure (request reached the server, response did not come back) idempotent on mlflow's SQL
  stores: they drop rows whose (key, timestamp, step, value) already exist.
- If the process ends with ops still spooled, the file stays; ``import_spool(path, tracking_uri)``
  (or ``python -m dflash_flow.observe.tracking import-spool PATH --tracking-uri URI``) replays it.
- mlflow's HTTP client retries 7 times with exponential backoff and a 120 s timeout by default
  (minutes of blocking while a server is down). Those knobs are only environment variables read at
  request time (``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``_TIMEOUT`` / ``_BACKOFF_FACTOR``), not per-client
  settings, so the tracker overrides them around its own calls only (and only those the user did not
  set). We use 0 transport retries -- our own backoff does the retrying, and urllib3 would otherwise
  log a warning per retry -- and a short timeout.
- Status: ``end("FINISHED" | "FAILED" | "KILLED")``; used as a context manager the status follows
  the exception (none -> FINISHED, KeyboardInterrupt / non-zero SystemExit -> KILLED, other ->
  FAILED). A process killed with SIGKILL leaves its run RUNNING (nothing can run at that point).
- System metrics come from psutil at flush time (``system/*``), i.e. at the Monitor's cadence,
  instead of mlflow's background thread which has its own cadence and logging.

Usage (what the Monitor does)::

    tracker = Tracker.start(tracking_uri=cfg_uri, experiment="dflash", run_name="tiny", params=resolved_cfg,
                            tags=run_tags(resolved_cfg, world_size=1, device_summary="cpu"),
                            spool_dir=output_dir / "mlflow-spool", enabled=tracking_on)
    # every interval_s:
    tracker.log_metrics(snapshot.flat() | train_metrics, step=step)
    tracker.flush()
    # at the end:
    tracker.log_text(resolved_yaml, "config/resolved.yaml"); tracker.log_artifact(plots_dir, "plots")
    tracker.end("FINISHED")   # or FAILED / KILLED, or status_for_exception(exc)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# mlflow's limits (mlflow.utils.validation); duplicated so that they are usable without importing mlflow.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250

RUN_STATUSES = ("FINISHED", "FAILED", "KILLED")
_RUN_OPS = ("create_run", "run", "resume")  # ops that define which run the later ops go to

_KEY_BAD_CHARS = re.compile(r"[^A-Za-z0-9_\-. /:]")
_HTTP_ENV_LOCK = threading.RLock()


# --------------------------------------------------------------------------------------------------
# Helpers (pure; no mlflow)
# --------------------------------------------------------------------------------------------------


def sanitize_key(key: str) -> str:
    """Make ``key`` acceptable to mlflow (alphanumerics, ``_-. /:``; <= 250 chars).

    A metric with an invalid key fails the whole ``log_batch`` request, so keys are cleaned here.
    """
    key = _KEY_BAD_CHARS.sub("_", str(key)).strip() or "_"
    return key[:MAX_ENTITY_KEY_LENGTH]


def _truncate(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    marker = "...[truncated]"
    return value[: limit - len(marker)] + marker


def _stringify(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        try:
            return json.dumps(list(value) if isinstance(value, (set, frozenset)) else value, default=str)
        except (TypeError, ValueError):
            return str(value)
    return str(value)


def flatten_params(params: Mapping[str, Any] | None, *, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into ``{"a.b.c": "value"}``.

    Dicts recurse with dotted keys; lists that contain dicts (e.g. a list of stage configs) recurse
    with the index as a key part (``stages.0.name``); other lists become JSON strings. Values are
    stringified and truncated to mlflow's 6000-character limit; keys are sanitized.
    """
    out: dict[str, str] = {}

    def walk(obj: Any, key: str) -> None:
        if isinstance(obj, Mapping):
            if not obj and key:
                out[sanitize_key(key)] = "{}"
            for k, v in obj.items():
                walk(v, f"{key}.{k}" if key else str(k))
        elif isinstance(obj, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in obj):
            if not obj and key:
                out[sanitize_key(key)] = "[]"
            for i, v in enumerate(obj):
                walk(v, f"{key}.{i}" if key else str(i))
        else:
            out[sanitize_key(key or "value")] = _truncate(_stringify(obj), MAX_PARAM_VAL_LENGTH)

    walk(params or {}, prefix)
    return out


def config_hash(config: Mapping[str, Any]) -> str:
    """Stable short hash of a resolved config (sorted-key JSON, sha256, 16 hex chars)."""
    blob = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The current git commit (with ``-dirty`` when the tree has changes), or None outside git."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def run_tags(
    config: Mapping[str, Any] | None = None,
    *,
    world_size: int | None = None,
    device_summary: str | None = None,
    cwd: str | os.PathLike | None = None,
) -> dict[str, str]:
    """The standard tags of a run: git commit, config hash, world size, device summary."""
    tags: dict[str, str] = {}
    commit = git_commit(cwd)
    if commit:
        tags["git_commit"] = commit
    if config is not None:
        tags["config_hash"] = config_hash(config)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    tags["world_size"] = str(world_size)
    if device_summary:
        tags["device_summary"] = device_summary
    return tags


def resolve_tracking_uri(tracking_uri: str | os.PathLike | None) -> str:
    """None -> mlflow's own default (``MLFLOW_TRACKING_URI`` or ``sqlite:///<cwd>/mlflow.db``);
    a plain filesystem path -> ``sqlite:///<abs path>`` (a directory gets ``mlflow.db`` inside);
    anything with a scheme (``sqlite:``, ``http:``, ``databricks``...) is passed through."""
    if tracking_uri is None:
        import mlflow

        return mlflow.get_tracking_uri()
    uri = os.fspath(tracking_uri)
    if uri == "databricks" or re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:", uri):
        return uri
    path = Path(uri).expanduser().absolute()
    if path.is_dir():
        path = path / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return "sqlite:///" + path.as_posix()


def _is_http(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def _now_ms() -> int:
    return int(time.time() * 1000)


def is_transient_error(exc: BaseException) -> bool:
    """Whether an error from the store means "try again later" (spool) rather than "this op is bad".

    Client errors (HTTP 4xx other than 429: invalid parameter, changed param value, missing run...)
    are permanent: retrying them would wedge the spool forever. Connection failures, timeouts, 5xx,
    429 and local I/O / database-lock errors are transient.
    """
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:  # pragma: no cover - mlflow is a dependency
        MlflowException = ()  # type: ignore[assignment]
    if MlflowException and isinstance(exc, MlflowException):
        try:
            status = int(exc.get_http_status_code())
        except Exception:
            status = 500
        return not (400 <= status < 500 and status != 429)
    if isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)):
        return False
    return True  # requests/urllib3 connection errors, OSError, sqlalchemy OperationalError, ...


@contextlib.contextmanager
def _bounded_http(uri: str, timeout_s: int, max_retries: int) -> Iterator[None]:
    """Bound mlflow's HTTP retries/timeout for the calls made inside (see module docstring).

    mlflow reads these environment variables on every request, so a temporary override is the only
    per-call control it offers. Variables the user set are left alone.
    """
    if not _is_http(uri):
        yield
        return
    overrides = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(int(max_retries)),
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
        "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, int(timeout_s))),
    }
    with _HTTP_ENV_LOCK:
        saved = {k: os.environ.get(k) for k in overrides}
        for k, v in overrides.items():
            if saved[k] is None:
                os.environ[k] = v
        try:
            yield
        finally:
            for k, old in saved.items():
                if old is None:
                    os.environ.pop(k, None)


# --------------------------------------------------------------------------------------------------
# Ops: one store write each; shared by the live tracker and import_spool
# --------------------------------------------------------------------------------------------------


def _ensure_experiment(client: Any, name: str, artifact_location: str | None) -> str:
    from mlflow.exceptions import MlflowException

    exp = client.get_experiment_by_name(name)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    try:
        return client.create_experiment(name, artifact_location=artifact_location)
    except MlflowException:
        # Another process created it between our lookup and create.
        exp = client.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def _apply_op(client: Any, op: dict, state: dict) -> None:
    """Perform one op against the store; ``state["run_id"]`` carries the run between ops."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op["op"]
    if kind == "create_run":
        exp_id = _ensure_experiment(client, op["experiment"], op.get("artifact_location"))
        run = client.create_run(
            exp_id, start_time=op.get("start_time"), tags=op.get("tags") or None, run_name=op.get("run_name")
        )
        state["run_id"] = run.info.run_id
        return
    if kind == "run":
        state["run_id"] = op["run_id"]
        return
    run_id = state.get("run_id")
    if not run_id:
        raise RuntimeError(f"spool op {kind!r} has no run (missing create_run/run record)")
    if kind == "resume":
        client.update_run(run_id, status="RUNNING")
    elif kind == "metrics":
        metrics = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in op["metrics"]]
        client.log_batch(run_id, metrics=metrics, synchronous=True)
    elif kind == "params":
        client.log_batch(run_id, params=[Param(k, v) for k, v in op["params"].items()], synchronous=True)
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()], synchronous=True)
    elif kind == "artifact":
        path = op["path"]
        if os.path.isdir(path):
            client.log_artifacts(run_id, path, op.get("artifact_path"))
        else:
            client.log_artifact(run_id, path, op.get("artifact_path"))
    elif kind == "end":
        client.set_terminated(run_id, status=op["status"], end_time=op.get("end_time"))
    else:
        raise ValueError(f"unknown spool op {kind!r}")


def _chunks(seq: list, n: int) -> Iterator[list]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


# --------------------------------------------------------------------------------------------------
# Tracker
# --------------------------------------------------------------------------------------------------


class Tracker:
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
        self._spool_path: Path | None = None
        self._retry_at = 0.0
        self._retry_delay = self.retry_initial_s
        self._outages = 0
        self._last_step = 0
        self._system_metrics = False
        self._proc: Any = None
        self._ended = False
        self._local_id = uuid.uuid4().hex[:12]
        self._artifact_seq = 0
        self._writer: threading.Thread | None = None
        self._writer_lock = threading.Lock()
        self._writer_warned = False
        self._spool_write_failed = False

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
        If the store is unreachable at start, the run is created when it comes back.
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
        from mlflow import MlflowClient

        self.tracking_uri = resolve_tracking_uri(tracking_uri)
        self.experiment = experiment
        self.spool_dir = Path(spool_dir) if spool_dir is not None else Path.cwd() / "mlflow-spool"
        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._system_metrics = bool(system_metrics)
        if self._system_metrics:
            self._init_system_metrics()

        ops: list[dict] = []
        tag_values = {
            sanitize_key(k): _truncate(_stringify(v), MAX_TAG_VAL_LENGTH) for k, v in (tags or {}).items()
        }
        if resume_run_id:
            ops.append({"op": "run", "run_id": resume_run_id})
            ops.append({"op": "resume"})
            if tag_values:
                ops.append({"op": "tags", "tags": tag_values})
        else:
            ops.append(
                {
                    "op": "create_run",
                    "experiment": experiment,
                    "run_name": run_name,
                    "tags": tag_values,
                    "start_time": _now_ms(),
                    "artifact_location": self._default_artifact_location(experiment),
                }
            )
        flat = flatten_params(params)
        for chunk in _chunks(list(flat.items()), MAX_PARAMS_TAGS_PER_BATCH):
            ops.append({"op": "params", "params": dict(chunk)})
        self._submit(ops)
        return self

    def _default_artifact_location(self, experiment: str) -> str | None:
        """Keep a sqlite store self-contained: artifacts of experiments we create go next to the .db
        file (``<db dir>/mlartifacts/<experiment>``), not into whatever directory the process ran in.
        Other stores (a server) choose their own artifact root."""
        uri = self.tracking_uri or ""
        if not uri.startswith("sqlite:///"):
            return None
        db = Path(uri[len("sqlite:///") :])
        if str(db) in ("", ":memory:"):
            return None
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", experiment).strip("_") or "experiment"
        return (db.absolute().parent / "mlartifacts" / slug).as_uri()

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
        return self._spool_path

    # ---------------------------------------------------------------- logging
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Buffer metrics for ``step`` (no I/O). Non-numeric values are skipped."""
        if not self.enabled or self._ended:
            return
        ts = _now_ms()
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
            self.log_metrics(self._sample_system(), step=self._last_step)
        with self._buf_lock:
            rows, self._buf = self._buf, []
        return [
            {"op": "metrics", "metrics": [list(r) for r in chunk]}
            for chunk in _chunks(rows, MAX_METRICS_PER_BATCH)
        ]

    def flush(self) -> None:
        """Send buffered metrics (plus a ``system/*`` sample) in ``log_batch`` calls of <= 1000.

        While the store is unreachable this is a local file append, plus one quick retry of the spool
        when the backoff has elapsed. Waits for anything handed to the background writer first, so
        the store sees metrics in the order they were logged.
        """
        if not self.enabled:
            return
        self._wait_writer()
        self._submit(self._take_metric_ops())

    def flush_async(self) -> None:
        """Like ``flush`` but the store writes happen on the tracker's writer thread.

        The Monitor calls this once per sample so that a slow store (sqlite commits, a remote server)
        never stalls the pipeline; ``flush``/``end`` wait for the writer to finish.
        """
        if not self.enabled or self._ended:
            return
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
                    log.warning("MLflow write failed (later failures are not reported): %s", exc)
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
                for c in _chunks(list(flat.items()), MAX_PARAMS_TAGS_PER_BATCH)
            ]
        )

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if not self.enabled or self._ended:
            return
        vals = {sanitize_key(k): _truncate(_stringify(v), MAX_TAG_VAL_LENGTH) for k, v in tags.items()}
        self._submit(
            [{"op": "tags", "tags": dict(c)} for c in _chunks(list(vals.items()), MAX_PARAMS_TAGS_PER_BATCH)]
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
            p.write_text(text, encoding="utf-8")
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
            self._submit([{"op": "end", "status": status, "end_time": _now_ms()}], force_retry=True)
            if self._pending:
                log.warning(
                    "MLflow tracking at %s is still unreachable at the end of the run; %d pending "
                    "operations are kept in %s. Import them later with: "
                    "python -m dflash_flow.observe.tracking import-spool %s --tracking-uri %s",
                    self.tracking_uri,
                    len(self._pending),
                    self._spool_path,
                    self._spool_path,
                    self.tracking_uri,
                )

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.end(status_for_exception(exc))

    # ---------------------------------------------------------------- internals
    def _submit(self, ops: list[dict], *, force_retry: bool = False) -> None:
        """Send ops in order; on a transient failure spool the failing op and all later ones."""
        if not ops and not self._pending:
            return
        with self._io_lock:
            if self._pending:
                self._spool_append(ops)
                if force_retry or time.monotonic() >= self._retry_at:
                    self._drain(None if force_retry else self.drain_budget_s)
                return
            for i, op in enumerate(ops):
                try:
                    self._send(op)
                except Exception as exc:
                    if not is_transient_error(exc):
                        if op["op"] in _RUN_OPS:
                            raise  # e.g. resuming a run that does not exist: a config error, say so
                        log.warning("MLflow rejected a %s operation (dropped): %s", op["op"], exc)
                        continue
                    self._enter_spool(ops[i:], exc)
                    return

    def _send(self, op: dict) -> None:
        timeout = self.artifact_timeout_s if op["op"] == "artifact" else self.http_timeout_s
        with _bounded_http(self.tracking_uri or "", timeout, self.http_max_retries):
            _apply_op(self._client, op, self._state)

    def _enter_spool(self, ops: list[dict], exc: BaseException) -> None:
        self._outages += 1
        self._retry_delay = self.retry_initial_s
        self._retry_at = time.monotonic() + self._retry_delay
        self._spool_append(ops)
        # One warning per outage (not per step); the recovery is logged at INFO.
        log.warning(
            "MLflow tracking at %s is unreachable (%s: %s). Training continues; metrics are spooled "
            "to %s and sent when the store is back.",
            self.tracking_uri,
            type(exc).__name__,
            str(exc).splitlines()[0][:200] if str(exc) else "",
            self._spool_path,
        )

    def _drain(self, budget_s: float | None = None) -> None:
        """Replay spooled ops from the oldest; stop at the first transient failure (then back off)
        or when ``budget_s`` is spent (the rest goes out on the next flush, so a long backlog never
        holds the Monitor for long). Consecutive metric ops are merged into batches of <= 1000."""
        sent = 0
        t_end = None if budget_s is None else time.monotonic() + budget_s
        try:
            while self._pending:
                if t_end is not None and sent and time.monotonic() >= t_end:
                    return
                group = self._head_group()
                op = (
                    group[0]
                    if len(group) == 1
                    else {"op": "metrics", "metrics": [m for g in group for m in g["metrics"]]}
                )
                try:
                    self._send(op)
                except Exception as exc:
                    if is_transient_error(exc):
                        self._retry_delay = min(self.retry_max_s, self._retry_delay * 2)
                        self._retry_at = time.monotonic() + self._retry_delay
                        return
                    if op["op"] in _RUN_OPS:
                        # Nothing after it can be applied to this store; keep the spool for import_spool.
                        log.error(
                            "MLflow rejected the spooled %s operation (%s); tracking stops, the spool stays in %s",
                            op["op"],
                            exc,
                            self._spool_path,
                        )
                        self._retry_at = float("inf")
                        return
                    log.warning("MLflow rejected a spooled %s operation (dropped): %s", op["op"], exc)
                for _ in group:
                    self._discard_spooled_copy(self._pending.popleft())
                    sent += 1
        finally:
            if sent:
                self._rewrite_spool()
        log.info("MLflow tracking at %s is back: replayed %d spooled operations.", self.tracking_uri, sent)
        self._retry_delay = self.retry_initial_s

    def _head_group(self) -> list[dict]:
        """The head op, or the run of consecutive metric ops at the head that fits one log_batch."""
        head = self._pending[0]
        if head["op"] != "metrics":
            return [head]
        group, n = [], 0
        for op in self._pending:
            if op["op"] != "metrics" or n + len(op["metrics"]) > MAX_METRICS_PER_BATCH:
                break
            group.append(op)
            n += len(op["metrics"])
        return group or [head]

    def _spool_file(self) -> Path:
        if self._spool_path is None:
            assert self.spool_dir is not None
            with contextlib.suppress(OSError):  # a failed write is reported by _spool_append
                self.spool_dir.mkdir(parents=True, exist_ok=True)
            self._spool_path = self.spool_dir / f"spool-{self.run_id or self._local_id}.jsonl"
        return self._spool_path

    def _header(self) -> list[dict]:
        head = {"op": "meta", "tracking_uri": self.tracking_uri, "experiment": self.experiment}
        return [head] + ([{"op": "run", "run_id": self.run_id}] if self.run_id else [])

    def _spool_append(self, ops: list[dict]) -> None:
        if not ops:
            return
        path = self._spool_file()
        new = not path.exists() or not self._pending
        ops = [self._stash_artifact(op) for op in ops]
        self._pending.extend(ops)
        try:
            with open(path, "w" if new else "a", encoding="utf-8") as f:
                for rec in (self._header() if new else []) + ops:
                    f.write(json.dumps(rec) + "\n")
                f.flush()
        except OSError as exc:
            # The ops are still held in memory and replayed from there; only the crash-safety of the
            # file is lost. Say so once, never stop training over it.
            if not self._spool_write_failed:
                self._spool_write_failed = True
                log.warning("cannot write the MLflow spool file %s (%s); spooling in memory only", path, exc)

    def _rewrite_spool(self) -> None:
        path = self._spool_path
        if path is None:
            return
        try:
            if not self._pending:
                path.unlink(missing_ok=True)
                with contextlib.suppress(OSError):  # only removed when empty (all stashed copies sent)
                    (path.parent / f"{path.stem}-artifacts").rmdir()
                return
            tmp = path.with_suffix(".tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for rec in self._header() + list(self._pending):
                    f.write(json.dumps(rec) + "\n")
            os.replace(tmp, path)  # atomic: a crash leaves the old or the new spool, never half of one
        except OSError as exc:
            if not self._spool_write_failed:
                self._spool_write_failed = True
                log.warning(
                    "cannot rewrite the MLflow spool file %s (%s); spooling in memory only", path, exc
                )

    def _stash_artifact(self, op: dict) -> dict:
        """Copy a spooled artifact into the spool dir so the upload later sees today's file."""
        if op["op"] != "artifact" or op.get("stashed"):
            return op
        src = Path(op["path"])
        self._artifact_seq += 1
        dst_dir = self._spool_file().parent / f"{self._spool_file().stem}-artifacts" / str(self._artifact_seq)
        dst = dst_dir / src.name
        try:
            dst_dir.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, dst)
            else:
                shutil.copy2(src, dst)
        except OSError as exc:
            log.warning("could not stash artifact %s for later upload: %s", src, exc)
            return op
        return {**op, "path": str(dst), "stashed": True}

    def _discard_spooled_copy(self, op: dict) -> None:
        if op.get("op") == "artifact" and op.get("stashed"):
            shutil.rmtree(Path(op["path"]).parent, ignore_errors=True)

    # ---------------------------------------------------------------- system metrics
    def _init_system_metrics(self) -> None:
        try:
            import psutil
        except ImportError:
            self._system_metrics = False
            return
        self._proc = psutil.Process()
        # cpu_percent() measures since the previous call; prime it so the first sample is meaningful.
        psutil.cpu_percent(interval=None)
        self._proc.cpu_percent(interval=None)

    def _sample_system(self) -> dict[str, float]:
        import psutil

        vm = psutil.virtual_memory()
        out = {
            "system/cpu_percent": psutil.cpu_percent(interval=None),
            "system/memory_percent": vm.percent,
            "system/memory_used_gb": (vm.total - vm.available) / 2**30,
        }
        if self._proc is not None:
            with contextlib.suppress(psutil.Error):
                out["system/process_rss_gb"] = self._proc.memory_info().rss / 2**30
                out["system/process_cpu_percent"] = self._proc.cpu_percent(interval=None)
        return out


def status_for_exception(exc: BaseException | None) -> str:
    """FINISHED for no exception, KILLED for an interrupt (Ctrl-C, SIGTERM -> SystemExit), else FAILED."""
    if exc is None:
        return "FINISHED"
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            return "FINISHED"
        return "KILLED"
    return "FAILED"


# --------------------------------------------------------------------------------------------------
# Spool import
# --------------------------------------------------------------------------------------------------


def read_spool(path: str | os.PathLike) -> list[dict]:
    """The ops of a spool file (a torn last line, from a crash mid-write, is ignored)."""
    ops = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                ops.append(json.loads(line))
            except json.JSONDecodeError:
                log.warning("ignoring a torn line in spool %s", path)
    return ops


def import_spool(path: str | os.PathLike, tracking_uri: str | os.PathLike | None = None) -> str:
    """Replay a spool file left behind into ``tracking_uri`` (default: the URI recorded in the
    spool, else mlflow's default). Returns the run id. Raises on the first error; the file is
    removed only when every op was applied (replaying twice is harmless for metrics on SQL stores,
    whose rows are deduplicated by (key, timestamp, step, value))."""
    from mlflow import MlflowClient

    ops = read_spool(path)
    meta = next((o for o in ops if o.get("op") == "meta"), {})
    uri = resolve_tracking_uri(tracking_uri if tracking_uri is not None else meta.get("tracking_uri"))
    client = MlflowClient(tracking_uri=uri)
    state: dict = {"run_id": None}
    for op in ops:
        if op.get("op") == "meta":
            continue
        _apply_op(client, op, state)
    Path(path).unlink(missing_ok=True)
    return state["run_id"]


def main(argv: list[str] | None = None) -> int:
    """``python -m dflash_flow.observe.tracking import-spool PATH [--tracking-uri URI]``."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m dflash_flow.observe.tracking")
    sub = p.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import-spool", help="replay a spool file left behind by an unreachable store")
    imp.add_argument("path")
    imp.add_argument("--tracking-uri", default=None)
    args = p.parse_args(argv)
    run_id = import_spool(args.path, args.tracking_uri)
    print(f"imported {args.path} into run {run_id}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
