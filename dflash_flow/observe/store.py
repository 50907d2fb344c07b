"""The MLflow store: where a run goes (URI resolution, a fast pre-flight check), which errors mean "try again
later", the store writes (*ops*, small JSON-able dicts: ``create_run``, ``run``, ``resume``, ``params``,
``tags``, ``metrics``, ``artifact``, ``end``; sent now, spooled, or replayed by ``import-spool``), and run
metadata (params, the standard tags, MLflow's limits, ``core.redact``'s redaction); mlflow imported lazily.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from dflash_flow.core.redact import REDACTED, redact_text, redact_uri, redact_value, uri_secrets  # noqa: F401
from dflash_flow.util import config_hash, nearest_existing, probe_write

# mlflow's limits (mlflow.utils.validation); duplicated so that they are usable without importing mlflow.
MAX_METRICS_PER_BATCH = 1000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_PARAM_VAL_LENGTH = 6000
MAX_TAG_VAL_LENGTH = 8000
MAX_ENTITY_KEY_LENGTH = 250

# mlflow accepts Unicode word characters, "-", ".", " " and "/" in a key everywhere (":" too, except on
# Windows servers); anything else fails the whole log_batch request.
_KEY_BAD_CHARS = re.compile(r"[^\w\-. /]")


RUN_OPS = ("create_run", "run", "resume")  # ops that define which run the later ops go to
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*:")
_HTTP_ENV_LOCK = threading.RLock()


def now_ms() -> int:
    return int(time.time() * 1000)


def chunks(seq: list, n: int) -> Iterator[list]:
    for i in range(0, len(seq), n):
        yield seq[i : i + n]


def resolve_tracking_uri(tracking_uri: str | os.PathLike | None) -> str:
    """None -> mlflow's own default; a plain filesystem path -> ``sqlite:///<abs path>`` (a directory gets
    ``mlflow.db`` inside); anything with a scheme (``sqlite:``, ``http:``, ``databricks``...) as it is."""
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


def _check_new(target: Path, start: Path, what: str) -> str | None:
    """Whether ``target`` can be made under ``start``: a probe file in the nearest existing directory (the only
    check that also holds for root, read-only mounts and ACLs)."""
    base = nearest_existing(start)
    if not base.is_dir():
        return f"cannot create {what} {target}: {base} is not a directory"
    why = probe_write(base)
    return f"cannot write {target}: {base} is not writable ({why})" if why else None


def _check_file(db: Path) -> str | None:
    if db.is_dir():
        return f"tracking database {db} is a directory"
    if db.exists() and not os.access(db, os.W_OK):
        return f"tracking database {db} is not writable"
    return _check_new(db, db.parent, "tracking database")  # sqlite writes its journal next to the file


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


def is_transient_error(exc: BaseException) -> bool:
    """Whether a store error means "try again later" (spool), not "this op is bad": HTTP 4xx but 429 are
    permanent (a retry would wedge the spool); connection failures, 5xx, 429, I/O and locks are transient."""
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


# SQLAlchemy's advice before the database's own error ("database or disk is full"): a one-line report skips it.
_SQLALCHEMY_PREAMBLE = ("(raised as a result of", "(Background on this error")


def first_line(exc: BaseException, limit: int = 300, secrets: tuple[str, ...] = ()) -> str:
    """``Type: first line of the message`` (URLs and ``secrets`` redacted), for one-line reports."""
    text = [x for x in redact_text(str(exc), secrets).strip().splitlines() if x.strip()]
    useful = [x for x in text if not x.lstrip().startswith(_SQLALCHEMY_PREAMBLE)]
    text = useful or text
    return f"{type(exc).__name__}: {text[0][:limit]}" if text else type(exc).__name__


def _caught_database_error(record: logging.LogRecord) -> bool:
    """Drops mlflow's log of every database error it re-raises (traceback and SQL: screens of text per batch
    while a disk is full; the Tracker reports the error in one line), unless DEBUG is asked for."""
    if str(record.msg).startswith("SQLAlchemy database error"):
        return logging.getLogger("dflash_flow").isEnabledFor(logging.DEBUG)
    return True


def quiet_store_errors() -> None:
    logger = logging.getLogger("mlflow.store.db.utils")
    if _caught_database_error not in logger.filters:
        logger.addFilter(_caught_database_error)


@contextlib.contextmanager
def bounded_http(uri: str, timeout_s: int, max_retries: int) -> Iterator[None]:
    """Bound mlflow's HTTP retries/timeout (7 retries, 120 s by default) for the calls made inside, through the
    environment variables it reads on every request (the only per-call control); the user's are left alone."""
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
        yield
    finally:
        os.close(fd)  # releases the lock


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


def new_metric_rows(rows: list, last_steps: dict[str, int]) -> list:
    """``rows`` (``[key, value, timestamp, step]``) less those at a step the metric already has (a resumed
    run); the last value of a (metric, step) wins."""
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
        run = client.get_run(run_id)
        # Each metric's last step (a resumed run must not log it again); a param, once logged, cannot change.
        state["last_steps"] = {key: max(steps) for key in run.data.metrics
                               if (steps := [m.step for m in client.get_metric_history(run_id, key)])}
        state["params"] = dict(run.data.params)
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


def default_run_name(name: str, output_dir: str | os.PathLike | None) -> str:
    """The MLflow run name when ``tracking.run_name`` is unset: ``<name>-<output dir leaf>``
    (``dflash-cpu-short`` for ``runs/short``), or the leaf alone when it starts with the name."""
    leaf = Path(output_dir).name if output_dir is not None else ""
    if not leaf or leaf.startswith(name):
        return leaf or name
    return f"{name}-{leaf}"


def sanitize_key(key: str) -> str:
    """Make ``key`` acceptable to mlflow (word characters, ``-. /``; at most 250 characters): the last guard
    before the store (``observe.schema``'s keys are already valid)."""
    key = _KEY_BAD_CHARS.sub("_", str(key)).strip() or "_"
    return key[:MAX_ENTITY_KEY_LENGTH]


def truncate(value: str, limit: int) -> str:
    if len(value) <= limit:
        return value
    marker = "...[truncated]"
    return value[: limit - len(marker)] + marker


def hide_mlflow_urls(uri: str | os.PathLike | None) -> None:
    """When ``uri`` carries credentials, stop MLflow printing its own "View run NAME at: URL" lines (the URI
    password and all) through its documented switch; our own lines name the run with the URI redacted."""
    if uri is not None and uri_secrets(uri):
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"


def stringify(value: Any) -> str:
    """A param or tag value as MLflow text, with every URL in it (strings inside lists and dicts too) without
    its credentials (``core.redact``)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        with contextlib.suppress(TypeError, ValueError):
            return json.dumps(redact_value(list(value) if isinstance(value, (set, frozenset)) else value), default=str)
    return redact_text(str(value))


def tag_values(tags: Mapping[str, Any]) -> dict[str, str]:
    return {sanitize_key(k): truncate(stringify(v), MAX_TAG_VAL_LENGTH) for k, v in tags.items()}


def flatten_params(params: Mapping[str, Any] | None, *, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"a.b.c": "value"}``: lists holding containers keyed by index (``stages.0.name``),
    other lists JSON strings; values stringified (URLs redacted) and truncated, keys sanitized."""
    out: dict[str, str] = {}

    def walk(obj: Any, key: str) -> None:
        nested = isinstance(obj, (list, tuple)) and any(isinstance(v, (Mapping, list, tuple)) for v in obj)
        if isinstance(obj, Mapping) or nested:
            if not obj and key:
                out[sanitize_key(key)] = "{}"
            for k, v in obj.items() if isinstance(obj, Mapping) else enumerate(obj):
                walk(v, f"{key}.{k}" if key else str(k))
        else:
            out[sanitize_key(key or "value")] = truncate(stringify(obj), MAX_PARAM_VAL_LENGTH)

    walk(params or {}, prefix)
    return out


def run_params(config: Mapping[str, Any]) -> dict[str, Any]:
    """A resolved pipeline mapping as the run's params, stages keyed by name with config fields beside spec
    keys (``stages.drafter.lr``, as ``--set`` names them), whatever the stage order."""
    stages = {str(stage["name"]): {**{k: v for k, v in stage.items() if k not in ("name", "config")},
                                   **stage.get("config", {})} for stage in config.get("stages", [])}
    return {**{k: v for k, v in config.items() if k != "stages"}, "stages": stages}


def git_commit(cwd: str | os.PathLike | None = None) -> str | None:
    """The current git commit (with ``-dirty`` when the tree has changes), or None outside git."""
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{sha}-dirty" if dirty else sha


def run_tags(config: Mapping[str, Any] | None = None, *, world_size: int | None = None,
             device_summary: str | None = None, cwd: str | os.PathLike | None = None) -> dict[str, str]:
    """The standard tags of a run: git commit, config hash, world size, device summary."""
    tags: dict[str, str] = {}
    if commit := git_commit(cwd):
        tags["git_commit"] = commit
    if config is not None:
        tags["config_hash"] = config_hash(config)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1") or 1)
    tags["world_size"] = str(world_size)
    if device_summary:
        tags["device_summary"] = device_summary
    return tags
