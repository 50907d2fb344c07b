"""What the data-parallel trainer test builds on every rank and in the one-process reference."""

from __future__ import annotations

import torch

from dflash_flow.items import BatchMeta, TargetFeatures

STEPS = 3
VOCAB = 512
TARGET = "tiny-qwen3-8l"


def make_trainer(*, grad_accum: int, data_parallel: str = "ddp"):
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.target import TargetFeatureExtractor, load_target, load_target_config
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter

    torch.set_num_threads(1)
    target = load_target(TARGET)
    config = load_target_config(TARGET)
    drafter = build_drafter(config, DrafterShape(num_layers=2, block_size=4, mask_token_id=VOCAB - 1),
                            seed=7, device="cpu", dtype=torch.float32)
    extractor = TargetFeatureExtractor(target, drafter.target_layer_ids)
    trainer = DrafterTrainer(
        drafter, load_shared_head(TARGET, "cpu", torch.float32),
        TrainerConfig(num_anchors=6, lr=3e-3, warmup_ratio=0.0, grad_accum=grad_accum, total_steps=20,
                      chunk_blocks=4, data_parallel=data_parallel),
        device="cpu", dtype=torch.float32,
    )
    return trainer, extractor


def synthetic_batch(index: int, extractor) -> TargetFeatures:
    """Batch ``index`` of a fixed sequence: 2 rows of 24-40 tokens, loss mask on the second half."""
    g = torch.Generator().manual_seed(index)
    length = 24 + 8 * (index % 3)
    ids = torch.randint(0, VOCAB - 1, (2, length), generator=g)
    attn = torch.ones_like(ids)
    attn[1, length - 5 :] = 0  # a shorter second row (right padding)
    loss = torch.zeros_like(ids)
    loss[:, length // 2 :] = 1
    loss = loss * attn
    hidden = extractor(ids, attn)
    meta = BatchMeta(epoch=0, index=index, bucket=0, lengths=[length, length - 5], real_tokens=int(attn.sum()),
                     padded_tokens=ids.numel(), num_samples=2, total_batches=100)
    return TargetFeatures(meta=meta, input_ids=ids, loss_mask=loss, attention_mask=attn, hidden_states=hidden,
                          target_layer_ids=list(extractor.target_layer_ids))
