"""A prompt stop: a consumer that stops taking input abandons the work that can only reach it; long work
inside one item checks for the stop; a thread stuck in a stage's own code is abandoned, named, and does
not keep the process alive (issues 22.1 and 23.10)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import attrs
import pytest
from stages_for_tests import fast_runtime, wait_threads_back

from dflash_flow.core import Graph, Pipeline, PipelineInterrupted, Stage, register_stage


@register_stage
@attrs.define(kw_only=True, eq=False)
class StopAwareTrainer(Stage):
    """Takes items until the run stops, then drops the rest and abandons what only feeds it (as DrafterStep)."""

    cardinality = "1:1"

    def setup(self, ctx) -> None:
        self._ctx = ctx
        self._stopping = False
        ctx.services.setdefault("trained", [])
        ctx.services.setdefault("abandoned", [])

    def process(self, item):
        if not self._stopping and self._ctx.stop_requested.is_set():
            self._stopping = True
            self._ctx.services["abandoned"].extend(self._ctx.runtime.abandon_upstream(self._ctx.name))
        if self._stopping:
            return None
        self._ctx.services["trained"].append(item)
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class LongItems(Stage):
    """Each item is a long computation in small units (like decoding a prompt), checking for a stop."""

    def setup(self, ctx) -> None:
        self._ctx = ctx

    def process(self, item):
        for _ in range(6000):  # 60 s if nothing stops it
            self._ctx.check_stop()
            time.sleep(0.01)
        return (item,)


def test_a_stopped_consumer_abandons_the_work_queued_for_it(thread_baseline):
    g = Graph(runtime=fast_runtime(capacity=8, drain_timeout_s=30.0))
    g.add("src", "TestInfiniteSource", config={"period_s": 0.0005})
    g.add("work", "TestSleep", config={"service_s": 0.1}, inputs=["src"], replicas=2)
    g.add("trainer", "StopAwareTrainer", inputs=["work"])
    g.add("sink", "TestSink", inputs=["trainer"])
    services: dict = {}
    p = Pipeline(g, services=services, check_devices=False)
    threading.Timer(1.0, p.stop, args=("test stop",)).start()
    t0 = time.monotonic()
    with pytest.raises(PipelineInterrupted):
        p.run()
    took = time.monotonic() - t0 - 1.0
    work_in = sum(r.items_in for r in p.replicas["work"])
    trained = services["trained"]
    assert services["abandoned"] == ["src", "work"]
    # Queues of 8 behind 2 replicas of 0.1 s: a drain would take >= 0.4 s and process every queued item.
    # Abandoned, `work` finishes only what is in flight (one per replica) after the trainer stopped.
    assert work_in <= len(trained) + 2 + 2, (work_in, len(trained))
    assert sum(r.items_dropped for r in p.replicas["work"]) > 0
    assert took < 0.4, f"the stop took {took:.2f}s"
    # What the trainer emitted before the stop still reaches its consumer.
    assert sorted(i for _, i in services["sink:sink"]) == sorted(trained)
    assert wait_threads_back(thread_baseline) == []


def test_a_stage_that_also_feeds_another_branch_is_not_abandoned():
    g = Graph(runtime=fast_runtime())
    g.add("src", "TestSource", config={"count": 3, "plain": True})
    g.add("work", "TestPass", inputs=["src"])
    g.add("trainer", "StopAwareTrainer", inputs=["work"])
    g.add("other", "TestSink", inputs=["work"])
    g.add("sink", "TestSink", inputs=["trainer"])
    p = Pipeline(g, check_devices=False)
    assert p.abandon_upstream("trainer") == []
    assert p.abandon_upstream("sink") == ["trainer"]


def test_long_work_inside_one_item_ends_at_the_stop_without_a_failure(thread_baseline):
    g = Graph(runtime=fast_runtime(drain_timeout_s=30.0))
    g.add("src", "TestSource", config={"count": 2, "plain": True})
    g.add("long", "LongItems", inputs=["src"])
    g.add("sink", "TestSink", inputs=["long"])
    p = Pipeline(g, check_devices=False)
    threading.Timer(0.3, p.stop, args=("test stop",)).start()
    t0 = time.monotonic()
    with pytest.raises(PipelineInterrupted):  # a stop, not a StageError, and no thread left behind
        p.run()
    assert time.monotonic() - t0 < 3.0
    assert p.abandoned == []
    assert wait_threads_back(thread_baseline) == []


def test_after_a_stall_the_python_api_returns_and_the_process_exits(tmp_path):
    """A stage stuck in its own code (deaf to the stop): the call returns PipelineStalled naming the thread
    it abandoned, and the interpreter still exits (no os._exit needed)."""
    script = tmp_path / "stalled.py"
    script.write_text(textwrap.dedent('''
        import time
        import attrs
        from dflash_flow.core import Graph, Pipeline, PipelineStalled, RuntimeOptions, Stage, register_stage
        from dflash_flow.stages.generic import Range, Discard

        @register_stage
        @attrs.define(kw_only=True, eq=False)
        class Deaf(Stage):
            def process(self, item):
                while True:
                    time.sleep(0.05)

        g = Graph(runtime=RuntimeOptions(capacity=2, stall_timeout_s=0.5, drain_timeout_s=1.0,
                                         shutdown_grace_s=0.5, watchdog_interval_s=0.05))
        g.add("numbers", Range(count=3))
        g.add("deaf", Deaf(), inputs="numbers")
        g.add("sink", Discard(), inputs="deaf")
        p = Pipeline(g, check_devices=False)
        try:
            p.run()
        except PipelineStalled as exc:
            print("STALLED", p.abandoned, "|", " ".join(getattr(exc, "__notes__", [])), flush=True)
    '''))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the interpreter did not exit after PipelineStalled returned:\n{out}\n{err[-2000:]}") from None
    assert proc.returncode == 0, err[-2000:]
    assert "STALLED ['deaf[0]']" in out, out + err
    assert "abandoned" in out and "the process can still exit" in out


def test_a_stop_during_a_long_setup_ends_the_run_as_stopped_not_failed(thread_baseline):
    from dflash_flow.core import Source

    @register_stage
    @attrs.define(kw_only=True, eq=False)
    class RegeneratingSource(Source):
        def setup(self, ctx) -> None:
            ctx.services["setup_started"].set()
            for _ in range(6000):  # 60 s if nothing stops it
                ctx.check_stop()  # raises StopRequested once the run stops
                time.sleep(0.01)

        def produce(self):
            yield 1

    g = Graph(runtime=fast_runtime(drain_timeout_s=30.0))
    g.add("src", "RegeneratingSource")
    g.add("sink", "TestSink", inputs=["src"])
    started = threading.Event()
    p = Pipeline(g, services={"setup_started": started}, check_devices=False)

    def stop_when_set_up() -> None:
        started.wait(30)
        p.stop("test stop")

    threading.Thread(target=stop_when_set_up, daemon=True).start()
    with pytest.raises(PipelineInterrupted):  # a stop, not StageError(src, setup, StopRequested)
        p.run()
    assert started.is_set()
    assert wait_threads_back(thread_baseline) == []
