"""How a Tracker's store writes get delivered (``SpooledDelivery``, the Tracker's base class): ops are sent
in order; a transient failure spools that op and every later one to a local file (one warning per outage)
and later flushes replay the spool from its head with exponential backoff, merging metric ops into
batches; ops leave the spool only once the store accepted them. ``tracking`` explains the design."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from dflash_flow.core.stopping import controller as stop_controller

from .runinfo import MAX_METRICS_PER_BATCH
from .spool import SpoolFile
from .store import RUN_OPS, apply_op, bounded_http, first_line, is_transient_error

log = logging.getLogger("dflash_flow.observe.tracking")


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
                        log.warning("MLflow rejected a %s operation (dropped): %s", op["op"], first_line(exc, secrets=self._secrets))
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
        self._outages += 1
        self._retry_delay = self.retry_initial_s
        self._retry_at = time.monotonic() + self._retry_delay
        self._spool_append(ops)
        # One warning per outage (not per step); the recovery is logged at INFO.
        log.warning(
            "MLflow tracking at %s is unreachable (%s). Training continues; metrics are spooled "
            "to %s and sent when the store is back.",
            self.display_uri,
            first_line(exc, 200, self._secrets),
            self.spool_path,
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
                    if op["op"] in RUN_OPS:
                        # Nothing after it can be applied to this store; keep the spool for import_spool.
                        log.error(
                            "MLflow rejected the spooled %s operation (%s); tracking stops, the spool stays in %s",
                            op["op"],
                            first_line(exc, secrets=self._secrets),
                            self.spool_path,
                        )
                        self._retry_at = float("inf")
                        return
                    log.warning("MLflow rejected a spooled %s operation (dropped): %s", op["op"], first_line(exc, secrets=self._secrets))
                for _ in group:
                    SpoolFile.discard(self._pending.popleft())
                    sent += 1
        finally:
            if sent:
                self._rewrite_spool()
        log.info("MLflow tracking at %s is back: replayed %d spooled operations.", self.display_uri, sent)
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
        ops = [self._stash(spool, op) for op in ops]
        self._pending.extend(ops)
        try:
            spool.append(ops, new=new)
        except OSError as exc:
            # The ops are still held in memory and replayed from there; only the crash-safety of the
            # file is lost. Say so once, never stop training over it.
            self._warn_spool_write(spool.path, exc)

    def _rewrite_spool(self) -> None:
        if self._spool is None:
            return
        try:
            self._spool.rewrite(self._pending)
        except OSError as exc:
            self._warn_spool_write(self._spool.path, exc)

    def _warn_spool_write(self, path: Path, exc: OSError) -> None:
        if not self._spool_write_failed:
            self._spool_write_failed = True
            log.warning("cannot write the MLflow spool file %s (%s); spooling in memory only", path, exc)

    @staticmethod
    def _stash(spool: SpoolFile, op: dict) -> dict:
        try:
            return spool.stash(op)
        except OSError as exc:
            log.warning("could not stash artifact %s for later upload: %s", op.get("path"), exc)
            return op


