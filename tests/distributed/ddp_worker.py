"""One rank of the data-parallel trainer test (started by torchrun, gloo on CPU).

Builds the same tiny target and drafter on every rank, trains ``STEPS`` global steps: at step s rank r
trains batch ``s * world + r`` of a fixed synthetic sequence (the plan's global steps), and writes its
final drafter weights to ``OUT/rank{r}.safetensors``."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from ddp_common import STEPS, make_trainer, synthetic_batch  # noqa: E402


def main(out: str, mode: str, accum: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    trainer, extractor = make_trainer(grad_accum=accum, data_parallel=mode)
    index = 0
    for step in range(STEPS):
        for micro in range(accum):
            index = (step * accum + micro) * world + rank
            feats = synthetic_batch(index, extractor)
            trainer.train_batch(feats, anchor_seed=1000 + index)
    from safetensors.torch import save_file

    state = trainer.full_model_state()
    if mode == "ddp" or rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, os.path.join(out, f"rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
