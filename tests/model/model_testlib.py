"""Helpers for the model tests: tiny real models for the drafter tests: random-weight Qwen3 targets built from a config (no hub)."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.drafter_config import make_drafter_config

VOCAB = 96
HIDDEN = 64
TARGET_LAYERS = 8
MASK_ID = VOCAB - 1  # an embedding row the data never uses, like Qwen3's 151669


def tiny_target_config(**overrides) -> Qwen3Config:
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
    )
    kw.update(overrides)
    return Qwen3Config(**kw)


def build_target(seed: int = 0, **overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(tiny_target_config(**overrides))
    model.config._attn_implementation = "sdpa"
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def target_features(
    target, input_ids: torch.Tensor, layer_ids: list[int], attention_mask=None
) -> torch.Tensor:
    """Features for the drafter: hidden_states[id + 1] (the output of decoder layer id), concatenated."""
    with torch.no_grad():
        out = target(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)


def build_drafter(target, seed: int = 1, **kw) -> DFlashDrafter:
    kw.setdefault("num_layers", 2)
    kw.setdefault("block_size", 8)
    kw.setdefault("mask_token_id", MASK_ID)
    torch.manual_seed(seed)
    return DFlashDrafter(make_drafter_config(target.config, **kw))


def randomize(module: torch.nn.Module, seed: int, scale: float = 0.1) -> torch.nn.Module:
    """Non-trivial random weights: norms away from 1, so a skipped or misplaced norm shows up."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=g) * scale
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)
    return module


def drafter_stage_problems(config: dict, *, block_size: int = 16, target: str = "embedded"):
    """A DrafterStep config checked as validation checks it: structured (its own fields), then against the
    model spec of ``target`` with ``block_size`` (``UsesModel.model_problems``). Returns (stage or None,
    [(field, message)])."""
    from dflash_flow.core.convert import structure
    from dflash_flow.model.facts import target_facts
    from dflash_flow.model.spec import ModelSpec
    from dflash_flow.stages.drafter_step import DrafterStep

    obj, problems = structure(DrafterStep, config, stage="drafter")
    found = [(p.field, p.message) for p in problems]
    if obj is not None:
        if target == "embedded":
            from dflash_flow.embedded import embedded_target_path

            path = embedded_target_path()
        else:
            path = target
        spec = ModelSpec(declared=target, target=path, block_size=block_size, facts=target_facts(path))
        found += obj.model_problems(spec, [["cpu"]])
    return obj, found
