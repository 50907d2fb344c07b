"""The stop controller (core.stopping): the one place that installs signal handlers, and what a stop signal
does in each phase of a run (starting, running, ending, late), SIGHUP included. Signals are sent to real
child processes (never to the test process), each a few lines of Python."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_flow"
HERE = Path(__file__).resolve().parent

# The guard (engine/guard.py) is a program of its own: the small process between a run and a vLLM server
# it started, stdlib only; its SIGTERM handling is that process's, not a run's.
OWN_PROGRAMS = {"dflash_flow/engine/guard.py"}


def _signal_handler_calls(path: Path) -> list[int]:
    """Lines of ``path`` that install a signal handler: ``signal.signal(...)`` under any alias of the
    module, or ``signal(...)`` imported from it."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "signal"}
        elif isinstance(node, ast.ImportFrom) and node.module == "signal":
            functions |= {a.asname or a.name for a in node.names if a.name == "signal"}
    lines = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if (isinstance(f, ast.Attribute) and f.attr == "signal" and isinstance(f.value, ast.Name)
                and f.value.id in modules) or (isinstance(f, ast.Name) and f.id in functions):
            lines.append(node.lineno)
    return lines


def test_one_module_installs_signal_handlers():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        lines = _signal_handler_calls(path)
        if lines and rel not in OWN_PROGRAMS:
            found[rel] = lines
    assert list(found) == ["dflash_flow/core/stopping.py"], found


def test_the_scan_sees_every_spelling(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import signal as s\nfrom signal import signal as install\ns.signal(2, None)\ninstall(15, None)\n"
                 "import os\nos.signal = 1\n")
    assert _signal_handler_calls(f) == [3, 4]


def _child(code: str, *, sighup_ignored: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (SIGHUP at its default, or ignored as under ``nohup``)."""
    def start():
        signal.signal(signal.SIGHUP, signal.SIG_IGN if sighup_ignored else signal.SIG_DFL)

    prelude = "import os, signal, sys, time\nfrom dflash_flow.core.stopping import Phase, StopSignal, controller\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=start, cwd=ROOT)


def test_a_stop_signal_raises_while_starting_sighup_too_unless_nohup_ignores_it():
    code = """
        c = controller()
        c.install()
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                os.kill(os.getpid(), sig)
                time.sleep(5)
                print("not raised", sig)
            except StopSignal as exc:
                print("raised", exc.name, isinstance(exc, KeyboardInterrupt))
    """
    out = _child(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["raised SIGINT True", "raised SIGTERM True", "raised SIGHUP True"]

    out = _child("""
        controller().install()
        print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, flush=True)
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.2)
        print("still here")
    """, sighup_ignored=True)
    assert out.returncode == 0 and out.stdout.split() == ["True", "still", "here"], out


def test_a_held_signal_is_raised_when_the_outermost_hold_ends_and_ending_only_records():
    out = _child("""
        c = controller()
        c.install()
        steps = []
        try:
            with c.hold():
                with c.hold():
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(0.1)
                    steps.append("inner block finished")
                steps.append("outer block finished")
        except StopSignal as exc:
            steps.append("raised " + exc.name)
        try:
            with c.hold():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
                raise OSError("the write failed")
        except StopSignal as exc:
            steps.append(f"raised {exc.name} from {exc.__cause__}")
        ending = c.enter_ending()
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        steps.append(f"ending recorded {[signal.Signals(s).name for s in ending.received]}")
        print(steps)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["inner block finished", "outer block finished", "raised SIGTERM",
                                      "raised SIGINT from the write failed",
                                      "ending recorded ['SIGHUP', 'SIGINT']"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_late_signal_ends_the_process_at_once_with_the_decided_code(sig):
    out = _child(f"""
        c = controller()
        c.install()
        c.decide(3)
        print("decided", flush=True)
        os.kill(os.getpid(), {int(sig)})
        time.sleep(30)
        print("not reached")
    """)
    assert out.returncode == 3 and out.stdout.strip() == "decided", out


def test_a_run_inside_a_program_takes_the_signals_for_its_stretch_only():
    """A program that installed nothing: a run takes SIGTERM, and SIGINT / SIGHUP where Python's default is
    in place (a handler of the program's own stays), and gives everything back afterwards."""
    out = _child("""
        mine = lambda *a: None
        signal.signal(signal.SIGINT, mine)
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        c = controller()
        with c.scope():
            during = {s: signal.getsignal(s) for s in before}
            with c.running():
                print(c.phase.value, end=" ")
            print(c.phase.value, end=" ")
        after = {s: signal.getsignal(s) for s in before}
        print(during[signal.SIGINT] is mine, during[signal.SIGTERM] == c._handle, during[signal.SIGHUP] == c._handle,
              after == before, c.installed)
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["running", "starting", "True", "True", "True", "True", "False"]


PIPELINE = """
sys.path.insert(0, {here!r})
import threading
import stages_for_tests
from dflash_flow.core import Graph, Pipeline, PipelineInterrupted, RuntimeOptions

g = Graph(runtime=RuntimeOptions(capacity=8, drain_timeout_s=60, shutdown_grace_s=10, watchdog_interval_s=0.05))
g.add("src", "TestInfiniteSource", config={{"period_s": 0.001}})
g.add("mid", "TestSleep", config={{"service_s": 0.5}}, inputs=["src"])
g.add("sink", "TestSink", inputs=["mid"])
started = threading.Event()
services = {{"started": started}}
p = Pipeline(g, services=services, check_devices=False)
threading.Thread(target=lambda: (started.wait(), print("READY", flush=True)), daemon=True).start()
c = controller()
with c.scope(announce=lambda reason, forced: print("ANNOUNCE", reason, forced, flush=True),
             after_running=Phase.ENDING):
    try:
        p.run()
    except PipelineInterrupted as exc:
        print("INTERRUPTED", exc.reason, c.phase.value, flush=True)
"""


def test_the_supervisor_announces_the_first_stop_at_once_and_the_second_forces():
    proc = subprocess.Popen([sys.executable, "-c", "import sys\nfrom dflash_flow.core.stopping import Phase, controller\n"
                             + PIPELINE.format(here=str(HERE))], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT,  # SIGHUP as by default, though the test may run under nohup
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    try:
        assert proc.stdout.readline().strip() == "READY"
        proc.send_signal(signal.SIGHUP)
        # Said while the drain (0.5 s an item, a queue of 8) is still going on: the process has not ended.
        assert proc.stdout.readline().strip() == "ANNOUNCE SIGHUP False"
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "ANNOUNCE SIGINT True"
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err
    assert out.strip() == "INTERRUPTED SIGHUP ending", (out, err)  # the phase after the run: the owner's
    assert "Traceback" not in err


def test_the_launcher_signals_only_running_ranks_that_are_its_torchrun_children(tmp_path):
    import json

    from dflash_flow.app.launch import running_ranks

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        records = [{"rank": 0, "status": "RUNNING", "pid": child.pid}, {"rank": 1, "status": "KILLED", "pid": child.pid},
                   {"rank": 2, "status": "RUNNING", "pid": 2 ** 22 + 7}, {"rank": 3, "status": "RUNNING"}]
        for rec in records:
            (tmp_path / f"rank{rec['rank']}.json").write_text(json.dumps(rec))
        import os

        assert running_ranks(tmp_path, os.getpid()) == [child.pid]
        assert running_ranks(tmp_path, other.pid) == []  # another process's child is never signalled
    finally:
        for p in (child, other):
            p.kill()
            p.wait()
