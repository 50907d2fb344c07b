"""Data-parallel training equals one process stepping through the same global batches.

Two ranks under torchrun (gloo, CPU) train the drafter with DDP; one process trains the same batches
with gradient accumulation over each global step (its micro-batches = the ranks' batches of the step).
DDP averages the ranks' gradients, accumulation averages the micro-batches': the updates must agree.
Tolerance, after 3 steps in fp32 (the two differ only in the order floating point sums are taken): every
weight within 1e-4 absolute (1/30 of one Adam step at lr 3e-3; Adam divides by the gradient's own scale,
so a weight whose gradient is near zero turns summation noise into a visible step), and 99.9% of the
weights within 1e-6.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ddp_common import STEPS, make_trainer, synthetic_batch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent
WORLD = 2


def assert_same_weights(got: dict, ref: dict) -> None:
    assert set(got) == set(ref)
    close, total = 0, 0
    for k, v in ref.items():
        torch.testing.assert_close(got[k], v, atol=1e-4, rtol=0)
        close += int(((got[k] - v).abs() <= 1e-6).sum())
        total += v.numel()
    assert close >= 0.999 * total, (close, total)


def torchrun(out: Path, mode: str, accum: int) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(HERE / "ddp_worker.py"), str(out), mode, str(accum)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def reference(accum_per_rank: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    trainer, extractor = make_trainer(grad_accum=accum_per_rank * WORLD)
    for step in range(STEPS):
        for micro in range(accum_per_rank):
            for rank in range(WORLD):
                index = (step * accum_per_rank + micro) * WORLD + rank
                trainer.train_batch(synthetic_batch(index, extractor), anchor_seed=1000 + index)
    return {k: v.detach().clone() for k, v in trainer.drafter.state_dict().items()}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("accum", [1, 2])
def test_ddp_equals_one_process_over_the_same_global_batches(tmp_path, accum):
    torchrun(tmp_path, "ddp", accum)
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(WORLD)]
    for k in ranks[0]:  # every rank holds the same weights, bit for bit
        assert torch.equal(ranks[0][k], ranks[1][k]), k
    ref = reference(accum)
    start = make_trainer(grad_accum=1)[0].drafter.state_dict()
    moved = max(float((ref[k] - start[k]).abs().max()) for k in ref)
    assert moved > 1e-3  # the steps really changed the weights
    assert_same_weights(ranks[0], ref)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_fsdp_equals_ddp(tmp_path):
    torchrun(tmp_path, "fsdp", 1)
    ref = reference(1)
    assert_same_weights(load_file(str(tmp_path / "rank0.safetensors")), ref)
