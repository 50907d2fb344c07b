"""The drafter module: config helpers, parameter contract, inference-path numerics against z-lab."""

from __future__ import annotations

import pytest
import torch
from dflash.model import DFlashDraftModel
from dflash.model import build_target_layer_ids as zlab_layer_ids
from model_testlib import HIDDEN, MASK_ID, TARGET_LAYERS, build_drafter, randomize

from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.drafter_config import make_drafter_config
from dflash_flow.model.drafter_layers import index_mask
from dflash_flow.model.facts import build_target_layer_ids


def test_target_layer_ids_reference_examples():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert build_target_layer_ids(36, 1) == [18]
    for layers in range(4, 70):
        for n in range(1, 8):
            assert build_target_layer_ids(layers, n) == zlab_layer_ids(layers, n)
    with pytest.raises(ValueError):
        build_target_layer_ids(3, 2)


def test_make_drafter_config_fields(target):
    cfg = make_drafter_config(
        target.config,
        num_layers=3,
        block_size=16,
        mask_token_id=MASK_ID,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=32,
    )
    assert cfg.hidden_size == HIDDEN and cfg.vocab_size == target.config.vocab_size
    assert cfg.num_target_layers == TARGET_LAYERS
    assert cfg.dflash_config == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 5]}
    assert cfg.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg.sliding_window == 32
    assert cfg.block_size == 16
    plain = make_drafter_config(target.config, num_layers=1, mask_token_id=MASK_ID)
    assert plain.dflash_config["target_layer_ids"] == [TARGET_LAYERS // 2]
    assert plain.sliding_window is None and plain.layer_types == ["full_attention"]
    with pytest.raises(ValueError, match="mask_token_id"):
        make_drafter_config(target.config, num_layers=1, mask_token_id=10_000)
    with pytest.raises(ValueError, match="out of range"):
        make_drafter_config(target.config, num_layers=1, mask_token_id=MASK_ID, target_layer_ids=[8])
    with pytest.raises(ValueError, match="sliding_window"):
        make_drafter_config(
            target.config, num_layers=1, mask_token_id=MASK_ID, layer_types=["sliding_attention"]
        )


def test_parameter_names_and_shapes_equal_zlab(target):
    ours = build_drafter(target, num_layers=2)
    theirs = DFlashDraftModel(ours.config)
    a = {k: tuple(v.shape) for k, v in ours.state_dict().items()}
    b = {k: tuple(v.shape) for k, v in theirs.state_dict().items()}
    assert a == b
    # Both directions, strict.
    theirs.load_state_dict(ours.state_dict(), strict=True)
    ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not any(k.startswith(("embed", "lm_head")) for k in a)


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_inference_forward_matches_zlab(target, layer_types, window):
    ours = randomize(build_drafter(target, num_layers=2, layer_types=layer_types, sliding_window=window), 3)
    theirs = DFlashDraftModel(ours.config).eval()
    theirs.load_state_dict(ours.state_dict())
    ours.eval()
    g = torch.Generator().manual_seed(5)
    n_feat = len(ours.target_layer_ids) * HIDDEN
    ctx = torch.randn(2, 11, n_feat, generator=g)
    noise = torch.randn(2, 8, HIDDEN, generator=g)
    pos = torch.arange(3, 3 + 19)[None].expand(2, -1)
    with torch.no_grad():
        a = ours(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
        b = theirs(position_ids=pos, noise_embedding=noise, target_hidden=ctx)
    assert a.shape == (2, 8, HIDDEN)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_index_mask_semantics():
    m = index_mask(3, 6, causal=True, window=2, device=torch.device("cpu"))[0, 0]
    # queries are keys 3,4,5; causal and window 2 -> each sees itself and the previous key.
    expected = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(m, expected)
    assert index_mask(2, 4, causal=False, window=None, device=torch.device("cpu")).all()


def test_bf16_keeps_fp32_rope_and_runs(target):
    d = build_drafter(target, num_layers=1).to(torch.bfloat16)
    assert d.rotary_emb.inv_freq.dtype == torch.float32
    assert d.fc.weight.dtype == torch.bfloat16
    out = d(
        position_ids=torch.arange(12)[None],
        noise_embedding=torch.randn(1, 4, HIDDEN, dtype=torch.bfloat16),
        target_hidden=torch.randn(1, 8, HIDDEN, dtype=torch.bfloat16),
    )
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_constructor_uses_config_ids_and_mask(target):
    d = build_drafter(target, num_layers=2, target_layer_ids=[0, 2, 7], block_size=4)
    assert d.target_layer_ids == [0, 2, 7]
    assert d.fc.in_features == 3 * HIDDEN
    assert d.block_size == 4 and d.mask_token_id == MASK_ID
    assert isinstance(d, DFlashDrafter)


def test_layers_are_transformers_qwen3_building_blocks(target):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

    d = build_drafter(target, num_layers=2)
    assert isinstance(d.rotary_emb, Qwen3RotaryEmbedding)
    assert all(isinstance(layer.mlp, Qwen3MLP) for layer in d.layers)
    norms = [m for m in d.modules() if isinstance(m, Qwen3RMSNorm)]
    assert len(norms) == 2 + 4 * len(d.layers)  # norm, hidden_norm; per layer 2 + q_norm + k_norm


def test_fused_fp32_norm_equals_transformers_and_bf16_keeps_its_rounding():
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from dflash_flow.model.drafter_layers import RMSNorm

    g = torch.Generator().manual_seed(0)
    ours, ref = RMSNorm(32, eps=1e-6), Qwen3RMSNorm(32, eps=1e-6)
    with torch.no_grad():
        w = 1 + torch.randn(32, generator=g) * 0.3
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    for scale in (1e-3, 1.0, 1e3):
        x = torch.randn(3, 7, 32, generator=g) * scale
        torch.testing.assert_close(ours(x), ref(x), atol=0, rtol=1e-6)
    xb = torch.randn(3, 7, 32, generator=g).to(torch.bfloat16)
    assert torch.equal(ours.to(torch.bfloat16)(xb), ref.to(torch.bfloat16)(xb))
