"""The spool: a JSONL outbox of the ops the tracking store has not accepted yet (header, then the ops;
artifact copies in ``spool-<run>-artifacts/``), its replay (``import-spool``, uploading only files in that
directory) and :class:`SpooledDelivery`, the Tracker's delivery half.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash_flow.core.stopping import controller as stop_controller
from dflash_flow.util import atomic_write_text

from .store import (
    MAX_METRICS_PER_BATCH,
    REDACTED,
    RUN_OPS,
    apply_op,
    bounded_http,
    check_tracking_uri,
    default_artifact_location,
    first_line,
    hide_mlflow_urls,
    is_missing_resource,
    is_transient_error,
    quiet_store_errors,
    redact_uri,
    redact_value,
    resolve_tracking_uri,
    sqlite_path,
    uri_secrets,
)

log = logging.getLogger(__name__)
_tracking_log = logging.getLogger("dflash_flow.observe.tracking")  # the Tracker's warnings

IMPORT_HTTP_TIMEOUT_S = 120  # an artifact upload may be large
IMPORT_HTTP_RETRIES = 2


class SpoolError(Exception):
    """A spool that cannot be read or imported; the message is one line and names the file."""


def stash_dir_for(spool_path: str | os.PathLike) -> Path:
    p = Path(spool_path)
    return p.parent / f"{p.stem}-artifacts"


class SpoolFile:
    """The tracker's outbox on disk (crash-safety: the tracker holds the ops in memory too, and reports write
    failures). ``header()`` gives the lines written first whenever the file is (re)created."""

    def __init__(self, path: Path, header: Callable[[], list[dict]]) -> None:
        self.path = path
        self.stash_dir = stash_dir_for(path)
        self._header = header
        self._artifact_seq = 0

    def _line(self, op: dict) -> str:
        if op.get("op") == "artifact" and op.get("stashed"):
            with contextlib.suppress(ValueError):
                op = {**op, "path": Path(op["path"]).relative_to(self.stash_dir).as_posix()}
        if op.get("op") != "metrics":  # (numbers only) the last guard: no credential reaches the file
            op = redact_value(op)
        return json.dumps(op) + "\n"

    def append(self, ops: Iterable[dict], *, new: bool) -> None:
        """Add ops at the end (``new``: start the file over, header first)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w" if new else "a", encoding="utf-8") as f:
            for rec in (self._header() if new else []) + list(ops):
                f.write(self._line(rec))
            f.flush()

    def rewrite(self, pending: Iterable[dict]) -> None:
        """Replace the file by the header and ``pending`` (atomically: a crash leaves the old or the
        new spool, never half of one); with nothing pending, remove it and its empty stash."""
        pending = list(pending)
        if not pending:
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # only removed when empty (all stashed copies sent)
                self.stash_dir.rmdir()
            return
        atomic_write_text(self.path, "".join(self._line(rec) for rec in self._header() + pending))

    def stash(self, op: dict) -> dict:
        """Copy a spooled artifact into the stash so the upload later sees today's file (if it can)."""
        if op["op"] != "artifact" or op.get("stashed"):
            return op
        src = Path(op["path"])
        self._artifact_seq += 1
        dst = self.stash_dir / str(self._artifact_seq) / src.name
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
        except OSError as exc:
            _tracking_log.warning("could not stash artifact %s for later upload: %s", op.get("path"), exc)
            return op
        return {**op, "path": str(dst), "stashed": True}

    @staticmethod
    def discard(op: dict) -> None:
        """Remove the stashed copy of a sent artifact op."""
        if op.get("op") == "artifact" and op.get("stashed"):
            shutil.rmtree(Path(op["path"]).parent, ignore_errors=True)


def read_spool(path: str | os.PathLike) -> list[dict]:
    """The ops of a spool file (a torn line, from a crash mid-write, is skipped with a warning)."""
    ops = []
    with open(path, encoding="utf-8") as f:
        for line in filter(None, map(str.strip, f)):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                log.warning("ignoring a torn line in spool %s", path)
                continue
            if isinstance(rec, dict) and isinstance(rec.get("op"), str):
                ops.append(rec)
            else:
                log.warning("ignoring a line that is not a spool record in %s", path)
    return ops


# ------------------------------------------------------------------------------------------- import


def _artifact_source(op: dict, spool: Path, stash_real: Path) -> Path:
    """The real path of an artifact op, refused unless it lies inside the spool's stash directory
    (the path itself and, for a directory, every symlink under it)."""
    if not isinstance(op.get("path"), str) or not op["path"]:
        raise SpoolError(f"{spool}: an artifact record has no path")
    named = Path(op["path"])
    candidate = named if named.is_absolute() else stash_dir_for(spool) / named
    real = Path(os.path.realpath(candidate))
    if not real.is_relative_to(stash_real):
        raise SpoolError(f"{spool}: refusing to upload {named}: only files inside the spool's artifact directory "
                         f"{stash_dir_for(spool)} are uploaded")
    if not real.exists():
        raise SpoolError(f"{spool}: the artifact {named} named by the spool is missing from {stash_dir_for(spool)}")
    if real.is_dir():
        for dirpath, dirnames, filenames in os.walk(real, followlinks=False):
            for name in dirnames + filenames:
                entry = Path(dirpath) / name
                if entry.is_symlink() and not Path(os.path.realpath(entry)).is_relative_to(stash_real):
                    raise SpoolError(f"{spool}: refusing to upload {entry}: it links outside the spool's artifact directory")
    return real


def _keep_rest(spool: Path, meta: dict | None, run_id: str | None, rest: list[dict]) -> None:
    """After a partial import: the spool keeps what is left, continuing the run already created."""
    head = [meta] if meta else []
    if run_id and (not rest or rest[0].get("op") not in RUN_OPS[:2]):
        head.append({"op": "run", "run_id": run_id})
    with contextlib.suppress(OSError):
        atomic_write_text(spool, "".join(json.dumps(rec) + "\n" for rec in head + rest))


def import_spool(path: str | os.PathLike, tracking_uri: str | os.PathLike | None = None) -> str:
    """Replay a spool file into ``tracking_uri`` (default: the spool's); the run id, or a one-line
    :class:`SpoolError`. Checked whole before sending; a failure midway keeps the ops not yet applied."""
    spool = Path(path)
    meta, body = _spooled_ops(spool)
    uri = _import_uri(spool, meta, body, tracking_uri)
    # A run created offline has no artifact location: a sqlite store's own (by the .db), not ./mlruns.
    body = [{**o, "artifact_location": default_artifact_location(uri, o.get("experiment") or "")}
            if o["op"] == "create_run" and not o.get("artifact_location") else o for o in body]
    run_id = _replay(spool, meta, body, uri)
    spool.unlink(missing_ok=True)
    shutil.rmtree(stash_dir_for(spool), ignore_errors=True)
    return run_id


def _spooled_ops(spool: Path) -> tuple[dict | None, list[dict]]:
    """The spool's meta record (or None) and its ops, each artifact's path checked to be its own."""
    try:
        ops = read_spool(spool)
    except FileNotFoundError:
        raise SpoolError(f"{spool}: no such spool file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise SpoolError(f"{spool}: cannot read the spool ({first_line(exc)})") from None
    meta = next((o for o in ops if o["op"] == "meta"), None)
    body = [o for o in ops if o["op"] != "meta"]
    if not body or body[0]["op"] not in RUN_OPS[:2]:
        raise SpoolError(f"{spool}: not a dflash-flow spool (it does not start with a run record)")
    stash_real = Path(os.path.realpath(stash_dir_for(spool)))
    body = [{**o, "path": str(_artifact_source(o, spool, stash_real))} if o["op"] == "artifact" else o for o in body]
    return meta, body


def _import_uri(spool: Path, meta: dict | None, body: list[dict], tracking_uri: str | os.PathLike | None) -> str:
    """The tracking URI to import into, checked usable (and, for a run the spool continues in a sqlite
    store, that the database is still there)."""
    recorded = (meta or {}).get("tracking_uri")
    if tracking_uri is None and recorded and REDACTED in str(recorded):
        raise SpoolError(
            f"{spool}: the spool's tracking URI {recorded} had credentials, which spools do not keep; "
            "pass --tracking-uri"
        )
    source = tracking_uri if tracking_uri is not None else recorded
    if problem := check_tracking_uri(source):
        raise SpoolError(f"{spool}: {problem}")
    try:
        uri = resolve_tracking_uri(source)
    except OSError as exc:
        raise SpoolError(f"{spool}: cannot use tracking URI {redact_uri(os.fspath(source))}: {first_line(exc)}") from None
    hide_mlflow_urls(uri)
    db = sqlite_path(uri)
    if body[0]["op"] == "run" and db is not None and not db.exists():
        raise SpoolError(
            f"{spool}: tracking database {db} does not exist (deleted?); the spool continues run "
            f"{body[0].get('run_id')}, which only that database holds. Pass --tracking-uri for the store that has it"
        )
    return uri


def _replay(spool: Path, meta: dict | None, body: list[dict], uri: str) -> str:
    """Apply the ops in order into ``uri``; the run id. A failure midway keeps the ops not yet applied."""
    from mlflow import MlflowClient

    shown = redact_uri(uri)
    secrets = uri_secrets(uri)
    state: dict = {"run_id": None}
    quiet_store_errors()
    try:
        client = MlflowClient(tracking_uri=uri)
    except Exception as exc:
        raise SpoolError(f"{spool}: cannot open tracking store {shown}: {first_line(exc, secrets=secrets)}") from None
    for i, op in enumerate(body):
        try:
            # A server that is down fails in seconds (a few quick retries), not after mlflow's minutes.
            with bounded_http(uri, IMPORT_HTTP_TIMEOUT_S, IMPORT_HTTP_RETRIES):
                apply_op(client, op, state)
        except Exception as exc:
            if i:
                _keep_rest(spool, meta, state.get("run_id"), body[i:])
            if is_missing_resource(exc) and state.get("run_id"):
                raise SpoolError(
                    f"{spool}: run {state['run_id']} does not exist in {shown} (was the tracking database "
                    "deleted or replaced?)"
                ) from exc
            raise SpoolError(
                f"{spool}: importing into {shown} failed at the {op['op']} op: {first_line(exc, secrets=secrets)}"
            ) from exc
    return state["run_id"]


# ------------------------------------------------------------------------------------------- delivery


class SpooledDelivery:
    """The delivery half of a Tracker: the state it uses (``_client``, ``_state``, ``_io_lock``,
    ``_pending``, ``_spool``, the retry clock, ``spool_dir``, the timeouts) is set by ``Tracker.__init__``."""

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
                        if op["op"] in RUN_OPS:
                            raise  # e.g. resuming a run that does not exist: a config error, say so
                        _tracking_log.warning("MLflow rejected a %s operation (dropped): %s", op["op"], first_line(exc, secrets=self._secrets))
                        continue
                    self._enter_spool(ops[i:], exc)
                    return

    def _send(self, op: dict) -> None:
        timeout = self.artifact_timeout_s if op["op"] == "artifact" else self.http_timeout_s
        # A KeyboardInterrupt inside a sqlite transaction would leave it open and the database locked (the
        # run's final status could never be written): a stop signal waits until the write is done.
        with stop_controller().hold(), bounded_http(self.tracking_uri or "", timeout, self.http_max_retries):
            apply_op(self._client, op, self._state)

    def _enter_spool(self, ops: list[dict], exc: BaseException) -> None:
        self._retry_delay = self.retry_initial_s
        self._retry_at = time.monotonic() + self._retry_delay
        self._spool_append(ops)
        # One warning per outage (not per step); the recovery is logged at INFO.
        _tracking_log.warning("MLflow tracking at %s is unreachable (%s). Training continues; metrics are spooled "
                    "to %s and sent when the store is back.", self.display_uri, first_line(exc, 200, self._secrets),
                    self.spool_path)

    def _drain(self, budget_s: float | None = None) -> None:
        """Replay spooled ops from the oldest, consecutive metric ops merged into batches; stop at the first
        transient failure (then back off) or when ``budget_s`` is spent (a backlog never holds the Monitor)."""
        sent = 0
        t_end = None if budget_s is None else time.monotonic() + budget_s
        try:
            while self._pending:
                if t_end is not None and sent and time.monotonic() >= t_end:
                    return
                group = self._head_group()
                op = (group[0] if len(group) == 1 else
                      {"op": "metrics", "metrics": [m for g in group for m in g["metrics"]]})
                try:
                    self._send(op)
                except Exception as exc:
                    if is_transient_error(exc):
                        self._retry_delay = min(self.retry_max_s, self._retry_delay * 2)
                        self._retry_at = time.monotonic() + self._retry_delay
                        return
                    if op["op"] in RUN_OPS:
                        # Nothing after it can be applied to this store; keep the spool for import_spool.
                        _tracking_log.error("MLflow rejected the spooled %s operation (%s); tracking stops, the spool stays in %s",
                                  op["op"], first_line(exc, secrets=self._secrets), self.spool_path)
                        self._retry_at = float("inf")
                        return
                    _tracking_log.warning("MLflow rejected a spooled %s operation (dropped): %s", op["op"], first_line(exc, secrets=self._secrets))
                for _ in group:
                    SpoolFile.discard(self._pending.popleft())
                    sent += 1
        finally:
            if sent and self._spool is not None:
                try:
                    self._spool.rewrite(self._pending)
                except OSError as exc:
                    self._warn_spool_write(self._spool.path, exc)
        _tracking_log.info("MLflow tracking at %s is back: replayed %d spooled operations.", self.display_uri, sent)
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

    def _spool_file(self) -> SpoolFile:
        if self._spool is None:
            assert self.spool_dir is not None
            path = self.spool_dir / f"spool-{self.run_id or self._local_id}.jsonl"
            self._spool = SpoolFile(path, self._header)
        return self._spool

    def _header(self) -> list[dict]:
        head = {"op": "meta", "tracking_uri": self.display_uri, "experiment": self.experiment}
        return [head] + ([{"op": "run", "run_id": self.run_id}] if self.run_id else [])

    def _spool_append(self, ops: list[dict]) -> None:
        if not ops:
            return
        spool = self._spool_file()
        new = not spool.path.exists() or not self._pending
        ops = [spool.stash(op) for op in ops]
        self._pending.extend(ops)
        try:
            spool.append(ops, new=new)
        except OSError as exc:
            # The ops are replayed from memory; only the file's crash-safety is lost: say so once, train on.
            self._warn_spool_write(spool.path, exc)

    def _warn_spool_write(self, path: Path, exc: OSError) -> None:
        if not self._spool_write_failed:
            self._spool_write_failed = True
            _tracking_log.warning("cannot write the MLflow spool file %s (%s); spooling in memory only", path, exc)
