"""Python API == YAML, --set overrides, and third-party stages through entry points."""

from __future__ import annotations

import sys
import textwrap

import pytest
import stages_for_tests as sft
from stages_for_tests import fast_runtime

from dflash_flow.core import (
    ConfigError,
    Graph,
    InputSpec,
    Pipeline,
    load_graph,
    load_graph_text,
    registry,
    validate,
)


def _python_graph() -> Graph:
    g = Graph(name="roundtrip", seed=11, output_dir="out/rt", runtime=fast_runtime(capacity=3))
    g.add("src", sft.TestSource(count=9, max_delay_s=0.0))
    g.add("split", "TestSplit", inputs="src", config={"n": 3}, capacity=5)
    g.add("drop", "TestDrop", inputs=[InputSpec("split", "least_loaded")], replicas=2, config={"every": 0})
    g.add(
        "fan",
        "TestPass",
        inputs=[{"stage": "drop", "policy": "broadcast"}],
        replicas=3,
        devices=["cpu", "cpu"],
    )
    g.add("sink", "TestSink", inputs=["fan", ("src", "round_robin")], ordered=False)
    return g


def test_python_graph_equals_graph_loaded_from_its_own_yaml():
    g = _python_graph()
    text = g.to_yaml()
    loaded = load_graph_text(text, "rt.yaml")
    assert loaded == g
    assert loaded.to_yaml() == text
    assert validate(loaded) == [] and validate(g) == []
    assert loaded.stage("src").config == {"count": 9, "max_delay_s": 0.0, "fail_at": -1, "plain": False}
    assert loaded.stage("drop").inputs == [InputSpec("split", "least_loaded")]
    # and the difference shows: equality is not vacuous
    loaded.stage("fan").replicas = 2
    assert loaded != g


def test_roundtrip_with_application_sections_registered():
    import dflash_flow.app  # noqa: F401 - registers tracking/checkpoint, as the CLI does

    g = _python_graph()
    loaded = load_graph_text(g.to_yaml(), "rt.yaml")
    assert loaded == g
    assert load_graph_text(loaded.to_yaml()) == loaded


def test_python_and_yaml_graphs_run_the_same():
    def run(graph):
        services: dict = {}
        Pipeline(graph, services=services, check_devices=False).run()
        return sorted(map(repr, (i for _, i in services["sink:sink"])))

    g = _python_graph()
    assert run(g) == run(load_graph_text(g.to_yaml()))


BASE = textwrap.dedent(
    """\
    name: o
    seed: 1
    runtime:
      capacity: 8
    stages:
      - name: src
        type: TestSource
        config:
          count: 4
      - name: sink
        type: TestSink
        inputs: [src]
    """
)


def test_set_overrides(tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text(BASE)
    g = load_graph(
        path,
        [
            "seed=5",
            "runtime.capacity=2",
            "runtime.stall_timeout_s=1.5",
            "stages.src.count=7",  # not a stage key: goes into config
            "stages.src.max_delay_s=0.001",
            "stages.sink.replicas=3",  # a stage key
            "stages.1.ordered=true",
            "stages.src.config.plain=true",
            "name=renamed",
        ],
    )
    assert (g.name, g.seed, g.runtime.capacity, g.runtime.stall_timeout_s) == ("renamed", 5, 2, 1.5)
    assert g.stage("src").config == {"count": 7, "max_delay_s": 0.001, "plain": True}
    assert g.stage("sink").replicas == 3 and g.stage("sink").ordered is True
    # overridden values are validated like the file's own
    bad = load_graph(path, ["stages.src.count=many"])
    (p,) = validate(bad)
    assert (p.stage, p.field) == ("src", "count") and "expected an integer" in p.message


def test_bad_overrides_are_reported_together(tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text(BASE)
    with pytest.raises(ConfigError) as info:
        load_graph(path, ["novalue", "stages.nosuch.count=1", "=3"])
    msgs = [p.message for p in info.value.problems]
    assert len(msgs) == 3
    assert any("'novalue'" in m and "key.path=value" in m for m in msgs)
    assert any("no element 'nosuch'" in m and "names there: src, sink" in m for m in msgs)


def test_a_misspelt_stage_in_set_gets_the_close_name(tmp_path):
    path = tmp_path / "o.yaml"
    path.write_text(BASE)
    with pytest.raises(ConfigError) as info:
        load_graph(path, ["stages.sinkk.replicas=2", "stages.srcc=1"])
    msgs = [p.message for p in info.value.problems]
    assert any("no element 'sinkk' in stages; did you mean 'sink'?" in m for m in msgs), msgs
    assert any("no element 'srcc'; did you mean 'src'?" in m for m in msgs), msgs


PLUGIN = textwrap.dedent(
    """
    import attrs
    from dflash_flow.core import Stage, cfg

    @attrs.define(kw_only=True, eq=False)
    class Doubler(Stage):
        \"\"\"Doubles integers (a third-party stage).\"\"\"
        input_type = int
        output_type = int
        factor: int = cfg(2, ge=1, doc="Multiplier.")

        def process(self, item):
            return [item * self.factor]

    NotAStage = object
    """
)


@pytest.fixture
def plugin_path(tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    (site / "dff_test_plugin.py").write_text(PLUGIN)
    dist = site / "dff_test_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dff-test-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[dflash_flow.stages]\n"
        "TestPluginDoubler = dff_test_plugin:Doubler\n"
        "TestPluginBroken = dff_test_plugin_missing:Thing\n"
        "TestPluginNotAStage = dff_test_plugin:NotAStage\n"
    )
    monkeypatch.syspath_prepend(str(site))
    registry._entry_points_cache = None
    yield site
    registry._entry_points_cache = None
    for name in ("TestPluginDoubler", "TestPluginBroken", "TestPluginNotAStage"):
        registry._REGISTERED.pop(name, None)
    sys.modules.pop("dff_test_plugin", None)


def test_entry_point_stage_is_discovered_validated_and_run(plugin_path):
    assert "TestPluginDoubler" in registry.available()
    cls = registry.resolve("TestPluginDoubler")
    assert cls.__name__ == "Doubler" and cls.__module__ == "dff_test_plugin"
    text = textwrap.dedent(
        """\
        stages:
          - {name: src, type: TestSource, config: {count: 5, plain: true}}
          - {name: dbl, type: TestPluginDoubler, inputs: [src], config: {factor: 3}, replicas: 2}
          - {name: sink, type: TestSink, inputs: [dbl], ordered: true}
        """
    )
    services: dict = {}
    Pipeline(load_graph_text(text), services=services, check_devices=False).run()
    assert [i for _, i in services["sink:sink"]] == [0, 3, 6, 9, 12]
    # its config is validated like a built-in's
    bad = load_graph_text(text.replace("factor: 3", "factor: 0"))
    (p,) = validate(bad)
    assert (p.stage, p.field) == ("dbl", "factor")


def test_broken_entry_points_are_reported_not_raised(plugin_path):
    g = Graph()
    g.add("src", "TestSource")
    g.add("a", "TestPluginBroken", inputs=["src"])
    g.add("b", "TestPluginNotAStage", inputs=["src"])
    g.add("c", "TestPass", inputs=["src"], config={"nope": 1})
    probs = validate(g)
    assert {(p.stage, p.field) for p in probs} == {("a", "type"), ("b", "type"), ("c", "nope")}
    msg_a = next(p.message for p in probs if p.stage == "a")
    assert "failed to load" in msg_a and "ModuleNotFoundError" in msg_a
