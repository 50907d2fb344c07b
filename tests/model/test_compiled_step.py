"""The ``compile`` recipe field: the trainer hands it to the drafter, and the compiled step (torch.compile
outside the attention kernels) gives the eager step's loss and gradients."""

from __future__ import annotations

import pytest
import torch
from model_testlib import build_drafter, build_target, target_features

from dflash_flow.model.blockplan import sample_anchors
from dflash_flow.model.head import SharedHead
from dflash_flow.model.objective import dflash_loss
from dflash_flow.model.trainer import DFlashObjective, TrainerConfig
from dflash_flow.stages.drafter_step import DrafterStep


@pytest.fixture(scope="module")
def target():
    return build_target()


def _head(target):
    return SharedHead(target.get_input_embeddings().weight, target.lm_head.weight)


def test_compile_is_a_drafter_step_field_auto_by_default_and_reaches_every_layer(target):
    assert TrainerConfig().compile == "auto"  # eager until the planned steps repay compiling (model.compile_plan)
    assert "compile" in {f.name for f in __import__("attrs").fields(DrafterStep)}
    drafter = build_drafter(target)
    DFlashObjective(drafter, _head(target), gamma=4.0, config=TrainerConfig(compile=True))
    assert drafter.compiled and all(layer.compiled for layer in drafter.layers) and drafter.compile_plan is None
    DFlashObjective(drafter, _head(target), gamma=4.0, config=TrainerConfig())
    assert not drafter.compiled and not any(layer.compiled for layer in drafter.layers)
    assert drafter.compile_plan is not None and drafter.compile_plan.state == "waiting"
    DFlashObjective(drafter, _head(target), gamma=4.0, config=TrainerConfig(compile=False))
    assert not drafter.compiled and drafter.compile_plan is None


@pytest.mark.slow
def test_compiled_step_equals_eager_loss_and_gradients(target):
    # Two batch shapes (the second recompiles, with dynamic sizes) and fresh anchors each step.
    eager = build_drafter(target)
    compiled = build_drafter(target)
    compiled.compiled = True
    head = _head(target)
    for step, (b, s) in enumerate([(2, 40), (3, 56), (3, 56)]):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(1, 95, (b, s), generator=g)
        loss_mask = torch.ones(b, s, dtype=torch.long)
        loss_mask[:, :6] = 0
        feats = target_features(target, ids, eager.target_layer_ids)
        anchors = sample_anchors(loss_mask, 6, generator=g)
        outs = []
        for drafter in (eager, compiled):
            drafter.zero_grad(set_to_none=True)
            out = dflash_loss(drafter, embed_tokens=head.embed_tokens, lm_head=head.lm_head, input_ids=ids,
                              loss_mask=loss_mask, hidden_states=feats, gamma=4.0, anchors=anchors, chunk_blocks=None)
            out.loss.backward()
            outs.append(out)
        assert abs(outs[0].loss.item() - outs[1].loss.item()) <= 1e-5
        assert outs[0].metrics() == pytest.approx(outs[1].metrics(), abs=1e-5)
        for (name, p), q in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-4, msg=name)
