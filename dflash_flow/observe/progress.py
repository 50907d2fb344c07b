"""Console progress on rich: :class:`ProgressPrinter` (the training line) and :class:`ProgressBar` (counted
work), live on a terminal, a line every ``interval_s`` in a log; :class:`LoadProgress`, a source's reading."""

from __future__ import annotations

import contextlib
import math
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

import attrs

from .console import stream_console
from .schema import metric, mlflow_metrics


def format_duration(seconds: float | None) -> str:
    """``75`` -> ``1m15s``; ``3725`` -> ``1h02m``; None/inf -> ``?``."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "?"
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def format_rate(x: float | None) -> str:
    """Compact rate: 950 -> ``950``, 12345 -> ``12.3k``, 2.5e6 -> ``2.50M``."""
    if x is None or not math.isfinite(x):
        return "?"
    ax = abs(x)
    if ax >= 1e6:
        return f"{x / 1e6:.2f}M"
    if ax >= 1e4:
        return f"{x / 1e3:.1f}k"
    if ax >= 100:
        return f"{x:.0f}"
    return f"{x:.1f}"


class _StatusLine:
    """One status line on ``stream`` (see the module docstring); messages go above it."""

    def __init__(self, stream: TextIO | None, *, tty: bool | None, width: int | None, interval_s: float,
                 tty_interval_s: float) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if tty is None:
            try:
                tty = bool(self.stream.isatty())
            except (AttributeError, ValueError):
                tty = False
        self.tty = bool(tty)
        self.interval_s, self.tty_interval_s = float(interval_s), float(tty_interval_s)
        self.console = stream_console(self.stream, tty=self.tty, width=width)
        self.lock = threading.RLock()
        self.last_emit: float | None = None
        self.closed = False
        self._live: Any = None

    def due(self, now: float, force: bool) -> bool:
        interval = self.tty_interval_s if self.tty else self.interval_s
        return force or self.last_emit is None or now - self.last_emit >= interval

    def draw(self, text: str, now: float, renderable: Any = None) -> None:
        if self.tty:
            from rich.text import Text

            shown = renderable if renderable is not None else Text(text, no_wrap=True, overflow="ellipsis")
            if self._live is None:
                from rich.live import Live

                self._live = Live(
                    shown, console=self.console, auto_refresh=False, redirect_stdout=False, redirect_stderr=False
                )
                self._live.start(refresh=True)
                with _ON_SCREEN_LOCK:
                    _ON_SCREEN.append(self)
            else:
                self._live.update(shown, refresh=True)
        else:
            self.console.print(text)
        self.stream.flush()
        self.last_emit = now

    def message(self, text: str) -> None:
        with self.lock:
            self.console.print(text)  # with a live line, rich prints above it and redraws it
            self.stream.flush()

    def close(self) -> bool:
        """Stop the live line (it stays on screen). Returns False when already closed."""
        with self.lock:
            if self.closed:
                return False
            self.closed = True
            if self._live is not None:
                with _ON_SCREEN_LOCK:
                    if self in _ON_SCREEN:
                        _ON_SCREEN.remove(self)
                self._live.stop()
                self.stream.flush()
            return True


# The live status lines on a terminal now, newest last: ``notice`` prints above the newest.
_ON_SCREEN: list[_StatusLine] = []
_ON_SCREEN_LOCK = threading.Lock()


def notice(text: str) -> None:
    """One line on stderr at once (e.g. what a stop signal does): above the live status line when one is
    on screen (a plain print would be drawn over at its next refresh). A console that is gone is ignored."""
    with _ON_SCREEN_LOCK:
        line = _ON_SCREEN[-1] if _ON_SCREEN else None
    with contextlib.suppress(OSError, ValueError):
        if line is not None:
            line.message(text)
        else:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()


class _Shown:
    """What both kinds of progress share: their status line (``_line``), a context manager that closes it."""

    _line: _StatusLine
    enabled = True

    @property
    def tty(self) -> bool:
        return self._line.tty

    def message(self, text: str) -> None:
        """Print a full line (a warning, an eval result) without mangling the progress line."""
        if self.enabled:
            self._line.message(text)

    def close(self) -> None:
        self._line.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ProgressPrinter(_Shown):
    """Training progress on ``stream`` (default stderr); ETA from the step rate since the first update."""

    def __init__(self, stream: TextIO | None = None, total_steps: int | None = None, interval_s: float = 30.0,
                 *, tty: bool | None = None, tty_interval_s: float = 0.2, width: int | None = None,
                 clock=time.monotonic, elapsed_before_s: float = 0.0) -> None:
        self._line = _StatusLine(stream, tty=tty, width=width, interval_s=interval_s, tty_interval_s=tty_interval_s)
        self.total_steps = total_steps
        self._clock = clock
        # A resumed run's clock goes on from its checkpoint's (``RunRecord.elapsed_before_s``).
        self.elapsed_before_s = float(elapsed_before_s)
        self._t0: float | None = None
        self._step0 = 0

    def eta_s(self, step: int, now: float) -> float | None:
        if self.total_steps is None or self._t0 is None:
            return None
        done, elapsed = step - self._step0, now - self._t0
        return max(0.0, (self.total_steps - step) * elapsed / done) if done > 0 and elapsed > 0 else None

    def format_line(self, step: int, *, epoch: int | None = None, tokens_per_s: float | None = None,
                    samples_per_s: float | None = None, loss: float | None = None, eta_s: float | None = None,
                    bottleneck: str | None = None, elapsed_s: float | None = None,
                    extra: Mapping[str, Any] | None = None) -> str:
        """The progress text. Fields that are None are left out; a log line starts with the elapsed time."""
        parts = [f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}"]
        if epoch is not None:
            parts.append(f"epoch {epoch}")
        if tokens_per_s is not None:
            parts.append(f"{format_rate(tokens_per_s)} tok/s")
        if samples_per_s is not None:
            parts.append(f"{format_rate(samples_per_s)} samples/s")
        if loss is not None and math.isfinite(loss):
            parts.append(f"loss {loss:.4f}")
        if self.total_steps or eta_s is not None:
            parts.append(f"ETA {format_duration(eta_s)}")
        if bottleneck:
            parts.append(f"bottleneck {bottleneck}")
        for k, v in (extra or {}).items():
            parts.append(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}")
        line = " | ".join(parts)
        if elapsed_s is not None and not self.tty:
            line = f"[{format_duration(elapsed_s):>6}] {line}"  # log lines need a time; a live line does not
        return line

    def update(self, step: int, *, eta_s: float | None = None, force: bool = False, **fields: Any) -> bool:
        """Record progress; draw it if the interval elapsed (or ``force``). Returns whether it drew.
        ``fields``: :meth:`format_line`'s (epoch, tokens_per_s, samples_per_s, loss, bottleneck, extra)."""
        now = self._clock()
        with self._line.lock:
            if self._line.closed:
                return False
            if self._t0 is None:
                self._t0, self._step0 = now, step
            if not self._line.due(now, force):
                return False
            line = self.format_line(step, eta_s=eta_s if eta_s is not None else self.eta_s(step, now),
                                    elapsed_s=self.elapsed_before_s + now - self._t0, **fields)
            self._line.draw(line, now)
            return True

    def show(self, text: str, *, force: bool = False) -> bool:
        """Draw ``text`` as the progress line (work after training), rate-limited; whether it drew."""
        now = self._clock()
        with self._line.lock:
            if self._line.closed or not self._line.due(now, force):
                return False
            if self._t0 is not None and not self.tty:
                text = f"[{format_duration(self.elapsed_before_s + now - self._t0):>6}] {text}"
            self._line.draw(text, now)
            return True


class ProgressBar(_Shown):
    """Counted work: ``done/total`` with a bar, rates and the ETA (``enabled=False``: silent). ``update(8,
    tok=4096)`` adds 8 units and 4096 ``tok``; ``done``: work before this run (in ``done/total``, not rates)."""

    def __init__(self, total: int, label: str = "", unit: str = "items", *, done: int = 0,
                 stream: TextIO | None = None, interval_s: float = 5.0, tty: bool | None = None,
                 tty_interval_s: float = 0.1, width: int | None = None, clock=time.monotonic,
                 enabled: bool = True, bar_width: int = 24) -> None:
        self.total = max(0, int(total))
        self.label, self.unit, self.done = label, unit, int(done)
        self.enabled, self.bar_width = bool(enabled), int(bar_width)
        self._done0 = self.done
        self._extra: dict[str, float] = {}
        self._clock = clock
        self._t0 = clock()
        self._line = _StatusLine(stream, tty=tty, width=width, interval_s=interval_s, tty_interval_s=tty_interval_s)
        self._shown_done: int | None = None

    def _tail(self, now: float) -> str:
        elapsed = max(now - self._t0, 0.0)
        rate = (self.done - self._done0) / elapsed if elapsed > 0 else 0.0
        eta = max(0, self.total - self.done) / rate if rate > 0 else None
        rates = {k: v / elapsed if elapsed > 0 else 0.0 for k, v in self._extra.items()}
        parts = [f"{format_rate(rate)} {self.unit}/s"] + [f"{format_rate(r)} {k}/s" for k, r in rates.items()]
        return " | ".join(parts) + f" | {format_duration(elapsed)} elapsed, ETA {format_duration(eta)}"

    def _fraction(self) -> float:
        return min(1.0, self.done / self.total) if self.total else 1.0

    def format_line(self, now: float | None = None) -> str:
        """The plain text of the bar (what a log gets): ``label [####----] 10/40  25% | ...``."""
        now = self._clock() if now is None else now
        frac = self._fraction()
        filled = int(frac * self.bar_width)
        bar = "#" * filled + "-" * (self.bar_width - filled)
        head = f"{self.label} " if self.label else ""
        return f"{head}[{bar}] {self.done}/{self.total} {frac:4.0%} | {self._tail(now)}"

    def _renderable(self, now: float):
        from rich.progress_bar import ProgressBar as RichBar
        from rich.table import Table

        grid = Table.grid(padding=(0, 1))
        row = []
        if self.label:
            grid.add_column(no_wrap=True)
            row.append(self.label)
        grid.add_column(width=self.bar_width)
        grid.add_column(no_wrap=True, overflow="ellipsis")
        row.append(RichBar(total=float(self.total or 1), completed=float(self.done if self.total else 1), width=self.bar_width))
        row.append(f"{self.done}/{self.total} {self._fraction():4.0%} | {self._tail(now)}")
        grid.add_row(*row)
        return grid

    def update(self, done_delta: int = 1, **extra: float) -> bool:
        """Add work done; draw if the interval elapsed or the work is complete. Returns whether it drew."""
        now = self._clock()
        with self._line.lock:
            self.done += int(done_delta)
            for k, v in extra.items():
                self._extra[k] = self._extra.get(k, 0.0) + float(v)
            if not self.enabled or self._line.closed:
                return False
            complete = self.total > 0 and self.done >= self.total and self._shown_done != self.done
            if not self._line.due(now, complete):
                return False
            self._show(now)
            return True

    def _show(self, now: float) -> None:
        self._line.draw(self.format_line(now), now, self._renderable(now) if self._line.tty else None)
        self._shown_done = self.done

    def close(self) -> None:
        """Show the final state (in a log, if it changed since the last line) and end the live line."""
        with self._line.lock:
            if self.enabled and not self._line.closed and self._shown_done != self.done:
                self._show(self._clock())
            self._line.close()


# ----------------------------------------------------------------- reading a source's inputs (data.records)


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
        self.console, self.tracker, self.log_every_s, self.interval_s = console, tracker, log_every_s, interval_s
        self.stream = stream if stream is not None else sys.stderr
        self._bar: ProgressBar | None = None
        self._key: tuple | None = None
        self._done = self._records = self._tokens = 0
        self._last_log = -math.inf
        self.inputs_done = 0

    def update(self, p: Any) -> None:
        done, total, unit = (-(-p.done // 2**20), -(-p.total // 2**20), "MiB") if p.unit == "bytes" else (
            p.done, p.total, p.unit)
        verb = {"reading": "tokenizing", "waiting": f"waiting for {p.holder or 'another process'} to tokenize",
                "cached": "mapped from the cache", "done": "tokenized"}[p.state]
        key = (p.path, p.state == "waiting")
        if p.state == "cached" and self.console and self._bar is None:  # no work to show: one line
            self.stream.write(f"{self.name}: {Path(p.path).name}: {p.samples:,} samples, {p.tokens:,} tokens mapped "
                              f"from the cache in {p.elapsed_s:.2f} s\n")
            self.stream.flush()
        elif self.console and (self._bar is None or key != self._key):  # a new input, or it started waiting
            if self._bar is not None:
                self._bar.close()
            self._bar = ProgressBar(total, "", unit, stream=self.stream, interval_s=self.interval_s)
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
                self.close()
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
