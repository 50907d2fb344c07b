"""GPU slices per rank: pure placement functions (no GPU needed)."""

from __future__ import annotations

import itertools

import pytest

from dflash_flow.core.devices import RankLayout, plan_placement


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
