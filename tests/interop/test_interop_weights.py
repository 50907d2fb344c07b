"""How the interop check maps vLLM's drafter parameters onto an export (``interop/vllm_side.py``, run in the
vLLM environment; this part needs only torch and safetensors): fused q/k/v and gate/up, the target's
embedding and LM head, vLLM's optional mask embedding, and every kind of mismatch reported."""

from __future__ import annotations

import torch
from interoptools import load_interop
from safetensors.torch import save_file
from torch import nn

side = load_interop("vllm_side")


def _export(tmp_path):
    g = torch.Generator().manual_seed(0)
    t = {n: torch.randn(s, generator=g) for n, s in {
        "layers.0.self_attn.q_proj.weight": (8, 4), "layers.0.self_attn.k_proj.weight": (4, 4),
        "layers.0.self_attn.v_proj.weight": (4, 4), "layers.0.mlp.gate_proj.weight": (6, 4),
        "layers.0.mlp.up_proj.weight": (6, 4), "layers.0.self_attn.k_norm.weight": (4,),
        "candidate_selector.predecessor_codebook": (10, 2)}.items()}
    (tmp_path / "d").mkdir()
    (tmp_path / "t").mkdir()
    save_file(t, str(tmp_path / "d" / "model.safetensors"))
    target = {"model.embed_tokens.weight": torch.randn(10, 4, generator=g)}
    save_file(target, str(tmp_path / "t" / "model.safetensors"))
    return t, target


def _model(t, target):
    """A module with vLLM's parameter names holding what the loader should have put there."""
    m = nn.Module()
    m.model = nn.Module()
    params = {
        "model.layers.0.self_attn.qkv_proj.weight": torch.cat([t[f"layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]),
        "model.layers.0.mlp.gate_up_proj.weight": torch.cat([t["layers.0.mlp.gate_proj.weight"], t["layers.0.mlp.up_proj.weight"]]),
        "model.layers.0.self_attn.k_norm.weight": t["layers.0.self_attn.k_norm.weight"],
        "model.candidate_selector.predecessor_codebook.weight": t["candidate_selector.predecessor_codebook"],
        "model.embed_tokens.weight": target["model.embed_tokens.weight"],
        "lm_head.weight": target["model.embed_tokens.weight"],  # tied
        "model.mask_embedding": torch.zeros(4),
    }
    return m, {n: v.clone() for n, v in params.items()}


def test_every_parameter_matched(tmp_path):
    t, target = _export(tmp_path)
    final, loaded = _model(t, target)
    final.model.embed_tokens = nn.Embedding(10, 4)
    final.model.embed_tokens.weight.data.copy_(target["model.embed_tokens.weight"])
    final.lm_head = nn.Linear(4, 10, bias=False)
    final.lm_head.weight = final.model.embed_tokens.weight
    r = side.match_parameters(loaded, final, str(tmp_path / "d"), str(tmp_path / "t"))
    assert (r["parameters"], r["equal"], r["different"], r["unmapped"], r["export_unused"]) == (6, 6, [], [], [])
    assert r["not_in_export_by_design"] == ["model.mask_embedding"]


def test_a_wrong_value_a_parameter_without_source_and_an_unused_tensor_are_reported(tmp_path):
    t, target = _export(tmp_path)
    final, loaded = _model(t, target)
    final.model.embed_tokens = nn.Embedding(10, 4)  # not the target's: a sharing that did not happen
    final.lm_head = nn.Linear(4, 10, bias=False)
    final.lm_head.weight.data.copy_(target["model.embed_tokens.weight"])
    loaded["model.layers.0.self_attn.qkv_proj.weight"][0, 0] += 1.0
    loaded["model.layers.0.extra.weight"] = torch.ones(2)
    del loaded["model.layers.0.self_attn.k_norm.weight"]
    r = side.match_parameters(loaded, final, str(tmp_path / "d"), str(tmp_path / "t"))
    assert sorted(r["different"]) == ["model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight"]
    assert r["unmapped"] == ["model.layers.0.extra.weight"]
    assert r["export_unused"] == ["layers.0.self_attn.k_norm.weight"]
