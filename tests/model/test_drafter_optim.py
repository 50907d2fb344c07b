"""Optimizer, schedule, clipping and accumulation of the drafter recipe."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from dflash_flow.model.optim import GradientAccumulator, MasterAdamW, WarmupCosineSchedule, build_optimizer


def small_model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.SiLU(), nn.Linear(16, 4)).to(dtype)


def fake_grads(model, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    for p in model.parameters():
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(p.dtype)


def test_fp32_path_equals_torch_adamw_with_clipping():
    a, b = small_model(), small_model()
    opt = MasterAdamW(a.parameters(), lr=1e-2, weight_decay=0.1, max_grad_norm=1.0)
    assert not opt.uses_masters and all(m is p for m, p in zip(opt.masters, opt.params, strict=True))
    ref = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(5):
        fake_grads(a, step, scale=3.0)
        fake_grads(b, step, scale=3.0)
        norm = opt.step()
        ref_norm = torch.nn.utils.clip_grad_norm_(list(b.parameters()), 1.0)
        ref.step()
        ref.zero_grad()
        torch.testing.assert_close(norm, ref_norm)
        assert norm > 1.0  # clipping was active
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0)
        assert pa.grad is None


def test_bf16_params_use_fp32_masters():
    model = small_model(torch.bfloat16)
    ref = small_model(torch.float32)
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters(), strict=True):
            r.copy_(p.float())  # same starting values
    opt = MasterAdamW(model.parameters(), lr=1e-2, max_grad_norm=None)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    assert opt.uses_masters and all(m.dtype == torch.float32 for m in opt.masters)
    for step in range(4):
        fake_grads(model, step)
        with torch.no_grad():
            for p, r in zip(model.parameters(), ref.parameters(), strict=True):
                r.grad = p.grad.float()
        opt.step()
        ref_opt.step()
    for p, m, r in zip(model.parameters(), opt.masters, ref.parameters(), strict=True):
        torch.testing.assert_close(m, r, atol=1e-7, rtol=0)
        assert torch.equal(p, m.to(torch.bfloat16))


def test_masters_keep_updates_smaller_than_a_bf16_ulp():
    w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    plain = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = MasterAdamW([w], lr=1e-3, max_grad_norm=None)
    plain_opt = torch.optim.AdamW([plain], lr=1e-3, weight_decay=0.0)
    for _ in range(10):
        w.grad = torch.ones_like(w)
        plain.grad = torch.ones_like(plain)
        opt.step()
        plain_opt.step()
    # Each update (~1e-3) is below half an ulp of bf16 at 1.0 (2^-8): bf16-only AdamW never moves.
    assert torch.equal(plain, torch.ones_like(plain))
    assert torch.allclose(opt.masters[0], torch.full((4,), 0.99), atol=1e-4)
    assert (w < 1).all()


def test_nonfinite_gradient_skips_update():
    model = small_model()
    opt = MasterAdamW(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    fake_grads(model, 0)
    next(model.parameters()).grad[0, 0] = float("nan")
    norm = opt.step()
    assert not math.isfinite(norm.item()) and opt.skipped_steps == 1
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_optimizer_and_schedule_resume_exactly(dtype):
    def run(steps, state=None):
        model = small_model(dtype)
        opt, sched = build_optimizer(model, total_steps=20, lr=1e-2)
        start = 0
        if state is not None:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            sched.load_state_dict(state["sched"])
            start = sched.step_count
        for step in range(start, steps):
            fake_grads(model, step)
            opt.step()
            sched.step()
        return model, opt, sched

    full, _, full_sched = run(6)
    model, opt, sched = run(3)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict()}
    resumed, _, resumed_sched = run(6, state)
    for a, b in zip(full.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)
    assert full_sched.get_last_lr() == resumed_sched.get_last_lr()


def test_warmup_cosine_values():
    p = nn.Parameter(torch.zeros(1))
    opt = MasterAdamW([p], lr=6e-4)
    sched = WarmupCosineSchedule(opt, total_steps=100, warmup_ratio=0.04)
    assert sched.warmup_steps == 4
    lrs = []
    for _ in range(101):
        lrs.append(sched.get_last_lr()[0])
        sched.step()
    assert lrs[:4] == pytest.approx([1.5e-4, 3e-4, 4.5e-4, 6e-4])
    assert lrs[4] == pytest.approx(6e-4)
    assert lrs[52] == pytest.approx(3e-4)  # half way through the cosine
    assert lrs[100] == pytest.approx(0.0, abs=1e-12)
    assert all(x >= y for x, y in zip(lrs[4:], lrs[5:], strict=False))
    sd = sched.state_dict()
    other = WarmupCosineSchedule(MasterAdamW([nn.Parameter(torch.zeros(1))], lr=6e-4), total_steps=100)
    other.load_state_dict(sd)
    assert other.get_last_lr() == sched.get_last_lr()


def test_gradient_accumulation_matches_full_batch():
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    full, acc_model = small_model(), small_model()
    nn.functional.mse_loss(full(x), y).backward()
    acc = GradientAccumulator(2)
    assert not acc.backward(nn.functional.mse_loss(acc_model(x[:4]), y[:4]))
    assert acc.backward(nn.functional.mse_loss(acc_model(x[4:]), y[4:]))
    for a, b in zip(full.parameters(), acc_model.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-6, rtol=1e-5)
    restored = GradientAccumulator(2)
    restored.load_state_dict(acc.state_dict())
    assert restored.ready
    with pytest.raises(ValueError):
        GradientAccumulator(3).load_state_dict(acc.state_dict())


def _lrs(sched, opt, steps):
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step()
    return out


def test_a_respanned_schedule_continues_without_a_jump_and_ends_at_the_floor():
    # A resume at another world size: the same data in more steps. The lr goes on from where it was.
    opt, sched = build_optimizer(small_model(), total_steps=40, lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    _lrs(sched, opt, 20)
    at = opt.param_groups[0]["lr"]
    state = sched.state_dict()
    sched.retarget(70, respan=True)
    assert opt.param_groups[0]["lr"] == pytest.approx(at)
    # the state survives a checkpoint: a second resume continues the same curve
    opt2, sched2 = build_optimizer(small_model(), total_steps=40, lr=1.0, warmup_ratio=0.1, min_lr_ratio=0.1)
    sched2.load_state_dict(state)
    sched2.retarget(70, respan=True)
    sched3_state = sched2.state_dict()
    lrs = _lrs(sched, opt, 50)
    assert all(b <= a + 1e-12 for a, b in zip(lrs, lrs[1:], strict=False))  # still decaying, never rising
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # the floor exactly at the new last step
    assert lrs[-1] > 0.1  # ... and not before it
    opt4, sched4 = build_optimizer(small_model(), total_steps=5, lr=1.0)
    sched4.load_state_dict(sched3_state)
    assert sched4.respan_from == sched2.respan_from and sched4.total_steps == 70


def test_a_replanned_schedule_is_that_of_a_run_planned_with_the_new_length():
    # An extended run (--extend): from the resumed step on, the lr of a run planned with the new length.
    opt, sched = build_optimizer(small_model(), total_steps=30, lr=1.0, warmup_ratio=0.1)
    _lrs(sched, opt, 30)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0)  # finished: at the floor
    sched.retarget(60, respan=False)
    ref_opt, ref = build_optimizer(small_model(), total_steps=60, lr=1.0)
    ref.warmup_steps = sched.warmup_steps
    ref_lrs = _lrs(ref, ref_opt, 60)
    assert _lrs(sched, opt, 30) == pytest.approx(ref_lrs[30:])


def test_the_trainers_schedule_ends_at_the_last_step_it_takes(tmp_path):
    """A real drafter trained on a real Interleaver's plan (3 epochs that pack differently, grad_accum 3,
    max_batches cutting the last epoch): the schedule's length is the steps taken, the last update runs at
    the floor, and no step runs past the schedule (the issue: 'step 57/56', lr 0 for the last steps)."""
    from dflash_flow.core import StageContext
    from dflash_flow.items import Sample, TargetFeatures
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter
    from dflash_flow.stages.bucketer import Bucketer
    from dflash_flow.stages.interleaver import Interleaver

    g = torch.Generator().manual_seed(0)
    b = Bucketer(max_tokens=96, num_buckets=2, epochs=3, length_jitter=0.3)
    b.setup(StageContext(name="bucket", seed=5))
    for i, n in enumerate(torch.randint(6, 30, (40,), generator=g).tolist()):
        b.process(Sample(sample_id=i, input_ids=[1] * n, loss_mask=[1] * n))
    items = list(b.finish())
    sizes = [sum(i.packed.counts) for i in items]
    inter = Interleaver(max_batches=sum(sizes) - 2)
    inter.setup(StageContext(name="inter", seed=5))
    metas = [pb.meta for item in items for pb in inter.process(item)]

    tc = load_target_config("tiny-qwen3-8l")
    drafter = build_drafter(tc, DrafterShape(num_layers=1, block_size=4, mask_token_id=511), seed=0, device="cpu",
                            dtype=torch.float32)
    head = load_shared_head("tiny-qwen3-8l", "cpu", torch.float32)
    trainer = DrafterTrainer(drafter, head, TrainerConfig(num_anchors=4, lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.25,
                                                          grad_accum=3), device="cpu", dtype=torch.float32)
    width = len(drafter.target_layer_ids) * drafter.config.hidden_size
    last = None
    for m in metas:
        s = 8
        feats = TargetFeatures(meta=m, input_ids=torch.randint(0, 500, (1, s), generator=g),
                               loss_mask=torch.ones(1, s, dtype=torch.long), attention_mask=torch.ones(1, s, dtype=torch.long),
                               hidden_states=torch.randn(1, s, width, generator=g),
                               target_layer_ids=list(drafter.target_layer_ids))
        out = trainer.train_batch(feats, anchor_seed=m.index, force_step=m.ends_accumulation)
        last = out or last
        assert trainer.step <= trainer.total_steps
    assert trainer.step == trainer.total_steps
    assert trainer.accumulator.micro == 0  # nothing left over for a flush to step
    assert last["lr"] == pytest.approx(1e-3 * 0.25)  # the floor: reached at the last step, not before
