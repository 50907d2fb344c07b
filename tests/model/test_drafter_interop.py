"""Interoperability with z-lab's reference ``dflash`` package (the inference contract)."""

from __future__ import annotations

import json

import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate
from model_testlib import HIDDEN, MASK_ID, VOCAB, build_drafter, build_target, randomize, target_features
from safetensors.torch import load_file

from dflash_flow.model.export import load_drafter, save_drafter
from dflash_flow.model.objective import draft_block_hidden, plan_blocks


def test_export_loads_into_zlab_without_missing_or_unexpected_keys(target, tmp_path):
    drafter = randomize(build_drafter(target, num_layers=2), 1)
    path = save_drafter(drafter, tmp_path / "ckpt")
    theirs = DFlashDraftModel.from_pretrained(path, dtype=torch.float32)
    state = load_file(str(path / "model.safetensors"))
    result = DFlashDraftModel(theirs.config).load_state_dict(state, strict=True)
    assert result.missing_keys == [] and result.unexpected_keys == []
    for k, v in drafter.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v), k
    assert theirs.mask_token_id == MASK_ID
    assert theirs.target_layer_ids == drafter.target_layer_ids
    assert theirs.block_size == drafter.block_size


@pytest.mark.parametrize(
    "layer_types,window",
    [(None, None), (["sliding_attention", "full_attention"], 5), (["sliding_attention"] * 2, 3)],
)
def test_training_path_equals_zlab_inference_per_anchor(target, layer_types, window):
    ours = randomize(build_drafter(target, num_layers=2, layer_types=layer_types, sliding_window=window), 21)
    theirs = DFlashDraftModel(ours.config).eval()
    theirs.load_state_dict(ours.state_dict())
    ours.eval()
    g = torch.Generator().manual_seed(0)
    s, block = 24, ours.block_size
    ids = torch.randint(1, VOCAB - 1, (1, s), generator=g)
    lm = torch.ones_like(ids)
    feats = target_features(target, ids, ours.target_layer_ids)
    anchors = torch.tensor([[3, 4, 9, 17, 20]])  # overlapping blocks, one running past S
    plan = plan_blocks(
        ids, lm, anchors, torch.ones_like(anchors, dtype=torch.bool), block_size=block, mask_token_id=MASK_ID
    )
    emb = target.get_input_embeddings()
    with torch.no_grad():
        train = draft_block_hidden(ours, plan, embed_tokens=emb, hidden_states=feats).view(
            1, -1, block, HIDDEN
        )
        for n, a in enumerate(anchors[0].tolist()):
            block_ids = torch.tensor([[ids[0, a].item()] + [MASK_ID] * (block - 1)])
            ref = theirs(
                position_ids=torch.arange(a + block)[None],
                noise_embedding=emb(block_ids),
                target_hidden=feats[:, :a],
            )
            torch.testing.assert_close(train[:, n], ref, atol=1e-5, rtol=1e-5)
            # Inference computes features from the prefix alone: the training features are not shifted.
            prefix = target_features(target, ids[:, :a], ours.target_layer_ids)
            ref2 = theirs(
                position_ids=torch.arange(a + block)[None],
                noise_embedding=emb(block_ids),
                target_hidden=prefix,
            )
            torch.testing.assert_close(train[:, n], ref2, atol=1e-4, rtol=1e-4)


def greedy(target, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    ids = prompt
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = target(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
    return ids


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 6)])
def test_zlab_spec_generate_with_our_weights_is_lossless(target, tmp_path, layer_types, window):
    ours = randomize(
        build_drafter(target, num_layers=2, layer_types=layer_types, sliding_window=window), 31, 0.05
    )
    path = save_drafter(ours, tmp_path / "ckpt")
    theirs = DFlashDraftModel.from_pretrained(path, dtype=torch.float32).eval()
    prompt = torch.randint(1, VOCAB - 1, (1, 7), generator=torch.Generator().manual_seed(3))
    want = greedy(target, prompt, 24)
    got = theirs.spec_generate(target, prompt, max_new_tokens=24, stop_token_ids=None)
    assert torch.equal(got, want)
    # Our own class runs unchanged in z-lab's decoding loop (KV cache, cropping) with the same result.
    loaded = load_drafter(path).eval()
    got_ours = dflash_generate(loaded, target, prompt, max_new_tokens=24, stop_token_ids=None)
    assert torch.equal(got_ours, want)


def test_our_class_in_zlab_loop_matches_zlab_class_step_by_step(tmp_path):
    # Every draft call of the loop (prefill context, cached context, cropping) gives the same hidden states.
    target = build_target(seed=5)
    ours = randomize(build_drafter(target, num_layers=1), 41, 0.05).eval()
    theirs = DFlashDraftModel(ours.config).eval()
    theirs.load_state_dict(ours.state_dict())
    prompt = torch.randint(1, VOCAB - 1, (1, 9), generator=torch.Generator().manual_seed(9))
    calls = {"ours": [], "theirs": []}

    def hook(name):
        def f(module, args, kwargs, output):
            calls[name].append(output.detach().clone())

        return f

    h1 = ours.register_forward_hook(hook("ours"), with_kwargs=True)
    h2 = theirs.register_forward_hook(hook("theirs"), with_kwargs=True)
    try:
        a = dflash_generate(ours, target, prompt, max_new_tokens=16, stop_token_ids=None)
        b = dflash_generate(theirs, target, prompt, max_new_tokens=16, stop_token_ids=None)
    finally:
        h1.remove()
        h2.remove()
    assert torch.equal(a, b)
    assert len(calls["ours"]) == len(calls["theirs"]) > 1
    for x, y in zip(calls["ours"], calls["theirs"], strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_pitfall_8_config_carries_training_mask_id_and_layer_ids(target, tmp_path):
    ours = build_drafter(target, num_layers=2, target_layer_ids=[0, 3, 6], mask_token_id=7, block_size=6)
    path = save_drafter(ours, tmp_path / "ckpt")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["dflash_config"] == {"mask_token_id": 7, "target_layer_ids": [0, 3, 6]}
    assert cfg["block_size"] == 6
    theirs = DFlashDraftModel.from_pretrained(path)
    # What z-lab inference will use is exactly what training used.
    assert theirs.mask_token_id == 7 and theirs.target_layer_ids == [0, 3, 6] and theirs.block_size == 6
