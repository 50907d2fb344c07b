"""Fault injection into the real built-in stages, without mocks.

For every built-in stage type ``T`` this module registers ``Faulty<T>``: a subclass of the real class
with three extra config fields. The real stage does its real work (its ``setup``, ``process`` /
``produce`` and ``teardown`` all run); the fault is raised right after the real hook, on one replica:

* ``fault_phase: setup``     after the real ``setup`` (so its resources exist and teardown must free them)
* ``fault_phase: process``   mid-stream: on the replica's ``fault_at``-th item (sources: after emitting
                             ``fault_at`` items, inside ``produce``)
* ``fault_phase: teardown``  after the real ``teardown``

Importing this module registers the types. A CLI subprocess uses them through ``launch.py`` (which
imports this module, then calls the real ``dflash_flow.cli.main``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core import cfg, register_stage, registry

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "custom_stage"))
import my_stages  # noqa: E402,F401 - registers the plugin stage `Scale`

BUILTIN_TYPES = [
    "Range",
    "Delay",
    "Discard",
    "ChatSource",
    "TokenizedSource",
    "EmbeddedChatSource",
    "Bucketer",
    "Interleaver",
    "Padder",
    "TargetForward",
    "DrafterStep",
    "SpecDecodeEval",
    "Monitor",
]
# User stages (examples/custom_stage), held to the same contract.
PLUGIN_TYPES = ["Scale"]


class InjectedFault(RuntimeError):
    """The exception every injected fault raises (its message names stage, replica and phase)."""


def _make(base: type) -> type:
    is_source = base.is_source()

    def _fire(self, where: str) -> None:
        ctx = self._fault_ctx
        raise InjectedFault(f"injected fault in {where} of {ctx.name}[{ctx.replica}]"
                            + (f" on rank {ctx.rank}" if ctx.world_size > 1 else ""))

    def _armed(self) -> bool:
        ctx = self._fault_ctx
        return ctx is not None and ctx.replica == self.fault_replica and self.fault_rank in (-1, ctx.rank)

    def setup(self, ctx) -> None:
        self._fault_ctx = ctx
        self._fault_n = 0
        base.setup(self, ctx)
        if self.fault_phase == "setup" and self._armed():
            self._fire("setup")

    def process(self, item):
        out = base.process(self, item)
        if self.fault_phase != "process" or not self._armed():
            return out  # lazy, as the runtime drives the real stage (a checkpoint waits for its report's logging)
        if out is not None and not isinstance(out, (list, tuple)):
            out = list(out)  # a generator: run the real work before the fault
        if self._fault_n == self.fault_at:
            self._fire("process")
        self._fault_n += 1
        return out

    def produce(self):
        for item in base.produce(self):
            if self.fault_phase == "process" and self._armed() and self._fault_n == self.fault_at:
                self._fire("produce")
            self._fault_n += 1
            yield item
        if self.fault_phase == "process" and self._armed() and self._fault_n <= self.fault_at:
            self._fire("produce")

    def teardown(self) -> None:
        base.teardown(self)
        if self.fault_phase == "teardown" and self._armed():
            self._fire("teardown")

    ns: dict[str, Any] = {
        "__doc__": f"{base.__name__} with an injected fault (tests only).",
        "__module__": __name__,
        "__annotations__": {"fault_phase": str, "fault_replica": int, "fault_at": int, "fault_rank": int},
        "fault_phase": cfg("none", choices=("none", "setup", "process", "teardown")),
        "fault_replica": cfg(0, ge=0),
        "fault_at": cfg(0, ge=0),
        "fault_rank": cfg(-1, ge=-1),  # under torchrun: only this rank's replica (-1: every rank's)
        "_fault_ctx": attrs.field(default=None, init=False),
        "_fault_n": attrs.field(default=0, init=False),
        "_fire": _fire,
        "_armed": _armed,
        "setup": setup,
        "teardown": teardown,
    }
    if is_source:
        ns["produce"] = produce
    else:
        ns["process"] = process
    cls = type(f"Faulty{base.__name__}", (base,), ns)
    # Like the built-ins (slotted attrs classes over the dict-ful Stage): attrs then generates the
    # pickling/deepcopy state of all fields, which the runtime relies on to build replicas 1..n.
    cls = attrs.define(kw_only=True, eq=False)(cls)
    return register_stage(cls)


FAULTY: dict[str, type] = {}
for _name in BUILTIN_TYPES + PLUGIN_TYPES:
    FAULTY[_name] = _make(registry.resolve(_name))
