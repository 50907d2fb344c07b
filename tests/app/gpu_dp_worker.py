"""One rank of the bf16 data-parallel checks (issue 41, review findings 5 and 10), started by torchrun (gloo, CPU):
the tiny drafter in bf16 trains ``STEPS`` global steps of ``accum`` micro-batches (batch ``(step * accum +
micro) * world + rank``), counting the collectives torch is asked for; writes its weights and the counts to OUT."""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 3
VOCAB = 512
TARGET = "tiny-qwen3-8l"


def make_trainer(*, grad_accum: int, data_parallel: str = "ddp"):
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter

    torch.set_num_threads(1)
    drafter = build_drafter(load_target_config(TARGET), DrafterShape(num_layers=1, block_size=4, mask_token_id=VOCAB - 1),
                            seed=7, device="cpu", dtype=torch.bfloat16)
    return DrafterTrainer(
        drafter, load_shared_head(TARGET, "cpu", torch.bfloat16),
        TrainerConfig(num_anchors=6, lr=3e-3, warmup_ratio=0.0, grad_accum=grad_accum, total_steps=20,
                      data_parallel=data_parallel),
        device="cpu", dtype=torch.bfloat16,
    )


def batch(trainer, index: int):
    from dflash_flow.items import BatchMeta, TargetFeatures

    g = torch.Generator().manual_seed(index)
    b, s = 2, 24 + 8 * (index % 3)
    width = len(trainer.drafter.target_layer_ids) * trainer.drafter.config.hidden_size
    ids = torch.randint(0, VOCAB - 1, (b, s), generator=g)
    loss = torch.zeros_like(ids)
    loss[:, s // 2 :] = 1
    meta = BatchMeta(epoch=0, index=index, bucket=0, lengths=[s] * b, real_tokens=b * s, padded_tokens=b * s,
                     num_samples=b, total_batches=100)
    return TargetFeatures(meta=meta, input_ids=ids, loss_mask=loss, attention_mask=torch.ones_like(ids),
                          hidden_states=torch.randn(b, s, width, generator=g).bfloat16(),
                          target_layer_ids=list(trainer.drafter.target_layer_ids))


def main(out: str, mode: str, accum: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    counts: Counter = Counter()
    for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor"):
        real = getattr(dist, name)

        def counted(*args, _real=real, _name=name, **kw):
            tensor = args[0] if args else next(iter(kw.values()))
            counts[f"{_name}:{str(tensor.dtype).removeprefix('torch.')}"] += 1
            return _real(*args, **kw)

        setattr(dist, name, counted)
    trainer = make_trainer(grad_accum=accum, data_parallel=mode)
    per_step, waits = [], []
    for step in range(STEPS):
        before = Counter(counts)
        for micro in range(accum):
            index = (step * accum + micro) * world + rank
            metrics = trainer.train_batch(batch(trainer, index), anchor_seed=1000 + index)
        per_step.append(dict(counts - before))
        waits.append(metrics.get("allreduce_wait_s"))
    from safetensors.torch import save_file

    state = trainer.full_model_state()
    if mode == "ddp" or rank == 0:
        save_file({k: v.detach().cpu().contiguous() for k, v in state.items()}, os.path.join(out, f"rank{rank}.safetensors"))
        Path(out, f"rank{rank}.json").write_text(json.dumps({"per_step": per_step, "allreduce_wait_s": waits}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
