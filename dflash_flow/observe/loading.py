"""Progress of reading and tokenizing a source's inputs: a console line and MLflow metrics.

A source reports ``ReadProgress``-like values (``data.ingest.ReadProgress``: path, state, unit, done,
total, records, samples, tokens, elapsed_s, holder, tokens_per_s, records_per_s, eta_s); `LoadProgress`
draws them as a progress bar per input (records, tokens/s, ETA; "waiting for pid N on HOST" while another
process builds the cache entry) and logs them, rate-limited, as `LoadPoint` metrics (``data/<stage>/...``,
docs/metrics.md) at step 0, before training starts.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import attrs

from .progress import ProgressBar
from .schema import metric, mlflow_metrics

__all__ = ["LoadPoint", "LoadProgress", "SourceLoad"]


@attrs.frozen
class SourceLoad:
    records: int = metric("records", reduce="sum", doc="Records read so far (the current input)")
    samples: int = metric("samples", reduce="sum", doc="Samples kept so far (the current input)")
    tokens: int = metric("tokens", reduce="sum", doc="Tokens kept so far (the current input)")
    tokens_per_s: float = metric("tokens_per_s", reduce="sum", doc="Tokens kept per second")
    records_per_s: float = metric("records_per_s", reduce="sum", doc="Records read per second")
    fraction: float = metric("fraction", reduce="mean", doc="Fraction of the current input read")
    eta_s: float | None = metric("eta_s", reduce="max", default=None, doc="Seconds left for the current input")
    inputs_done: int = metric("inputs_done", reduce="max", default=0, doc="Inputs of the source read so far")
    waiting: float = metric("waiting", reduce="max", default=0.0,
                            doc="1 while another process builds the cache entry the source waits for")


@attrs.frozen
class LoadPoint:
    step: int
    sources: dict[str, SourceLoad] = metric("data", doc="Per source stage while it reads")


class LoadProgress:
    """One source's reading progress on the console (``console``) and in MLflow (``tracker``)."""

    def __init__(self, name: str, *, console: bool, tracker: Any = None, log_every_s: float = 5.0,
                 stream: Any = None, interval_s: float = 5.0) -> None:
        self.name = name
        try:  # a machine without rich (the bare GPU image) reads without a progress line
            import rich.console  # noqa: F401
        except ImportError:
            console = False
        self.console = console
        self.tracker = tracker
        self.log_every_s = log_every_s
        self.stream = stream if stream is not None else sys.stderr
        self.interval_s = interval_s
        self._bar: ProgressBar | None = None
        self._key: tuple | None = None
        self._done = 0
        self._records = 0
        self._tokens = 0
        self._last_log = -math.inf
        self.inputs_done = 0

    def _scale(self, p: Any) -> tuple[int, int, str]:
        if p.unit == "bytes":
            return -(-p.done // 2**20), -(-p.total // 2**20), "MiB"
        return p.done, p.total, p.unit

    def update(self, p: Any) -> None:
        done, total, unit = self._scale(p)
        verb = {"reading": "tokenizing", "waiting": f"waiting for {p.holder or 'another process'} to tokenize",
                "cached": "mapped from the cache", "done": "tokenized"}[p.state]
        key = (p.path, p.state == "waiting")
        if p.state == "cached" and self.console and self._bar is None:  # no work to show: one line
            self.stream.write(f"{self.name}: {Path(p.path).name}: {p.samples:,} samples, {p.tokens:,} tokens mapped "
                              f"from the cache in {p.elapsed_s:.2f} s\n")
            self.stream.flush()
        elif self.console and (self._bar is None or key != self._key or (p.state in ("cached", "done"))):
            if self._bar is not None and key != self._key:
                self._bar.close()
                self._bar = None
            if self._bar is None:
                self._bar = ProgressBar(total, f"{self.name}: {verb} {Path(p.path).name}", unit, stream=self.stream,
                                        interval_s=self.interval_s)
                self._done = self._records = self._tokens = 0
            self._key = key
        final = p.state in ("cached", "done")
        if final and self._bar is not None and self._bar.done:  # complete the bar in the unit it counts
            done = total = self._bar.total
        if self._bar is not None:
            self._bar.total = max(total, 1)
            self._bar.label = f"{self.name}: {verb} {Path(p.path).name}"
            self._bar.update(max(done - self._done, 0), records=max(p.records - self._records, 0),
                             tok=max(p.tokens - self._tokens, 0))
            self._done, self._records, self._tokens = done, p.records, p.tokens
        if final:
            self.inputs_done += 1
            if self._bar is not None:
                self._bar.close()
                self._bar = None
                self._key = None
        now = time.monotonic()
        if self.tracker is not None and (final or now - self._last_log >= self.log_every_s):
            self._last_log = now
            load = SourceLoad(records=p.records, samples=p.samples, tokens=p.tokens, tokens_per_s=p.tokens_per_s,
                              records_per_s=p.records_per_s, fraction=p.fraction if not final else 1.0, eta_s=p.eta_s,
                              inputs_done=self.inputs_done, waiting=1.0 if p.state == "waiting" else 0.0)
            self.tracker.log_metrics(mlflow_metrics(LoadPoint(step=0, sources={self.name: load})), step=0)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
