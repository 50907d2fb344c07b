"""Console output built with rich, configured in one place: no markup, emoji or highlighting of our text,
colour only on a real terminal, never Jupyter widgets; and streams whose reader may go away.
"""

from __future__ import annotations

import contextlib
import errno
import io
import math
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

# A reader that went away: the pipe's other end is closed (``run ... | head``), a socket was shut down, or the
# terminal hung up (a closed window, a dropped SSH session: its writes answer EIO after the SIGHUP).
_GONE_ERRNOS = frozenset({errno.EPIPE, errno.ESHUTDOWN, errno.ECONNRESET, errno.EIO})


class PipeSafeStream:
    """A text stream whose writes never fail because its reader went away (``run ... | head``): the first such
    write points its descriptor at ``/dev/null`` (the interpreter's flush at exit included) and drops output."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.reader_gone = False

    def _gone(self) -> None:
        with self._lock:
            if self.reader_gone:
                return
            self.reader_gone = True
            try:
                fd = self._stream.fileno()
                null = os.open(os.devnull, os.O_WRONLY)
                try:
                    os.dup2(null, fd)
                finally:
                    os.close(null)
            except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
                return  # no descriptor of its own (a StringIO, a closed file): dropping output is enough
            with contextlib.suppress(OSError, ValueError):
                self._stream.flush()  # what was buffered goes to /dev/null, not into the next write

    def _guard(self, call, *args):
        if self.reader_gone:
            return None
        try:
            return call(*args)
        except OSError as exc:
            if exc.errno not in _GONE_ERRNOS:
                raise
            self._gone()
            return None

    def write(self, text: str) -> int:
        out = self._guard(self._stream.write, text)
        return len(text) if out is None else out

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self._guard(self._stream.flush)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def guard_console_streams() -> None:
    """Make ``sys.stdout`` and ``sys.stderr`` :class:`PipeSafeStream` (once; a command's first call)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, PipeSafeStream):
            setattr(sys, name, PipeSafeStream(stream))


def stream_console(stream: TextIO, *, tty: bool, width: int | None = None):
    """A rich console writing to ``stream``; ``tty`` decides live rendering (rich would guess)."""
    from rich.console import Console

    return Console(file=stream, force_terminal=tty, force_jupyter=False, color_system="auto" if tty else None,
                   width=width, soft_wrap=not tty,  # a log line is never wrapped at rich's default 80 columns
                   highlight=False, markup=False, emoji=False)


def render(*renderables: Any, width: int = 100) -> str:
    """Render rich objects to plain text (no colour, trailing spaces and blank tail stripped)."""
    buf = io.StringIO()
    console = stream_console(buf, tty=False, width=width)
    console.soft_wrap = False
    for r in renderables:
        console.print(r)
    return "\n".join(ln.rstrip() for ln in buf.getvalue().splitlines()).rstrip("\n")


def pct(x: float) -> str:
    """A fraction as a whole percentage: ``0.456`` -> ``46%``."""
    return f"{100 * x:.0f}%"


def cell(v: Any) -> str:
    """A value as table text: compact numbers (a whole float as a count, ``1,010``), yes/no, empty for None."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        if v.is_integer() and abs(v) < 1e15:  # a count held as a float (tokens, steps): a count
            return f"{int(v):,}"
        if v != 0 and (abs(v) >= 1e6 or abs(v) < 1e-3):
            return f"{v:.3g}"
        return f"{v:,.2f}" if abs(v) >= 100 else f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def table(rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]], columns: Sequence[str] | None = None,
          *, title: str | None = None):
    """A rich Table of dicts (columns: keys in first-seen order, unless given) or sequences (``columns``:
    the headers, if any); all-number columns right-aligned."""
    from rich import box
    from rich.table import Table

    rows = list(rows)
    if rows and isinstance(rows[0], Mapping):
        if columns is None:
            columns = list(dict.fromkeys(k for r in rows for k in r))  # type: ignore[union-attr]
        body = [[r.get(c) for c in columns] for r in rows]  # type: ignore[union-attr]
    else:
        body = [list(r) for r in rows]
    n = max([len(columns or [])] + [len(r) for r in body]) if (body or columns) else 0
    headers = [str(c) for c in (columns or [])] + [""] * (n - len(columns or []))
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, show_header=bool(columns), show_edge=False, pad_edge=False)
    for i, h in enumerate(headers):
        values = [r[i] for r in body if i < len(r) and r[i] is not None]
        numeric = bool(values) and all(isinstance(v, (int, float)) and type(v) is not bool for v in values)
        t.add_column(h, justify="right" if numeric else "left", overflow="fold")
    for r in body:
        t.add_row(*[cell(v) for v in r] + [""] * (n - len(r)))
    return t


def render_table(rows: Sequence[Mapping[str, Any]] | Sequence[Sequence[Any]],
                 columns: Sequence[str] | None = None, *, title: str | None = None, width: int = 100) -> str:
    """:func:`table` rendered to a plain string ("" for no rows and no columns)."""
    rows = list(rows)
    if not rows and not columns:
        return ""
    return render(table(rows, columns, title=title), width=width)
