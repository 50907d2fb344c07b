"""The runtime's part in GPU readiness (issue 41): an ordered consumer holds at most its input's capacity of items
out of order (review finding 7: features waiting on the trainer's GPU in a heap that grew without bound while one
target replica lagged), without ever deadlocking; and every replica thread is bound to its GPU before its setup
(finding 8). Real pipelines, real threads."""

from __future__ import annotations

import random
import threading
import time

import attrs

from dflash_flow.core import Graph, Pipeline, RuntimeOptions, Source, Stage, cfg, register_stage


@register_stage
@attrs.define(kw_only=True, eq=False)
class Issue41Count(Source):
    """Emits 0..count-1."""

    count: int = cfg(40, ge=0)

    def produce(self):
        yield from range(self.count)


@register_stage
@attrs.define(kw_only=True, eq=False)
class Issue41Lag(Stage):
    """Passes items on: replica 0 after ``lag_s`` each (a slow target replica), the others after a random
    ``jitter_s`` at most (seeded)."""

    lag_s: float = cfg(0.0, ge=0)
    jitter_s: float = cfg(0.0, ge=0)

    def setup(self, ctx) -> None:
        self._replica = ctx.replica
        self._rng = random.Random(ctx.seed_for(0, ctx.replica))

    def process(self, item):
        if self._replica == 0 and self.lag_s:
            time.sleep(self.lag_s)
        elif self.jitter_s:
            time.sleep(self._rng.uniform(0, self.jitter_s))
        return (item,)


@register_stage
@attrs.define(kw_only=True, eq=False)
class Issue41Collect(Stage):
    """Appends every item to ``services['out']``."""

    output_type = None

    def setup(self, ctx) -> None:
        self._out = ctx.services.setdefault("out", [])

    def process(self, item):
        self._out.append(item)
        return None


def _runtime(capacity: int) -> RuntimeOptions:
    return RuntimeOptions(capacity=capacity, stall_timeout_s=60.0, drain_timeout_s=5.0, shutdown_grace_s=5.0,
                          watchdog_interval_s=0.05)


def test_an_ordered_consumer_holds_at_most_its_capacity_while_one_producer_lags():
    """Three producers, one sleeping per item: the ordered consumer's heap never holds more than its input's
    capacity (2), and the order is the source's. Before, it read everything the fast producers made into its
    heap while it waited for the slow one."""
    g = Graph(runtime=_runtime(4))
    g.add("src", "Issue41Count", config={"count": 45})
    g.add("target", "Issue41Lag", inputs=["src"], replicas=3, config={"lag_s": 0.02})
    g.add("drafter", "Issue41Collect", inputs=["target"], ordered=True, capacity=2)
    services: dict = {}
    pipeline = Pipeline(g, services=services, check_devices=False)
    pipeline.run()
    assert services["out"] == list(range(45))
    assert pipeline.replicas["drafter"][0].heap_peak <= 2


def test_the_bound_never_deadlocks_when_producers_get_their_items_out_of_order():
    """Two racing stages of two replicas each (a producer's items arrive out of order, so the one awaited can sit
    behind a later one its producer cannot put), an ordered consumer of capacity 1: every run completes, in
    order (the escape of Channel.get_seq takes the oldest item when nothing upstream moves; without it seed 5
    hung here)."""
    for seed in range(6):
        g = Graph(seed=seed, runtime=_runtime(1))
        g.add("src", "Issue41Count", config={"count": 40})
        g.add("padder", "Issue41Lag", inputs=["src"], replicas=2, config={"jitter_s": 0.004})
        g.add("target", "Issue41Lag", inputs=["padder"], replicas=2, config={"jitter_s": 0.004})
        g.add("drafter", "Issue41Collect", inputs=["target"], ordered=True, capacity=1)
        services: dict = {}
        pipeline = Pipeline(g, services=services, check_devices=False)
        pipeline.run()
        assert services["out"] == list(range(40)), seed


@register_stage
@attrs.define(kw_only=True, eq=False)
class Issue41WhereAmI(Stage):
    """Records, at its setup, which CUDA devices its thread was made current on before (``services['bound']``)."""

    def setup(self, ctx) -> None:
        me = threading.current_thread()  # (not its ident: a finished thread's ident is reused)
        ctx.services.setdefault("at_setup", []).append(
            (ctx.name, ctx.replica, list(ctx.devices), [d for t, d in ctx.services["bound"] if t is me]))

    def process(self, item):
        return (item,)


def test_every_stage_thread_is_on_its_gpu_before_its_setup(monkeypatch):
    """Each replica's thread makes its own GPU current before its setup; a thread without a GPU (a Padder that
    pins memory) makes its rank's first GPU current, not device 0 of the node. Only DrafterStep did (review
    finding 8). torch's CUDA calls are recorded (no GPU here): a machine with two GPUs, as torch would see it."""
    import torch

    import dflash_flow.app  # noqa: F401 - the application registers the thread setup (dflash_flow.app)

    services: dict = {"bound": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # (the allocator setting is left alone)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: services["bound"].append((threading.current_thread(), str(d))))
    g = Graph(runtime=_runtime(4))
    g.add("src", "Issue41Count", config={"count": 6})
    g.add("padder", "Issue41WhereAmI", inputs=["src"], replicas=2)
    g.add("target", "Issue41WhereAmI", inputs=["padder"], replicas=2, devices=["cuda:1", "cuda:0"])
    g.add("drafter", "Issue41Collect", inputs=["target"], devices="cuda:1")
    Pipeline(g, services=services, check_devices=False).run()
    at_setup = {(name, replica): (devices, bound) for name, replica, devices, bound in services["at_setup"]}
    assert at_setup[("target", 0)] == (["cuda:1"], ["cuda:1"])
    assert at_setup[("target", 1)] == (["cuda:0"], ["cuda:0"])
    assert at_setup[("padder", 0)][1] == at_setup[("padder", 1)][1] == ["cuda:0"]  # the rank's first GPU
    assert sorted(services["out"]) == list(range(6))
