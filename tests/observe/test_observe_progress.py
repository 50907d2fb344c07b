from __future__ import annotations

import io

from dflash_flow.observe.progress import ProgressPrinter, format_duration, format_rate, summary_table


class TtyStream(io.StringIO):
    """A real in-memory stream that says it is a terminal."""

    def isatty(self) -> bool:
        return True


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_tty_updates_one_line_in_place():
    out, clock = TtyStream(), Clock()
    p = ProgressPrinter(out, total_steps=100, interval_s=30, tty_interval_s=0.5, width=200, clock=clock)
    assert p.tty
    assert p.update(0, epoch=0, tokens_per_s=12345.0, loss=2.5, bottleneck="padder")
    clock.t += 0.1
    assert not p.update(1, loss=2.4)  # rate-limited: no redraw within tty_interval_s
    clock.t += 10.0
    assert p.update(50, epoch=1, tokens_per_s=950.0, loss=1.25, bottleneck="trainer")
    p.close()
    text = out.getvalue()
    assert "\n" not in text[:-1] and text.endswith("\n"), "a tty gets one line rewritten with \\r"
    frames = text.rstrip("\n").split("\r")[1:]
    assert frames[0] == "step 0/100 | epoch 0 | 12.3k tok/s | loss 2.5000 | ETA ? | bottleneck padder"
    # 50 steps in 10.1 s -> 50 more steps take ~10 s; the shorter line pads over the longer one.
    assert (
        frames[1].rstrip() == "step 50/100 | epoch 1 | 950 tok/s | loss 1.2500 | ETA 10s | bottleneck trainer"
    )
    assert len(frames[1]) >= len(frames[0])


def test_tty_line_is_cut_to_terminal_width_and_messages_keep_the_line():
    out, clock = TtyStream(), Clock()
    p = ProgressPrinter(out, total_steps=10, width=30, clock=clock)
    p.update(1, loss=1.0, bottleneck="a-very-long-stage-name")
    assert all(len(f) <= 29 for f in out.getvalue().split("\r"))
    p.message("eval: acceptance 3.2")
    assert "eval: acceptance 3.2\n" in out.getvalue()
    assert out.getvalue().endswith(out.getvalue().split("\n")[-1]) and out.getvalue().split("\n")[
        -1
    ].startswith("step 1/10")


def test_non_tty_prints_plain_periodic_lines():
    out, clock = io.StringIO(), Clock()
    p = ProgressPrinter(out, total_steps=None, interval_s=30, clock=clock)
    assert not p.tty
    for step in range(0, 100):
        clock.t += 1.0
        p.update(step, epoch=0, samples_per_s=8.0, loss=3.0 - step / 100)
    p.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 4  # steps 0, 30, 60, 90 (one line per 30 s of a 100 s run)
    assert lines[0] == "[    0s] step 0 | epoch 0 | 8.0 samples/s | loss 3.0000"
    assert lines[1] == "[   30s] step 30 | epoch 0 | 8.0 samples/s | loss 2.7000"


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


def test_formatters():
    assert format_duration(75) == "1m15s"
    assert format_duration(3725) == "1h02m"
    assert format_duration(None) == "?" and format_duration(float("inf")) == "?"
    assert format_rate(12345) == "12.3k" and format_rate(2.5e6) == "2.50M" and format_rate(3.14159) == "3.1"


def test_summary_table_aligns_columns():
    rows = [
        {"stage": "source", "replicas": 1, "items": 1200, "busy": 0.1},
        {"stage": "padder", "replicas": 3, "items": 1200, "busy": 0.955, "note": "bottleneck"},
    ]
    t = summary_table(rows, title="Stages")
    assert t.splitlines() == [
        "Stages",
        "stage   replicas  items   busy  note",
        "------  --------  -----  -----  ----------",
        "source         1  1,200    0.1",
        "padder         3  1,200  0.955  bottleneck",
    ]
    assert summary_table([("loss", 1.5), ("steps", 10)]).splitlines() == ["loss   1.5", "steps   10"]
    assert summary_table([]) == ""
