"""Ctrl-C, SIGTERM and SIGHUP against a real pipeline process: prompt, clean exit with PipelineInterrupted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

SCRIPT = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {here!r})
    import stages_for_tests
    from dflash_flow.core import Graph, Pipeline, PipelineInterrupted, RuntimeOptions

    service_s = float(sys.argv[1])
    g = Graph(runtime=RuntimeOptions(capacity=8, drain_timeout_s=60, shutdown_grace_s=10, watchdog_interval_s=0.05))
    g.add("src", "TestInfiniteSource", config={{"period_s": 0.001}})
    g.add("mid", "TestSleep", config={{"service_s": service_s}}, inputs=["src"])
    g.add("sink", "TestSink", inputs=["mid"])
    started = threading.Event()
    services = {{"started": started}}
    p = Pipeline(g, services=services, check_devices=False)
    threading.Thread(target=lambda: (started.wait(), print("READY", flush=True)), daemon=True).start()
    try:
        p.run()
    except PipelineInterrupted as exc:
        items = [i for _, i in services.get("sink:sink", [])]
        gapless = items == list(range(len(items)))
        left = [t.name for t in threading.enumerate() if t.name.startswith("dflash-flow")]
        print(f"INTERRUPTED {{exc.reason}} items={{len(items)}} gapless={{gapless}} left={{left}}", flush=True)
        sys.exit(3)
    print("FINISHED", flush=True)
    """
)


def _start(tmp_path: Path, service_s: float) -> subprocess.Popen:
    script = tmp_path / "pipeline_script.py"
    script.write_text(SCRIPT.format(here=str(HERE)))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(service_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL),  # the test itself may run under nohup
    )
    guard = threading.Timer(60, proc.kill)  # never hang the suite on a script that does not start
    guard.start()
    try:
        line = proc.stdout.readline()
    finally:
        guard.cancel()
        guard.join()
    if line.strip() != "READY":
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"pipeline script did not start: {line!r} {out!r} {err!r}")
    return proc


def _finish(proc: subprocess.Popen, timeout: float = 10.0) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"pipeline process hung after the signal: {out!r} {err!r}")
    return proc.returncode, out, err


@pytest.mark.parametrize("sig,reason", [(signal.SIGINT, "SIGINT"), (signal.SIGTERM, "SIGTERM"), (signal.SIGHUP, "SIGHUP")])
def test_signal_stops_a_running_pipeline_cleanly(tmp_path, sig, reason):
    proc = _start(tmp_path, 0.002)
    time.sleep(0.2)
    t0 = time.monotonic()
    proc.send_signal(sig)
    rc, out, err = _finish(proc)
    assert time.monotonic() - t0 < 10
    assert rc == 3, (out, err)
    assert f"INTERRUPTED {reason} " in out
    assert "gapless=True" in out and "left=[]" in out
    assert "Traceback" not in err


def test_second_ctrl_c_cancels_a_slow_drain(tmp_path):
    # 0.5 s per item with a full queue of 8: draining would take ~4 s; the second Ctrl-C cuts it short.
    proc = _start(tmp_path, 0.5)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert proc.poll() is None  # still draining after the first Ctrl-C
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    rc, out, err = _finish(proc)
    assert time.monotonic() - t0 < 3.5
    assert rc == 3, (out, err)
    assert "INTERRUPTED SIGINT" in out and "left=[]" in out
    assert "Traceback" not in err


def test_sigterm_handler_is_restored_after_run(tmp_path):
    script = tmp_path / "restore.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import signal, sys
            sys.path.insert(0, {str(HERE)!r})
            import stages_for_tests
            from dflash_flow.core import Graph, Pipeline
            before = signal.getsignal(signal.SIGTERM)
            g = Graph()
            g.add("src", "TestSource", config={{"count": 3}})
            g.add("sink", "TestSink", inputs=["src"])
            Pipeline(g, check_devices=False).run()
            print(signal.getsignal(signal.SIGTERM) is before)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=os.environ
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
