"""The MLflow store: where a run goes (URI resolution, a fast pre-flight check), which errors mean "try again
later", and the store writes: *ops*, small JSON-able dicts (``create_run``, ``run``, ``resume``, ``params``,
``tags``, ``metrics``, ``artifact``, ``end``) sent now, spooled, or replayed later by ``import-spool``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from dflash_flow.util import nearest_existing, probe_write

from .runinfo import redact_text, redact_uri

RUN_OPS = ("create_run", "run", "resume")  # ops that define which run the later ops go to
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_HTTP_ENV_LOCK = threading.RLock()


def now_ms() -> int:
    return int(time.time() * 1000)


def chunks(seq: list, n: int) -> Iterator[list]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


# ------------------------------------------------------------------------------------ where a run goes


def resolve_tracking_uri(tracking_uri: str | os.PathLike | None) -> str:
    """None -> mlflow's own default (``MLFLOW_TRACKING_URI`` or ``sqlite:///<cwd>/mlflow.db``);
    a plain filesystem path -> ``sqlite:///<abs path>`` (a directory gets ``mlflow.db`` inside);
    anything with a scheme (``sqlite:``, ``http:``, ``databricks``...) is passed through."""
    if tracking_uri is None:
        import mlflow

        return mlflow.get_tracking_uri()
    uri = os.fspath(tracking_uri)
    if uri == "databricks" or _SCHEME.match(uri):
        return uri
    path = Path(uri).expanduser().absolute()
    if path.is_dir():
        path = path / "mlflow.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return "sqlite:///" + path.as_posix()


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite://`` URI (None for other URIs and in-memory databases)."""
    if not uri.lower().startswith("sqlite://"):
        return None
    rest = uri[len("sqlite://") :].split("?", 1)[0]
    path = unquote(rest[1:] if rest.startswith("/") else rest)  # sqlite:///rel.db, sqlite:////abs.db
    return None if path in ("", ":memory:") else Path(path)


def _probe_dir(directory: Path, target: Path) -> str | None:
    """Create and remove a file in ``directory``: the only check that also holds for root, read-only
    mounts and ACLs (``os.access`` answers yes to root on a read-only filesystem)."""
    why = probe_write(directory)
    return f"cannot write {target}: {directory} is not writable ({why})" if why else None


def _check_new(target: Path, start: Path, what: str) -> str | None:
    base = nearest_existing(start)
    if not base.is_dir():
        return f"cannot create {what} {target}: {base} is not a directory"
    return _probe_dir(base, target)


def _check_file(db: Path) -> str | None:
    if db.exists():
        if db.is_dir():
            return f"tracking database {db} is a directory"
        if not os.access(db, os.W_OK):
            return f"tracking database {db} is not writable"
        return _probe_dir(db.parent, db)  # sqlite writes its journal next to the file
    return _check_new(db, db.parent, "tracking database")


def check_tracking_uri(tracking_uri: str | os.PathLike | None) -> str | None:
    """None when the store at ``tracking_uri`` looks usable, else a one-line reason naming the path. Instant:
    a local store must be writable or creatable (a probe file in the nearest existing directory, nothing else
    created); ``http(s):`` needs a host and a valid port (no request); other schemes are left to mlflow."""
    if tracking_uri is None:
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or str(Path.cwd() / "mlflow.db")
    uri = os.fspath(tracking_uri)
    if not uri.strip():
        return "tracking_uri is empty"
    if uri == "databricks":
        return None
    if not _SCHEME.match(uri):
        path = Path(uri).expanduser().absolute()
        return _check_file(path / "mlflow.db" if path.is_dir() else path)
    scheme = uri.split(":", 1)[0].lower()
    if scheme == "sqlite":
        db = sqlite_path(uri)
        return None if db is None else _check_file(db.expanduser().absolute())
    if scheme == "file":
        directory = Path(unquote(urlsplit(uri).path))
        if directory.exists() and not directory.is_dir():
            return f"tracking store {directory} is not a directory"
        return _check_new(directory, directory, "tracking store")
    if scheme in ("http", "https"):
        try:
            parts = urlsplit(uri)
            parts.port  # noqa: B018 - raises ValueError for a port that is not a number in range
        except ValueError as exc:
            return f"tracking_uri {redact_uri(uri)} has an invalid port ({exc})"
        if not parts.hostname:
            return f"tracking_uri {redact_uri(uri)} has no host"
    return None


def default_artifact_location(tracking_uri: str, experiment: str) -> str | None:
    """Keep a sqlite store self-contained: artifacts of experiments we create go to ``<db
    dir>/mlartifacts/<experiment>``, not the process's directory (None: other stores choose their own)."""
    db = sqlite_path(tracking_uri)
    if db is None or not tracking_uri.startswith("sqlite:///"):
        return None
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", experiment).strip("_") or "experiment"
    return (db.absolute().parent / "mlartifacts" / slug).as_uri()


# -------------------------------------------------------------------------------------------- errors


def is_transient_error(exc: BaseException) -> bool:
    """Whether an error from the store means "try again later" (spool) rather than "this op is bad": client
    errors (HTTP 4xx but 429) are permanent, retrying would wedge the spool; connection failures, timeouts,
    5xx, 429, local I/O and database locks are transient."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        try:
            status = int(exc.get_http_status_code())
        except Exception:
            status = 500
        return not (400 <= status < 500 and status != 429)
    # else transient: requests/urllib3 connection errors, OSError, sqlalchemy OperationalError, ...
    return not isinstance(exc, (FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, TypeError))


def is_missing_resource(exc: BaseException) -> bool:
    """The store says the run (or experiment) does not exist."""
    return getattr(exc, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


# SQLAlchemy's advice that precedes the database's own error in its messages ("(raised as a result of
# Query-invoked autoflush; ...)"): a one-line report skips it and shows the error, "database or disk is full".
_SQLALCHEMY_PREAMBLE = ("(raised as a result of", "(Background on this error")


def first_line(exc: BaseException, limit: int = 300, secrets: tuple[str, ...] = ()) -> str:
    """``Type: first line of the message`` (URLs and ``secrets`` redacted), for one-line reports."""
    text = [x for x in redact_text(str(exc), secrets).strip().splitlines() if x.strip()]
    useful = [x for x in text if not x.lstrip().startswith(_SQLALCHEMY_PREAMBLE)]
    text = useful or text
    return f"{type(exc).__name__}: {text[0][:limit]}" if text else type(exc).__name__


class _CaughtDatabaseError(logging.Filter):
    """Drops mlflow's log of every database error it re-raises (traceback and SQL: screens of text per batch
    while a disk is full; the Tracker reports the error in one line), unless DEBUG is asked for."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("SQLAlchemy database error"):
            return logging.getLogger("dflash_flow").isEnabledFor(logging.DEBUG)
        return True


_FILTER = _CaughtDatabaseError()


def quiet_store_errors() -> None:
    logger = logging.getLogger("mlflow.store.db.utils")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)


@contextlib.contextmanager
def bounded_http(uri: str, timeout_s: int, max_retries: int) -> Iterator[None]:
    """Bound mlflow's HTTP retries/timeout (7 retries, 120 s by default) for the calls made inside: they are
    environment variables read on every request, so a temporary override is the only per-call control.
    Variables the user set are left alone."""
    if not uri.startswith(("http://", "https://")):
        yield
        return
    overrides = {
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": str(int(max_retries)), "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "0",
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


# ----------------------------------------------------------------------------------------------- ops


@contextlib.contextmanager
def store_creation_lock(uri: str, timeout_s: float = 120.0) -> Iterator[None]:
    """A file lock next to a sqlite database, held while a process first opens it: mlflow makes a new
    database's tables on first use, and two runs starting at once would both try. Other URIs: no-op."""
    db = sqlite_path(uri)
    if db is None:
        yield
        return
    import fcntl

    lock_path = db.parent / f".{db.name}.create-lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{lock_path}: another process has held the store's creation lock "
                                       f"for {timeout_s:.0f} s") from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def open_client(uri: str) -> Any:
    """An MlflowClient on ``uri`` whose store exists: a sqlite database is created (tables made or
    upgraded) under :func:`store_creation_lock`, so runs started together on one new file all work."""
    from mlflow import MlflowClient

    quiet_store_errors()
    with store_creation_lock(uri):
        return MlflowClient(tracking_uri=uri)  # opens the store: a new database's tables are made here


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


def logged_steps(client: Any, run_id: str) -> dict[str, int]:
    """The last step the run has of each of its metrics (what a resumed run must not log again)."""
    return {key: max(steps) for key in client.get_run(run_id).data.metrics
            if (steps := [m.step for m in client.get_metric_history(run_id, key)])}


def new_metric_rows(rows: list, last_steps: dict[str, int]) -> list:
    """Each (metric, step) goes to the store once: a row at a step the metric already has (a resumed run
    training again past its checkpoint, a second sample at one step) is dropped; within ``rows`` the last
    value of a (metric, step) wins. Rows are ``[key, value, timestamp, step]``; steps rise per metric."""
    latest: dict[tuple[str, int], list] = {}
    for row in rows:
        key, step = row[0], int(row[3])
        if step > last_steps.get(key, -1):
            latest.pop((key, step), None)
            latest[(key, step)] = row
    return list(latest.values())


#: Tag prefix of a param whose value a resume changed (``resumed_with/<param>``: the value from then on).
RESUMED_WITH = "resumed_with/"


def apply_op(client: Any, op: dict, state: dict) -> None:
    """Perform one op against the store; ``state["run_id"]`` carries the run between ops."""
    from mlflow.entities import Metric, Param, RunTag

    kind = op["op"]
    if kind == "create_run":
        exp_id = _ensure_experiment(client, op["experiment"], op.get("artifact_location"))
        run = client.create_run(exp_id, start_time=op.get("start_time"), tags=op.get("tags") or None,
                                run_name=op.get("run_name"))
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
        state["last_steps"] = logged_steps(client, run_id)
        state["params"] = dict(client.get_run(run_id).data.params)  # a param, once logged, cannot change
    elif kind == "metrics":
        rows = new_metric_rows(op["metrics"], state.setdefault("last_steps", {}))
        if rows:
            metrics = [Metric(k, float(v), int(ts), int(step)) for k, v, ts, step in rows]
            client.log_batch(run_id, metrics=metrics, synchronous=True)
            for k, _, _, step in rows:
                state["last_steps"][k] = max(int(step), state["last_steps"].get(k, -1))
    elif kind == "params":
        # A resumed run already has its params: new keys are logged, a value that differs now (a setting a
        # resume may change, e.g. the Monitor's interval) goes to a tag, since MLflow refuses to change a param.
        known = state.get("params", {})
        new = {k: v for k, v in op["params"].items() if k not in known}
        changed = {f"{RESUMED_WITH}{k}": v for k, v in op["params"].items() if k in known and str(v) != known[k]}
        if new:
            client.log_batch(run_id, params=[Param(k, v) for k, v in new.items()], synchronous=True)
            known.update({k: str(v) for k, v in new.items()})
        if changed:
            client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in changed.items()], synchronous=True)
    elif kind == "tags":
        client.log_batch(run_id, tags=[RunTag(k, v) for k, v in op["tags"].items()], synchronous=True)
    elif kind == "artifact":
        log = client.log_artifacts if os.path.isdir(op["path"]) else client.log_artifact
        log(run_id, op["path"], op.get("artifact_path"))
    elif kind == "end":
        client.set_terminated(run_id, status=op["status"], end_time=op.get("end_time"))
    else:
        raise ValueError(f"unknown spool op {kind!r}")
