"""Acceptance over time (model.walk.HeldoutProbe): the probe's walk on a fixed held-out sample is the final
evaluation's walk on the same conversations, at every point of training, and measuring it changes
nothing about the training (same losses, same weights)."""

from __future__ import annotations

import pytest
import torch

from dflash_flow.items import BatchMeta, TargetFeatures
from dflash_flow.model.block_drafter import features
from dflash_flow.model.generation import greedy_generate
from dflash_flow.model.head import load_shared_head
from dflash_flow.model.target import load_target, load_target_config
from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter
from dflash_flow.model.walk import HeldoutProbe, evaluate_walk

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

PRESET = "tiny-qwen3-8l"
HORIZON = 24


@pytest.fixture(scope="module")
def target():
    return load_target(PRESET, dtype=torch.float32)


@pytest.fixture(scope="module")
def conversations(target):
    """(prompt, the target's own greedy reply): the walk's data."""
    g = torch.Generator().manual_seed(7)
    out = []
    for n in (5, 8, 6):
        ids = torch.randint(1, 500, (1, n), generator=g)
        out.append((ids[0].tolist(), greedy_generate(target, ids, HORIZON + 8).new_ids))
    return out


def _trainer():
    drafter = build_drafter(load_target_config(PRESET), DrafterShape(num_layers=1, block_size=4, mask_token_id=511),
                            seed=0, device="cpu", dtype=torch.float32)
    head = load_shared_head(PRESET, "cpu", torch.float32)
    config = TrainerConfig(num_anchors=16, lr=3e-3, warmup_ratio=0.0)
    return DrafterTrainer(drafter, head, config, device="cpu", dtype=torch.float32)


def _batch(target, trainer, conversations, index: int) -> TargetFeatures:
    """The conversations themselves as a training batch, with the target's real features."""
    seqs = [p + r for p, r in conversations]
    s = max(map(len, seqs))
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    for i, ((p, _r), seq) in enumerate(zip(conversations, seqs, strict=True)):
        ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        mask[i, len(p) : len(seq)] = 1
    with torch.no_grad():
        out = target(input_ids=ids, attention_mask=attn, output_hidden_states=True)
    hidden = features(out.hidden_states, trainer.drafter.target_layer_ids)
    meta = BatchMeta(epoch=0, index=index, bucket=0, lengths=[len(q) for q in seqs], real_tokens=int(attn.sum()),
                     padded_tokens=ids.numel(), num_samples=len(seqs), sample_ids=list(range(len(seqs))),
                     total_batches=6)
    return TargetFeatures(input_ids=ids, loss_mask=mask, attention_mask=attn, hidden_states=hidden, meta=meta,
                          target_layer_ids=list(trainer.drafter.target_layer_ids))


def test_the_probe_is_the_walk_and_leaves_training_unchanged(target, conversations):
    probed, plain = _trainer(), _trainer()
    probe = HeldoutProbe.prepare(target, conversations, horizon=HORIZON,
                                 layer_ids=probed.drafter.target_layer_ids)
    taus = []
    for index in range(6):
        for trainer in (probed, plain):
            m = trainer.train_batch(_batch(target, trainer, conversations, index), anchor_seed=index)
            if trainer is probed:
                loss_probed = m["loss"]
            else:
                assert m["loss"] == loss_probed  # bit for bit: the probe draws no random numbers
        r = probe.measure(probed.drafter, probed.head)
        assert probed.drafter.training  # the walk's eval mode is undone
        want = evaluate_walk(target, probed.drafter, conversations, horizons=[HORIZON])
        assert r.tau == want.metrics["tau"] and r.blocks == want.at(HORIZON, "verify_steps")
        assert r.seconds > 0
        taus.append(r.tau)
    for a, b in zip(probed.drafter.state_dict().values(), plain.drafter.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert taus[-1] > 1.2, taus  # trained on these very replies: its walk accepts more than the bonus


def test_the_probe_refuses_an_empty_sample_or_horizon(target):
    with pytest.raises(ValueError, match="at least one conversation"):
        HeldoutProbe([], horizon=4, layer_ids=[1])
    with pytest.raises(ValueError, match="horizon must be >= 1"):
        HeldoutProbe.prepare(target, [([1, 2], [3, 4])], horizon=0, layer_ids=[1])
