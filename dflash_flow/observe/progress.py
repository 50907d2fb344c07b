"""Console progress: one updating line on a terminal, plain periodic lines otherwise.

Why two modes: a ``\\r``-updated line is the least noisy thing on a terminal, but in a log file or a CI
capture every ``\\r`` update becomes garbage (Ray Data turned its bars off in jobs for that reason).
So when the stream is not a TTY we print a complete line every ``interval_s`` seconds instead.
"""

from __future__ import annotations

import math
import shutil
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO


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


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


class ProgressPrinter:
    """Progress of a run on ``stream`` (default stderr).

    ``update(step, ...)`` is cheap and may be called every step: output is rate-limited to one
    redraw per ``tty_interval_s`` on a terminal and one line per ``interval_s`` otherwise. ETA comes
    from the step rate since the first update (or ``eta_s`` when the caller knows better).
    """

    def __init__(
        self,
        stream: TextIO | None = None,
        total_steps: int | None = None,
        interval_s: float = 30.0,
        *,
        tty: bool | None = None,
        tty_interval_s: float = 0.2,
        width: int | None = None,
        clock=time.monotonic,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total_steps = total_steps
        self.interval_s = float(interval_s)
        self.tty = _isatty(self.stream) if tty is None else bool(tty)
        self.tty_interval_s = float(tty_interval_s)
        self.width = width
        self._clock = clock
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._step0 = 0
        self._last_emit: float | None = None
        self._last_len = 0
        self._line = ""
        self._closed = False

    # ------------------------------------------------------------------ formatting
    def eta_s(self, step: int, now: float) -> float | None:
        if self.total_steps is None or self._t0 is None:
            return None
        done = step - self._step0
        elapsed = now - self._t0
        if done <= 0 or elapsed <= 0:
            return None
        return max(0.0, (self.total_steps - step) * elapsed / done)

    def format_line(
        self,
        step: int,
        *,
        epoch: int | None = None,
        tokens_per_s: float | None = None,
        samples_per_s: float | None = None,
        loss: float | None = None,
        eta_s: float | None = None,
        bottleneck: str | None = None,
        elapsed_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        """The progress text (no ``\\r``/newline). Fields that are None are left out."""
        parts = []
        parts.append(f"step {step}/{self.total_steps}" if self.total_steps else f"step {step}")
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

    # ------------------------------------------------------------------ output
    def update(
        self,
        step: int,
        *,
        epoch: int | None = None,
        tokens_per_s: float | None = None,
        samples_per_s: float | None = None,
        loss: float | None = None,
        bottleneck: str | None = None,
        eta_s: float | None = None,
        extra: Mapping[str, Any] | None = None,
        force: bool = False,
    ) -> bool:
        """Record progress; draw it if the interval elapsed (or ``force``). Returns whether it drew."""
        now = self._clock()
        with self._lock:
            if self._closed:
                return False
            if self._t0 is None:
                self._t0, self._step0 = now, step
            interval = self.tty_interval_s if self.tty else self.interval_s
            if not force and self._last_emit is not None and now - self._last_emit < interval:
                return False
            if eta_s is None:
                eta_s = self.eta_s(step, now)
            line = self.format_line(
                step,
                epoch=epoch,
                tokens_per_s=tokens_per_s,
                samples_per_s=samples_per_s,
                loss=loss,
                eta_s=eta_s,
                bottleneck=bottleneck,
                elapsed_s=now - self._t0,
                extra=extra,
            )
            self._emit(line)
            self._last_emit = now
            return True

    def _columns(self) -> int:
        if self.width:
            return self.width
        return shutil.get_terminal_size((100, 24)).columns

    def _emit(self, line: str) -> None:
        if self.tty:
            # Stay on one terminal row: a wrapped line cannot be overwritten by "\r".
            line = line[: max(10, self._columns() - 1)]
            pad = " " * max(0, self._last_len - len(line))  # erase the tail of a longer previous line
            self.stream.write("\r" + line + pad)
            self._last_len = len(line)
        else:
            self.stream.write(line + "\n")
        self._line = line
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a full line (a warning, an eval result) without mangling the progress line."""
        with self._lock:
            if self.tty and self._last_len:
                self.stream.write("\r" + " " * self._last_len + "\r" + text + "\n")
                self.stream.write(self._line)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def close(self) -> None:
        """End the updating line (newline on a terminal). Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.tty and self._last_len:
                self.stream.write("\n")
                self.stream.flush()

    def __enter__(self) -> ProgressPrinter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:,.2f}" if abs(v) >= 100 else f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def summary_table(
    rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]],
    columns: Sequence[str] | None = None,
    *,
    title: str | None = None,
) -> str:
    """A plain-text table. ``rows`` are dicts (columns = keys in first-seen order, unless given) or
    sequences (then ``columns`` are the headers, if any). Numbers are right-aligned and compact."""
    rows = list(rows)
    if rows and isinstance(rows[0], Mapping):
        if columns is None:
            seen: dict[str, None] = {}
            for r in rows:
                for k in r:  # type: ignore[union-attr]
                    seen.setdefault(k, None)
            columns = list(seen)
        body = [[r.get(c) for c in columns] for r in rows]  # type: ignore[union-attr]
    else:
        body = [list(r) for r in rows]
    n = max([len(columns or [])] + [len(r) for r in body]) if (body or columns) else 0
    header = [str(c) for c in (columns or [])] + [""] * (n - len(columns or []))
    cells = [[_cell(v) for v in r] + [""] * (n - len(r)) for r in body]
    numeric = [
        all(
            isinstance(r[i], (int, float)) and not isinstance(r[i], bool)
            for r in body
            if i < len(r) and r[i] is not None
        )
        and any(i < len(r) and r[i] is not None for r in body)
        for i in range(n)
    ]
    widths = [max([len(header[i])] + [len(c[i]) for c in cells]) for i in range(n)]

    def fmt(row: list[str]) -> str:
        return "  ".join(
            row[i].rjust(widths[i]) if numeric[i] else row[i].ljust(widths[i]) for i in range(n)
        ).rstrip()

    lines = []
    if title:
        lines.append(title)
    if columns:
        lines.append(fmt(header))
        lines.append("  ".join("-" * w for w in widths))
    lines.extend(fmt(c) for c in cells)
    return "\n".join(lines)
