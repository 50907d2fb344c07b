"""GPU slices per rank: pure placement functions (no GPU needed)."""

from __future__ import annotations

import itertools

import pytest

from dflash_flow.core.devices import RankLayout, device_groups, plan_groups


def plan_placement(devices, replicas, layout):
    """plan_groups for a flat device list (one device per replica)."""
    placed, problems, warning = plan_groups(device_groups(devices), replicas, layout)
    return [g[0] for g in placed], problems, warning


def test_two_ranks_per_8_gpu_node_own_disjoint_halves():
    # the 2 x 4 layout: each rank 3 TargetForward replicas + 1 DrafterStep on its own 4 GPUs
    per_rank = []
    for local_rank in range(2):
        lay = RankLayout(visible=8, local_world_size=2, local_rank=local_rank)
        assert lay.problem() is None
        targets, p1, _ = plan_placement(["cuda:0", "cuda:1", "cuda:2"], 3, lay)
        drafter, p2, _ = plan_placement(["cuda:3"], 1, lay)
        assert not p1 and not p2
        per_rank.append(targets + drafter)
    assert per_rank == [["cuda:0", "cuda:1", "cuda:2", "cuda:3"], ["cuda:4", "cuda:5", "cuda:6", "cuda:7"]]


@pytest.mark.parametrize("visible,ranks", [(8, 1), (8, 2), (8, 4), (8, 8), (16, 4), (4, 2)])
def test_auto_never_overlaps_between_ranks(visible, ranks):
    used = []
    for r in range(ranks):
        lay = RankLayout(visible=visible, local_world_size=ranks, local_rank=r)
        placed, problems, warning = plan_placement(["auto"], 3, lay)
        assert not problems and warning is None
        assert set(placed) <= {f"cuda:{g}" for g in lay.gpus()}
        used.append(set(placed))
    for a, b in itertools.combinations(used, 2):
        assert not a & b


def test_one_process_per_gpu_puts_target_and_drafter_on_the_ranks_gpu():
    for r in range(4):
        lay = RankLayout(visible=4, local_world_size=4, local_rank=r)
        assert plan_placement(["auto"], 2, lay)[0] == [f"cuda:{r}"] * 2
        assert plan_placement(["cuda"], 1, lay)[0] == [f"cuda:{r}"]


def test_device_beyond_the_slice_is_a_problem_naming_the_slice():
    lay = RankLayout(visible=8, local_world_size=2, local_rank=1)
    _, problems, _ = plan_placement(["cuda:4"], 1, lay)
    assert problems and "beyond this rank's 4 GPU(s)" in problems[0] and "GPUs 4-7 of 8" in problems[0]


def test_sharing_is_refused_unless_asked():
    lay = RankLayout(visible=2, local_world_size=4, local_rank=3)
    assert "ranks would share GPUs" in lay.problem()
    shared = RankLayout(visible=2, local_world_size=4, local_rank=3, shared=True)
    assert shared.problem() is None and shared.gpus() == [1]
    # an explicit slice that over-subscribes the node
    assert "share" in RankLayout(visible=8, local_world_size=2, gpus_per_rank=5).problem()
    assert RankLayout(visible=8, local_world_size=2, local_rank=1, gpus_per_rank=3).gpus() == [3, 4, 5]


def test_cpu_only_machine():
    lay = RankLayout(visible=0, local_world_size=2, local_rank=1)
    assert lay.problem() is None
    placed, problems, warning = plan_placement(["auto"], 2, lay)
    assert placed == ["cpu", "cpu"] and "no GPU" in warning and not problems
    assert "no visible CUDA device" in plan_placement(["cuda:0"], 1, lay)[1][0]
    assert plan_placement(["cpu"], 3, lay) == (["cpu"] * 3, [], None)


# -- several devices per replica (a stage that splits a model) -----------------------------------------


def test_device_lists_per_replica_map_each_device_into_the_ranks_slice():
    from dflash_flow.core.devices import plan_groups

    groups = [["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]]
    per_rank = []
    for r in range(2):
        lay = RankLayout(visible=8, local_world_size=2, local_rank=r)
        placed, problems, warning = plan_groups(groups, 2, lay)
        assert not problems and warning is None
        per_rank.append(placed)
    assert per_rank == [[["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], [["cuda:4", "cuda:5"], ["cuda:6", "cuda:7"]]]
    # A single list is every replica's (and `cuda` is the slice's first GPU).
    lay = RankLayout(visible=4, local_world_size=2, local_rank=1)
    assert plan_groups([["cuda", "cuda:1"]], 3, lay)[0] == [["cuda:2", "cuda:3"]] * 3
    _, problems, _ = plan_groups([["cuda:1", "cuda:2"]], 1, lay)
    assert problems == ["device cuda:2 is beyond this rank's 2 GPU(s) (GPUs 2-3 of 4 visible (local rank 1 of 2)); "
                        "cuda:K means the K-th GPU of the rank's slice"]


def test_flat_lists_and_strings_are_one_device_per_replica_as_before():
    from dflash_flow.core.devices import is_nested

    assert device_groups("cuda:1") == [["cuda:1"]]
    assert device_groups(["cuda:0", "cuda:1"]) == [["cuda:0"], ["cuda:1"]]
    assert device_groups([["cpu", "cpu"]]) == [["cpu", "cpu"]]
    assert not is_nested(["cuda:0", "cuda:1"]) and is_nested([["cuda:0"]])
    lay = RankLayout(visible=2)
    assert plan_groups(device_groups(["cuda:0", "cuda:1"]), 3, lay) == ([["cuda:0"], ["cuda:1"], ["cuda:0"]], [], None)
    assert plan_groups(device_groups("auto"), 2, RankLayout(visible=0))[0] == [["cpu"], ["cpu"]]


@pytest.mark.parametrize("groups,replicas,multi,expected", [
    ([["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], 2, True, []),
    ([["cuda:0", "cuda:1"]], 3, True, []),  # one list shared by every replica: asked for
    ([["cpu", "cpu"]], 1, True, []),  # cpu may repeat (one host memory; how CPU machines run a split)
    ([["cuda:0"], ["cuda:1"]], 2, False, []),  # one device per replica is fine for any stage
    ([["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]], 3, True, [(None, "devices gives 2 device lists")]),
    ([["cuda:0", "cuda:1"]], 1, False, [(0, "device list 0 has 2 devices, but stage type 'X' runs each replica on one device")]),
    ([["cuda", "cuda:0"]], 1, True, [(0, "device cuda:0 appears twice in device list 0")]),
    ([["cuda:0", "cuda:1"], ["cuda:1", "cuda:2"]], 2, True, [(1, "device lists 0 and 1 both use cuda:1")]),
    ([["auto"]], 1, True, [(0, "'auto' cannot be used in a list of devices per replica")]),
])
def test_nesting_rules(groups, replicas, multi, expected):
    from dflash_flow.core.devices import nesting_problems

    found = nesting_problems(groups, replicas, multi_device=multi, stage_type="stage type 'X'")
    assert len(found) == len(expected), found
    for (j, text), (fj, message) in zip(expected, found, strict=True):
        assert fj == j and message.startswith(text), message


def test_a_replica_gets_all_its_devices_and_producers_see_the_consumers_first_device():
    import attrs

    from dflash_flow.core import Graph, Pipeline, Stage, register_stage

    @register_stage
    @attrs.define(kw_only=True, eq=False)
    class SpanningStage(Stage):
        multi_device = True

        def setup(self, ctx):
            ctx.services.setdefault("spans", {})[ctx.replica] = (ctx.device, list(ctx.devices))

        def process(self, item):
            return (item,)

    @register_stage
    @attrs.define(kw_only=True, eq=False)
    class DeviceProbe(Stage):
        def setup(self, ctx):
            ctx.services["downstream"] = list(ctx.downstream_devices)
            ctx.services["probe_devices"] = list(ctx.devices)

        def process(self, item):
            return (item,)

    def run(devices):
        g = Graph()
        g.add("src", "TestSource", config={"count": 4, "plain": True})
        g.add("probe", DeviceProbe, inputs=["src"])
        g.add("span", SpanningStage, inputs=["probe"], replicas=2, devices=devices)
        g.add("sink", "TestSink", inputs=["span"])
        services: dict = {}
        # Devices are only handed to the stages here, never used: GPU names run on any machine unchecked.
        Pipeline(g, services=services, check_devices=False).run()
        assert sorted(i for _, i in services["sink:sink"]) == [0, 1, 2, 3]
        return services

    shared = run([["cpu", "cpu", "cpu"]])
    assert shared["spans"] == {0: ("cpu", ["cpu"] * 3), 1: ("cpu", ["cpu"] * 3)}
    assert shared["downstream"] == ["cpu"] and shared["probe_devices"] == ["cpu"]
    split = run([["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]])
    assert split["spans"] == {0: ("cuda:0", ["cuda:0", "cuda:1"]), 1: ("cuda:2", ["cuda:2", "cuda:3"])}
    assert split["downstream"] == ["cuda:0", "cuda:2"]  # each consumer replica takes input on its first device


def test_graph_labels_show_each_replicas_devices():
    from dflash_flow.core import Graph
    from dflash_flow.core.graph import to_dot, to_mermaid

    g = Graph()
    g.add("src", "TestSource")
    g.add("split", "TestPass", inputs=["src"], replicas=2, devices=[["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]])
    g.add("flat", "TestPass", inputs=["src"], replicas=2, devices=["cuda:0", "cuda:1"])
    assert '"split: TestPass (x2 cuda:0+cuda:1,cuda:2+cuda:3)"' in to_mermaid(g)
    assert '"flat: TestPass (x2 cuda:0,cuda:1)"' in to_mermaid(g)
    assert 'label="split: TestPass (x2 cuda:0+cuda:1,cuda:2+cuda:3)"' in to_dot(g)
