"""Test stages for the stop/failure property test, registered under ``Rel...`` names.

Items are ``(source, replica, k, hops)``: ``hops`` is the tuple of RelHop stages the item went through, so
a sink can tell the copies of one source item that legitimately arrive over different DAG paths apart from
duplicates. Sinks record what they acknowledged under ``ctx.services["acked:NAME"]``.
"""

from __future__ import annotations

import random
import time

import attrs

from dflash_flow.core import Source, Stage, cfg, register_stage


@register_stage
@attrs.define(kw_only=True, eq=False)
class RelSource(Source):
    """Emits (name, replica, k, ()) for k < count (in order: the runtime's items_out says how many).

    Each replica emits its own items (they carry the replica index), so replicas are allowed."""

    shards_by_replica = True

    count: int = cfg(10, ge=0)
    max_delay_s: float = cfg(0.0, ge=0)

    def setup(self, ctx) -> None:
        self._ctx = ctx
        self._rng = random.Random(ctx.seed_for(0, ctx.replica))

    def produce(self):
        for k in range(self.count):
            if self.max_delay_s:
                time.sleep(self._rng.uniform(0, self.max_delay_s))
            yield (self._ctx.name, self._ctx.replica, k, ())


@register_stage
@attrs.define(kw_only=True, eq=False)
class RelHop(Stage):
    """1:1: appends its name to the item's hops after a small random delay; may fail at its n-th item."""

    max_delay_s: float = cfg(0.0, ge=0)
    fail_at: int = cfg(-1, doc="Raise on this item index (counted over this replica); -1: never.")
    fail_replica: int = cfg(0, ge=0)

    def setup(self, ctx) -> None:
        self._ctx = ctx
        self._n = 0
        self._rng = random.Random(ctx.seed_for(0, ctx.replica))

    def process(self, item):
        if self.max_delay_s:
            time.sleep(self._rng.uniform(0, self.max_delay_s))
        if self._n == self.fail_at and self._ctx.replica == self.fail_replica:
            raise RuntimeError(f"RelHop {self._ctx.name}[{self._ctx.replica}] fails at item {self._n}")
        self._n += 1
        src, rep, k, hops = item
        return ((src, rep, k, (*hops, self._ctx.name)),)


@register_stage
@attrs.define(kw_only=True, eq=False)
class RelSink(Stage):
    """Acknowledges items: records each under ``acked:NAME``."""

    output_type = None

    def setup(self, ctx) -> None:
        self._acked = ctx.services.setdefault(f"acked:{ctx.name}", [])

    def process(self, item):
        self._acked.append(item)
        return None
