"""Progress on rich: a live line on a terminal, plain periodic lines in a log; tables as strings."""

from __future__ import annotations

import io
import re

from dflash_flow.observe.console import render_table
from dflash_flow.observe.progress import ProgressBar, ProgressPrinter, format_duration, format_rate

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class TtyStream(io.StringIO):
    """A real in-memory stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def frames(text: str) -> list[str]:
    """The successive states of a live line: rich erases the line ("\\r" + erase) before each redraw."""
    plain = ANSI.sub("", text.replace("\r\x1b[2K", "\r"))
    return [f for f in plain.split("\r") if f]


def test_tty_updates_one_line_in_place():
    out, clock = TtyStream(), Clock()
    p = ProgressPrinter(out, total_steps=100, interval_s=30, tty_interval_s=0.5, width=200, clock=clock)
    assert p.tty
    assert p.update(0, epoch=0, tokens_per_s=12345.0, loss=2.5, bottleneck="padder")
    clock.t += 0.1
    assert not p.update(1, loss=2.4)  # rate-limited: no redraw within tty_interval_s
    clock.t += 10.0
    assert p.update(50, epoch=1, tokens_per_s=950.0, loss=1.25, bottleneck="trainer")
    assert "\n" not in out.getvalue(), "a live line never moves down while it updates"
    p.close()
    text = out.getvalue()
    shown = frames(text)
    assert shown[0] == "step 0/100 | epoch 0 | 12.3k tok/s | loss 2.5000 | ETA ? | bottleneck padder"
    # 50 steps in 10.1 s -> 50 more steps take ~10 s.
    assert shown[1] == "step 50/100 | epoch 1 | 950 tok/s | loss 1.2500 | ETA 10s | bottleneck trainer"
    assert shown[-1].rstrip("\n") == shown[1], "close leaves the last state on screen"
    assert ANSI.sub("", text).endswith("\n")


def test_tty_line_is_cut_to_terminal_width_and_messages_keep_the_line():
    out, clock = TtyStream(), Clock()
    p = ProgressPrinter(out, total_steps=10, width=30, clock=clock)
    p.update(1, loss=1.0, bottleneck="a-very-long-stage-name")
    assert all(len(f) <= 30 for f in frames(out.getvalue()))
    p.message("eval: acceptance 3.2")
    text = ANSI.sub("", out.getvalue())
    assert "eval: acceptance 3.2\n" in text
    assert text.split("\n")[-1].replace("\r", "").startswith("step 1/10"), "the line is redrawn below the message"
    p.close()


def test_non_tty_prints_plain_periodic_lines():
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, total_steps=None, interval_s=30, clock=clock)
    assert not p.tty
    for step in range(0, 100):
        clock.t += 1.0
        p.update(step, epoch=0, samples_per_s=8.0, loss=3.0 - step / 100)
    p.message("eval val: tau 2.5")
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    assert len(lines) == 5  # steps 0, 30, 60, 90 (one line per 30 s of a 100 s run) and the message
    assert lines[0] == "[    0s] step 0 | epoch 0 | 8.0 samples/s | loss 3.0000"
    assert lines[1] == "[   30s] step 30 | epoch 0 | 8.0 samples/s | loss 2.7000"
    assert lines[-1] == "eval val: tau 2.5"


def test_log_lines_are_never_wrapped_or_marked_up():
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, total_steps=None, interval_s=1, clock=clock)
    p.update(1, bottleneck="[bold]stage-" + "x" * 200 + "[/bold] :smile:")
    assert out.getvalue() == "[    0s] step 1 | bottleneck [bold]stage-" + "x" * 200 + "[/bold] :smile:\n"


def test_force_and_close_are_idempotent():
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, total_steps=4, interval_s=1000, clock=clock)
    p.update(1)
    clock.t += 3.0
    assert p.update(4, force=True)
    p.close()
    p.close()
    assert not p.update(5, force=True)
    assert out.getvalue().splitlines()[-1] == "[    3s] step 4/4 | ETA 0s"


def test_progress_bar_plain_lines_rates_and_resume_offset():
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(40, "regenerate", "rec", done=4, stream=out, interval_s=5.0, clock=clock)
    assert not bar.tty
    for _ in range(9):
        clock.t += 2.0
        bar.update(4, tok=100)
    bar.close()
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines == [
        "regenerate [####--------------------] 8/40  20% | 2.0 rec/s | 50.0 tok/s | 2s elapsed, ETA 16s",
        "regenerate [############------------] 20/40  50% | 2.0 rec/s | 50.0 tok/s | 8s elapsed, ETA 10s",
        "regenerate [###################-----] 32/40  80% | 2.0 rec/s | 50.0 tok/s | 14s elapsed, ETA 4s",
        "regenerate [########################] 40/40 100% | 2.0 rec/s | 50.0 tok/s | 18s elapsed, ETA 0s",
    ], "the resumed 4 count toward done, not toward the rate; completion is always shown, once"
    assert bar.done == 40


def test_progress_bar_close_shows_an_unfinished_state_and_disabled_prints_nothing():
    out, clock = io.StringIO(), Clock()
    bar = ProgressBar(10, unit="items", stream=out, interval_s=60, clock=clock)
    clock.t += 1
    bar.update(2)
    clock.t += 1
    bar.update(3)  # within the interval: not shown now
    bar.close()
    assert out.getvalue().splitlines() == [
        "[####--------------------] 2/10  20% | 2.0 items/s | 1s elapsed, ETA 4s",
        "[############------------] 5/10  50% | 2.5 items/s | 2s elapsed, ETA 2s",
    ]
    quiet = io.StringIO()
    off = ProgressBar(3, "x", stream=quiet, enabled=False, clock=clock)
    off.update(3)
    off.close()
    assert quiet.getvalue() == "" and off.done == 3


def test_progress_bar_on_a_terminal_is_one_live_line():
    out, clock = TtyStream(), Clock()
    bar = ProgressBar(4, "regenerate", "rec", stream=out, width=120, tty_interval_s=0.0, clock=clock)
    for _ in range(4):
        clock.t += 1
        bar.update(1)
    assert "\n" not in out.getvalue()
    bar.close()
    shown = frames(out.getvalue())
    assert shown[0].startswith("regenerate ") and "1/4  25% | 1.0 rec/s" in shown[0]
    assert "4/4 100%" in shown[-1] and out.getvalue().count("\n") == 1


def test_formatters():
    assert format_duration(75) == "1m15s"
    assert format_duration(3725) == "1h02m"
    assert format_duration(None) == "?" and format_duration(float("inf")) == "?"
    assert format_rate(12345) == "12.3k" and format_rate(2.5e6) == "2.50M" and format_rate(3.14159) == "3.1"


def test_render_table_aligns_numbers_right():
    rows = [
        {"stage": "source", "replicas": 1, "items": 1200, "busy": 0.1},
        {"stage": "padder", "replicas": 3, "items": 1200, "busy": 0.955, "note": "bottleneck"},
    ]
    t = render_table(rows, title="Stages").splitlines()
    assert t[0] == "Stages"
    header = next(ln for ln in t if ln.startswith("stage"))
    assert header.split() == ["stage", "replicas", "items", "busy", "note"]
    padder = next(ln for ln in t if ln.startswith("padder"))
    source = next(ln for ln in t if ln.startswith("source"))
    assert padder.split() == ["padder", "3", "1,200", "0.955", "bottleneck"]
    assert source.index("0.1") + 3 == padder.index("0.955") + 5, "numbers are right-aligned"
    plain = render_table([("loss", 1.5), ("steps", 10)]).splitlines()
    assert [ln.split() for ln in plain] == [["loss", "1.5"], ["steps", "10"]]
    assert render_table([]) == ""


def test_a_closed_pipe_stops_printing_and_never_raises():
    """`dflash-flow run ... | head`: the reader closes the pipe; the progress line and messages keep
    being called, nothing raises, and the descriptor now writes to /dev/null (so the interpreter's flush
    at exit and any other writer of it are silent too)."""
    import os

    from dflash_flow.observe.console import PipeSafeStream

    r, w = os.pipe()
    raw = os.fdopen(w, "w", buffering=1)
    stream = PipeSafeStream(raw)
    p = ProgressPrinter(stream, total_steps=10, interval_s=0.0, tty=False)
    p.update(1)
    assert os.read(r, 4096).startswith(b"[")
    os.close(r)
    for step in range(2, 6):
        p.update(step, loss=0.5)
        p.message("eval trained: tau 2.0")
    p.close()
    assert stream.reader_gone
    assert os.path.samestat(os.fstat(raw.fileno()), os.stat(os.devnull))
    raw.write("after\n")
    raw.flush()  # the wrapped stream itself no longer fails either
    raw.close()


def test_other_write_errors_still_raise():
    import errno

    import pytest

    from dflash_flow.observe.console import PipeSafeStream

    class Full(io.StringIO):
        def write(self, s):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        PipeSafeStream(Full()).write("x")


def test_a_hung_up_terminal_stops_printing_and_never_raises():
    """A closed terminal window or a dropped SSH session: the terminal answers EIO to every write after
    the hang-up (a real pseudo-terminal whose other side closed). Printing stops; nothing raises."""
    import os
    import pty

    from dflash_flow.observe.console import PipeSafeStream

    master, slave = pty.openpty()
    raw = os.fdopen(slave, "w", buffering=1)
    stream = PipeSafeStream(raw)
    p = ProgressPrinter(stream, total_steps=10, interval_s=0.0, tty=False)
    p.update(1)
    assert os.read(master, 4096).startswith(b"[")
    os.close(master)
    for step in range(2, 6):
        p.update(step, loss=0.5)
        p.message("checkpoint saved")
    p.close()
    assert stream.reader_gone
    raw.close()


def test_a_resumed_run_s_clock_goes_on_from_its_checkpoint():
    """``elapsed_before_s``: the seconds the resumed runs had run (RunRecord.elapsed_before_s, from the
    checkpoint): the log lines' clock starts there, the rate and the ETA are this run's."""
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, total_steps=100, interval_s=30, clock=clock, elapsed_before_s=940.0)
    p.update(40)
    clock.t += 30.0
    p.update(70)
    p.show("evaluating", force=True)
    p.close()
    assert out.getvalue().splitlines() == ["[15m40s] step 40/100 | ETA ?", "[16m10s] step 70/100 | ETA 30s",
                                           "[16m10s] evaluating"]


def test_a_notice_is_printed_at_once_above_the_live_line(capsys):
    from dflash_flow.observe.progress import notice

    out, clock = TtyStream(), Clock()
    p = ProgressPrinter(out, total_steps=10, width=80, clock=clock)
    p.update(3, loss=1.0)
    notice("stopping after the batch in flight (Ctrl-C again to force)")
    text = ANSI.sub("", out.getvalue())
    assert "stopping after the batch in flight (Ctrl-C again to force)\n" in text
    assert text.split("\n")[-1].replace("\r", "").startswith("step 3/10"), "the line is redrawn below the notice"
    p.close()
    notice("no live line now")  # nothing on screen: a plain line on stderr
    assert capsys.readouterr().err == "no live line now\n"
