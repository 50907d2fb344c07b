"""A stop between the micro-batches of an accumulated step: the checkpoint holds the partial accumulation,
and the resumed trainer ends with the weights of an uninterrupted run, bit for bit (issue 23.7)."""

from __future__ import annotations

import io
import json

import torch

from dflash_flow.items import BatchMeta, TargetFeatures


def _trainer(grad_accum: int):
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter

    tc = load_target_config("tiny-qwen3-8l")
    drafter = build_drafter(tc, DrafterShape(num_layers=1, block_size=4, mask_token_id=511), seed=0, device="cpu",
                            dtype=torch.float32)
    head = load_shared_head("tiny-qwen3-8l", "cpu", torch.float32)
    config = TrainerConfig(num_anchors=8, lr=1e-3, warmup_ratio=0.0, grad_accum=grad_accum)
    return DrafterTrainer(drafter, head, config, device="cpu", dtype=torch.float32)


def _batch(trainer, index: int) -> TargetFeatures:
    b, s = 2, 20
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, 500, (b, s), generator=g)
    width = len(trainer.drafter.target_layer_ids) * trainer.drafter.config.hidden_size
    meta = BatchMeta(epoch=0, index=index, bucket=0, lengths=[s] * b, real_tokens=b * s, padded_tokens=b * s,
                     num_samples=b, sample_ids=[index, 100 + index], total_batches=6)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :3] = 0
    return TargetFeatures(input_ids=ids, loss_mask=mask, attention_mask=torch.ones(b, s, dtype=torch.long),
                          hidden_states=torch.randn(b, s, width, generator=g), meta=meta,
                          target_layer_ids=list(trainer.drafter.target_layer_ids))


def _train(trainer, indices) -> list[dict]:
    steps = []
    for i in indices:
        m = trainer.train_batch(_batch(trainer, i), anchor_seed=1000 + i)
        if m is not None:
            steps.append(m)
    return steps


def _through_files(trainer) -> tuple[dict, dict, dict]:
    """What a checkpoint stores, read back as the checkpoint loader reads it (safetensors-like tensors,
    torch.load(weights_only=True), JSON)."""
    buf = io.BytesIO()
    torch.save(trainer.optimizer_state(), buf)
    buf.seek(0)
    optimizer_state = torch.load(buf, weights_only=True)
    model_state = {k: v.clone() for k, v in trainer.full_model_state().items()}
    return model_state, optimizer_state, json.loads(json.dumps(trainer.state_dict()))


def test_a_stop_mid_accumulation_resumes_to_the_uninterrupted_weights_bit_for_bit():
    reference = _trainer(3)
    ref_steps = _train(reference, range(6))
    assert [reference.step, len(ref_steps)] == [2, 2]

    stopped = _trainer(3)
    assert len(_train(stopped, range(4))) == 1  # step 1, then one micro-batch of step 2
    assert stopped.accumulator.micro == 1
    model_state, optimizer_state, state = _through_files(stopped)
    assert "accumulation" in optimizer_state, "the stop checkpoint must hold the partial accumulation"

    resumed = _trainer(3)
    resumed.load_state_dict(state)
    resumed.restore(model_state, optimizer_state)
    steps = _train(resumed, range(4, 6))
    assert resumed.step == 2 and len(steps) == 1, "the resumed run completes step 2; no extra step"
    for name, want in reference.drafter.state_dict().items():
        assert torch.equal(resumed.drafter.state_dict()[name], want), f"{name} differs after the resume"
    timing = {"tokens_per_s", "samples_per_s"}
    assert {k: v for k, v in steps[0].items() if k not in timing} == {k: v for k, v in ref_steps[1].items() if k not in timing}


def test_a_checkpoint_at_a_step_boundary_holds_no_accumulation():
    trainer = _trainer(2)
    _train(trainer, range(2))
    assert "accumulation" not in trainer.optimizer_state()
