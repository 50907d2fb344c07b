"""The stage contract, tested once over every registered stage type and the plugin of examples/custom_stage
(the torchdata.nodes ``run_test_save_load_state`` idea): each type is driven by hand, outside a pipeline,
on real inputs (the real upstream stages' outputs), and must

* give a versioned, JSON-safe state before ``setup`` (its initial state), which a set-up instance loads;
* survive a state round trip at a midpoint: a second instance loaded with the state taken after ``k``
  outputs reports that same state, and continues with the outputs an uninterrupted run emits after ``k``
  (or, for a stage whose state says "replay", emits them all again: downstream state says what to skip);
* refuse a state of another version, and something that is no state at all, naming the type;
* honour a stop: in a real pipeline, ``stop()`` after its first output ends the run promptly, interrupted.

Errors in each phase (setup, process/produce, finish, teardown) are contained: the fault matrix
(``test_fault_matrix.py``) injects them into every type listed here; a test below keeps the two lists equal.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import attrs
import pytest
from faulty_stages import BUILTIN_TYPES, PLUGIN_TYPES
from reltools import MASK_ID, VOCAB, wait_threads_back, write_chat, write_tokenized

from dflash_flow.core import (
    Graph,
    Pipeline,
    PipelineInterrupted,
    Source,
    Stage,
    StageContext,
    StateVersionError,
    registry,
)
from dflash_flow.core.graph import RuntimeOptions
from dflash_flow.core.registry import ENTRY_POINT_GROUP
from dflash_flow.model.facts import target_facts
from dflash_flow.model.spec import ModelSpec
from dflash_flow.services import RunServices

REPO = Path(__file__).resolve().parents[2]
TARGET = "tiny-qwen3-8l"


@attrs.define
class Case:
    config: dict[str, Any]
    inputs: str | None = None  # the chain's outputs this stage consumes (None: a source)
    take: int = 6  # outputs (or inputs, for a sink) in the uninterrupted run compared; k is a midpoint
    replays: bool = False  # after a resume the stage emits everything again (its state is "start over")
    feed_all: bool = False  # after a resume the stage is fed every input again (it skips what it had)
    key: Callable[[Any], Any] | None = None  # what of an output must equal; None: state round trip only
    ctx: dict[str, Any] = attrs.field(factory=dict)


def _meta_key(item: Any) -> Any:
    return (item.meta.epoch, item.meta.index)


def _table_key(table: Any) -> Any:
    """A record source emits one SampleTable: its samples, id and tokens each."""
    return [(s.sample_id, list(s.input_ids)) for s in (table[i] for i in range(len(table)))]


CASES: dict[str, Case] = {
    "Range": Case({"count": 12}, key=lambda x: x),
    "Delay": Case({}, inputs="ints", key=lambda x: x),
    "Discard": Case({}, inputs="ints"),
    "Scale": Case({"factor": 3}, inputs="ints", key=lambda x: x),
    "TokenizedSource": Case({"paths": ["{tokens}"], "max_length": 64, "cache_dir": None, "vocab_size": VOCAB},
                            take=1, replays=True, key=_table_key),
    "ChatSource": Case({"paths": ["{chat}"], "cache_dir": None}, take=1, replays=True,
                       key=_table_key),
    "EmbeddedChatSource": Case({"n_train": 4, "n_eval": 1, "max_new_tokens": 8, "generation_batch_size": 4,
                                "dataset_dir": "{root}/embedded-dataset", "cache_dir": None}, take=1, replays=True,
                               key=_table_key),
    "Bucketer": Case({"max_tokens": 128, "num_buckets": 2, "epochs": 2}, inputs="samples", take=2, replays=True,
                     feed_all=True, key=lambda e: (e.epoch, [[b.tolist() for b in bs] for bs in e.packed.per_bucket])),
    "Interleaver": Case({}, inputs="epochs", take=10, feed_all=True, key=_meta_key),
    "Padder": Case({}, inputs="planned", take=4, key=lambda b: (_meta_key(b), b.input_ids.tolist())),
    "TargetForward": Case({"torch_threads": 1}, inputs="padded", take=3,
                          key=lambda f: (_meta_key(f), round(float(f.hidden_states.double().sum()), 6))),
    "DrafterStep": Case({"num_anchors": 8, "torch_threads": 1}, inputs="features", take=3),
    "SpecDecodeEval": Case({"prompts": "{chat}", "limit": 1, "max_new_tokens": 4, "baseline": False},
                           inputs="steps", take=2),
    "Monitor": Case({"interval_s": 0.01, "progress": False, "plots": False}, inputs="reports", take=2),
}


def _fill(value: Any, files: dict[str, Any]) -> Any:
    if isinstance(value, str):
        return value.format(**{k: str(v) for k, v in files.items()})
    if isinstance(value, list):
        return [_fill(v, files) for v in value]
    if isinstance(value, dict):
        return {k: _fill(v, files) for k, v in value.items()}
    return value


def _build(name: str, files: dict[str, Any]):
    cls = registry.resolve(name)
    return cls(**_fill(CASES[name].config, files))


def _services() -> RunServices:
    """The run services every case gets: the model facts a run resolves from ``model:`` (the tiny target, its
    tokenizer the embedded one's, the drafter's shape)."""
    from dflash_flow.embedded import embedded_target_path

    return RunServices(model=ModelSpec(declared=TARGET, target=TARGET, tokenizer=embedded_target_path(),
                                       num_draft_layers=1, block_size=4, mask_token_id=MASK_ID,
                                       facts=target_facts(TARGET)))


def _ctx(name: str, out: Path) -> StageContext:
    return StageContext(name=name.lower(), seed=5, output_dir=out, services=_services(), **CASES[name].ctx)


def _outputs(result: Any) -> list[Any]:
    return [] if result is None else list(result)


def _drive(stage: Any, inputs: list[Any] | None, limit: int | None) -> list[Any]:
    """Outputs of ``stage`` (set up) for ``inputs`` (None: produce), at most ``limit``; a sink counts the
    inputs it consumed against ``limit``. Generators are closed where the limit cuts them."""
    out: list[Any] = []
    if inputs is None:
        gen = stage.produce()
        out = list(itertools.islice(gen, limit))
        gen.close()
        return out
    consumed = 0
    for item in inputs:
        if limit is not None and (len(out) >= limit or (stage.is_sink() and consumed >= limit)):
            return out
        consumed += 1
        result = stage.process(item)
        if result is None:
            continue
        it = iter(result)
        for o in it:
            out.append(o)
            if limit is not None and len(out) >= limit:
                if hasattr(it, "close"):
                    it.close()
                return out
    if limit is None or len(out) < limit:
        out += _outputs(stage.finish())
    return out if limit is None else out[:limit]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import tqdm

    from dflash_flow.embedded import embedded_target_path

    tqdm.tqdm.monitor_interval = 0  # the regeneration's progress bar starts no monitor thread
    root = tmp_path_factory.mktemp("conformance")
    chat = root / "chat.jsonl"
    write_chat(chat, 4)
    return {"root": root, "tokens": write_tokenized(root / "tokens.jsonl", 12, seed=2), "chat": chat,
            "embedded": embedded_target_path()}


@pytest.fixture(scope="module")
def chain(files, tmp_path_factory):
    """The real upstream outputs each type consumes: samples -> epochs -> planned -> padded -> features ->
    step reports (the last one final, as DrafterStep's finish emits it)."""
    out = tmp_path_factory.mktemp("chain")
    items: dict[str, list[Any]] = {"ints": list(range(12))}
    for name, key, src in (("TokenizedSource", "samples", None), ("Bucketer", "epochs", "samples"),
                           ("Interleaver", "planned", "epochs"), ("Padder", "padded", "planned"),
                           ("TargetForward", "features", "padded"), ("DrafterStep", "reports", "features")):
        stage = _build(name, files)
        stage.setup(_ctx(name, out))
        inputs = items[src] if src else None  # every batch of the plan: a trainer refuses to end short of it
        items[key] = _drive(stage, inputs, None)
        stage.teardown()
    items["steps"] = [r for r in items["reports"] if not r.final][:2]
    items["reports"] = items["steps"] + [r for r in items["reports"] if r.final]
    return items


def _registered() -> list[str]:
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)} | set(PLUGIN_TYPES))


def test_every_registered_type_has_a_conformance_case_and_a_fault_matrix_entry():
    assert set(CASES) == set(_registered()), f"add a conformance case for: {set(_registered()) ^ set(CASES)}"
    assert set(BUILTIN_TYPES + PLUGIN_TYPES) == set(_registered()), "the fault matrix must inject faults into every type"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_state_contract(name, files, chain, tmp_path):
    case = CASES[name]
    cls = registry.resolve(name)
    inputs = chain[case.inputs] if case.inputs else None

    # Before setup: the initial state, versioned and JSON-safe; a set-up instance loads it.
    initial = _build(name, files).state_dict()
    assert isinstance(initial, dict) and initial["version"] == cls.state_version
    assert json.loads(json.dumps(initial)) == initial

    full_stage = _build(name, files)
    full_stage.setup(_ctx(name, tmp_path / "full"))
    full_stage.load_state_dict(json.loads(json.dumps(initial)))
    full = _drive(full_stage, inputs, case.take)
    full_stage.teardown()
    assert full or cls.is_sink() or name in ("SpecDecodeEval",), f"{name} emitted nothing to compare"

    # A midpoint: k outputs (a sink: k inputs).
    k = max(1, case.take // 2)
    first = _build(name, files)
    first.setup(_ctx(name, tmp_path / "a"))
    head = _drive(first, inputs, k)
    state = json.loads(json.dumps(first.state_dict()))
    first.teardown()
    assert state["version"] == cls.state_version

    second = _build(name, files)
    second.setup(_ctx(name, tmp_path / "b"))
    second.load_state_dict(state)
    assert json.loads(json.dumps(second.state_dict())) == state, "the state does not survive a round trip"
    if inputs is None or case.feed_all:
        rest_inputs = inputs
    else:
        rest_inputs = inputs[len(head) if not cls.is_sink() else k:]
    rest = _drive(second, rest_inputs, case.take if case.replays else case.take - len(head))
    second.teardown()
    if case.key is not None:
        expected = full if case.replays else full[len(head):]
        assert [case.key(x) for x in rest] == [case.key(x) for x in expected]
        assert [case.key(x) for x in head] == [case.key(x) for x in full[:len(head)]]

    # Another version, or no state at all: refused, naming the type and the version.
    for bad in ({**state, "version": cls.state_version + 1}, {k: v for k, v in state.items() if k != "version"}):
        third = _build(name, files)
        with pytest.raises(StateVersionError, match=rf"{cls.__name__} state version .* is not supported"):
            third.load_state_dict(bad)
    with pytest.raises(StateVersionError, match="must be a mapping"):
        _build(name, files).load_state_dict([1, 2])  # type: ignore[arg-type]


def test_a_stage_cannot_override_the_versioned_state_methods():
    from dflash_flow.core import Stage

    with pytest.raises(TypeError, match="implement get_state"):

        class Old(Stage):  # noqa: F841 - the class statement is what fails
            def state_dict(self):
                return {"version": 1}


# -- stop honoured, in a real pipeline: an endless feed, stop() after the first output -------------------
@attrs.define(kw_only=True, eq=False)
class ConformanceFeed(Source):
    """Cycles through prepared items forever (until stopped)."""

    items: list = attrs.field(factory=list, metadata={"config": False})

    @classmethod
    def config_fields(cls):
        return []

    def produce(self):
        yield from itertools.cycle(self.items)


@attrs.define(kw_only=True, eq=False)
class ConformanceWatch(Stage):
    """A sink that tells the test when the first item reached it."""

    output_type = None
    seen: Any = attrs.field(factory=threading.Event, metadata={"config": False})

    @classmethod
    def config_fields(cls):
        return []

    def process(self, item):
        self.seen.set()
        return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(CASES))
def test_stop_is_honoured(name, files, chain, tmp_path):
    case = CASES[name]
    cls = registry.resolve(name)
    watch = ConformanceWatch()
    g = Graph(name=f"stop-{name}", seed=5, runtime=RuntimeOptions(capacity=2, stall_timeout_s=120, drain_timeout_s=30,
                                                                   shutdown_grace_s=10, watchdog_interval_s=0.05))
    if case.inputs is None:
        g.add("victim", _build(name, files))
    else:
        g.add("feed", ConformanceFeed(items=chain[case.inputs]))
        g.add("victim", _build(name, files), inputs="feed")
    if not cls.is_sink():
        g.add("watch", watch, inputs="victim")
    baseline = set(threading.enumerate())
    p = Pipeline(g, output_dir=tmp_path / "out", check_devices=False, services=_services())
    done: dict[str, Any] = {}

    def run() -> None:
        try:
            p.run()
        except BaseException as exc:  # noqa: BLE001 - the outcome is what this test reads
            done["exc"] = exc

    t = threading.Thread(target=run, name="conformance-run")
    t.start()
    deadline = time.monotonic() + 120
    victim = p.replicas["victim"][0]
    while time.monotonic() < deadline and not (watch.seen.is_set() or victim.items_in):
        if not t.is_alive():
            break
        time.sleep(0.01)
    p.stop("conformance stop")
    t0 = time.monotonic()
    t.join(60)
    assert not t.is_alive(), f"{name}: the pipeline did not end within 60 s of stop()"
    exc = done.get("exc")
    # A stage with a bounded output (e.g. a source) may have ended before the stop: that is a clean run.
    assert exc is None or isinstance(exc, PipelineInterrupted), f"{name}: {exc!r}"
    assert time.monotonic() - t0 < 60
    assert wait_threads_back(baseline) == []
