"""The process group's backend for a GPU layout (issue 41, review finding 4): ranks that share a GPU
(``runtime.share_gpus``) cannot use NCCL ("Duplicate GPU detected" in the drafter's first collective, after
every target loaded): ``auto`` picks gloo there, and an explicit ``nccl`` is refused before anything starts."""

from __future__ import annotations

import attrs
import pytest

from dflash_flow.app.distributed import backend_problem, choose_backend, node_layouts, shared_gpus


@attrs.define
class Runtime:  # the two runtime options the layout reads (core.graph.RuntimeOptions has them among others)
    gpus_per_rank: int | None = None
    share_gpus: bool = False


def test_two_ranks_on_one_gpu_get_gloo_from_auto_and_a_refusal_for_nccl():
    # `validate pipelines/qwen3-8b-2x4.yaml --nproc 2 --gpus 1 --set runtime.share_gpus=true`: two ranks, one GPU.
    layouts = node_layouts(1, 2, Runtime(share_gpus=True))
    assert shared_gpus(layouts) == (0, 1, 0)
    assert choose_backend("auto", cuda=True, layouts=layouts) == "gloo"
    problem = backend_problem("nccl", layouts)
    assert problem is not None and "GPU 0" in problem and "backend: gloo" in problem
    assert backend_problem("gloo", layouts) is None and backend_problem("auto", layouts) is None
    # Without the runtime options (a caller that has none): more ranks than GPUs can only be a shared layout.
    assert choose_backend("auto", cuda=True, layouts=node_layouts(1, 2)) == "gloo"


@pytest.mark.parametrize("visible,ranks,per_rank,want", [
    (8, 2, None, "nccl"),  # 4 GPUs each
    (2, 2, None, "nccl"),
    (4, 4, 2, "gloo"),  # gpus_per_rank 2 on 4 GPUs for 4 ranks: slices wrap around and meet
    (3, 2, None, "nccl"),  # one GPU left over, none shared
])
def test_auto_is_nccl_exactly_where_every_rank_has_gpus_of_its_own(visible, ranks, per_rank, want):
    layouts = node_layouts(visible, ranks, Runtime(gpus_per_rank=per_rank, share_gpus=per_rank is not None))
    assert choose_backend("auto", cuda=True, layouts=layouts) == want
    assert (backend_problem("nccl", layouts) is None) == (want == "nccl")


def test_without_cuda_auto_is_gloo_and_explicit_choices_stand():
    layouts = node_layouts(0, 2)
    assert choose_backend("auto", cuda=False, layouts=layouts) == "gloo"
    assert choose_backend("nccl", cuda=True, layouts=node_layouts(2, 2)) == "nccl"
    assert choose_backend("gloo", cuda=True, layouts=node_layouts(2, 2)) == "gloo"


def test_validate_refuses_nccl_for_ranks_that_share_a_gpu_at_its_line(tmp_path):
    """``validate --nproc 2 --gpus 1`` with shared GPUs: nccl is refused before anything loads, located at
    ``distributed.backend``; auto (gloo for that layout) passes."""
    from dflash_flow.app import load
    from dflash_flow.core.errors import ConfigError

    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    path = repo / "pipelines" / "qwen3-8b-2x4.yaml"
    sets = ["runtime.share_gpus=true", "stages.target.devices=cuda:0", "stages.drafter.devices=cuda:0"]
    with pytest.raises(ConfigError) as info:
        load(path, overrides=[*sets, "distributed.backend=nccl"], check_paths=False, local_world_size=2, gpu_count=1)
    [p] = [p for p in info.value.problems if p.field == "distributed.backend"]
    assert "share GPU 0" in p.message and p.line is not None
    load(path, overrides=[*sets, "distributed.backend=auto"], check_paths=False, local_world_size=2, gpu_count=1)
