"""The spool: a local JSONL outbox of store ops that the tracking store has not accepted yet, and its
replay into a store (``dflash-flow import-spool``) when a run ended with ops still spooled.

Layout, next to each other in the spool directory::

    spool-<run>.jsonl             a header ({"op": "meta", ...}, then {"op": "run", ...} when the run
                                  exists), then the ops in order, one JSON object a line
    spool-<run>-artifacts/<n>/    copies of the artifacts logged while spooling (the upload later sees
                                  the file as it was when logged); spooled ops name them relative to
                                  this directory, so a moved run directory still imports

Replay trusts the spool only as far as it must: it uploads files inside the spool's own artifact
directory only (symlinks are not followed out of it), and every failure is one :class:`SpoolError`
line naming the file.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from dflash_flow.util import atomic_write_text

from .runinfo import REDACTED, hide_mlflow_urls, redact_uri, redact_value, uri_secrets
from .store import (
    RUN_OPS,
    apply_op,
    bounded_http,
    check_tracking_uri,
    default_artifact_location,
    first_line,
    is_missing_resource,
    quiet_store_errors,
    resolve_tracking_uri,
    sqlite_path,
)

log = logging.getLogger(__name__)

IMPORT_HTTP_TIMEOUT_S = 120  # an artifact upload may be large
IMPORT_HTTP_RETRIES = 2


class SpoolError(Exception):
    """A spool that cannot be read or imported; the message is one line and names the file."""


def stash_dir_for(spool_path: str | os.PathLike) -> Path:
    p = Path(spool_path)
    return p.parent / f"{p.stem}-artifacts"


class SpoolFile:
    """The tracker's outbox on disk (the ops themselves are also held in memory by the tracker).

    ``header()`` gives the lines written first whenever the file is (re)created. Write failures are
    the caller's to report: the file is crash-safety, not the only copy.
    """

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
        """Copy a spooled artifact into the stash so the upload later sees today's file. Raises OSError."""
        if op["op"] != "artifact" or op.get("stashed"):
            return op
        src = Path(op["path"])
        self._artifact_seq += 1
        dst_dir = self.stash_dir / str(self._artifact_seq)
        dst = dst_dir / src.name
        dst_dir.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
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
        for line in f:
            line = line.strip()
            if not line:
                continue
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


def _inside(root: Path, p: Path) -> bool:
    return p == root or root in p.parents


def _artifact_source(op: dict, spool: Path, stash_real: Path) -> Path:
    """The real path of an artifact op, refused unless it lies inside the spool's stash directory
    (the path itself and, for a directory, every symlink under it)."""
    if not isinstance(op.get("path"), str) or not op["path"]:
        raise SpoolError(f"{spool}: an artifact record has no path")
    named = Path(op["path"])
    candidate = named if named.is_absolute() else stash_dir_for(spool) / named
    real = Path(os.path.realpath(candidate))
    refuse = f"{spool}: refusing to upload {named}: only files inside the spool's artifact directory {stash_dir_for(spool)} are uploaded"
    if not _inside(stash_real, real):
        raise SpoolError(refuse)
    if not real.exists():
        raise SpoolError(f"{spool}: the artifact {named} named by the spool is missing from {stash_dir_for(spool)}")
    if real.is_dir():
        for dirpath, dirnames, filenames in os.walk(real, followlinks=False):
            for name in dirnames + filenames:
                entry = Path(dirpath) / name
                if entry.is_symlink() and not _inside(stash_real, Path(os.path.realpath(entry))):
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
    """Replay a spool file left behind into ``tracking_uri`` (default: the URI recorded in the spool,
    else mlflow's default). Returns the run id. Raises :class:`SpoolError` (one line) on any problem.

    Nothing is sent until the whole spool checked out (artifacts inside its own directory, a store
    that is usable, the run it continues still there). The file is removed once every op was applied;
    after a failure midway it keeps the ops not yet applied, so importing again neither repeats nor
    loses anything (metrics are deduplicated by SQL stores anyway).
    """
    spool = Path(path)
    meta, body = _spooled_ops(spool)
    uri = _import_uri(spool, meta, body, tracking_uri)
    # A run created offline against a server has no artifact location; in a sqlite store it gets the
    # store's own (next to the .db file), not ./mlruns of whatever directory the import ran in.
    body = [
        {**o, "artifact_location": default_artifact_location(uri, o.get("experiment") or "")}
        if o["op"] == "create_run" and not o.get("artifact_location")
        else o
        for o in body
    ]
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
    if not body or body[0]["op"] not in ("create_run", "run"):
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
    problem = check_tracking_uri(source)
    if problem:
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
