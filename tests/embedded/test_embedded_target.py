"""The shipped target: the right shape, small on disk, and measurably not noise."""

from __future__ import annotations

import math

import pytest

from dflash_flow.embedded.corpus import make_split
from dflash_flow.embedded.train_target import TargetRecipe, answer_loss, ensure_target, train_target


def test_shipped_config(target_dir, target):
    model, tok = target
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert cfg.num_hidden_layers >= 8  # distinct DFlash target-layer ids
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert cfg.vocab_size == len(tok)
    size = sum(p.stat().st_size for p in target_dir.iterdir() if p.is_file())
    assert size < 10 * 2**20, f"shipped target is {size / 2**20:.1f} MiB"


@pytest.fixture(scope="module")
def heldout():
    _, evals = make_split(0, 24, seed=0)
    return evals


def test_target_beats_random_init_by_far(target, heldout):
    import torch
    from transformers import AutoModelForCausalLM

    model, tok = target
    trained = answer_loss(model, tok, heldout)
    torch.manual_seed(0)
    random_model = AutoModelForCausalLM.from_config(model.config).eval()
    untrained = answer_loss(random_model, tok, heldout)
    # random init sits near ln(V) ~ 6.6 nats; the trained target must be far below it
    assert untrained > 5.0
    assert trained < 0.35 * untrained, (trained, untrained)
    assert math.exp(trained) < 4.0, f"held-out answer perplexity {math.exp(trained):.2f}"


def test_target_is_predictable_on_heldout_and_own_text(target, heldout):
    import torch

    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.model.generation import greedy_continuations

    model, tok = target
    # 1. teacher-forced next-token accuracy on held-out reference answers vs a uniform guess (1/V)
    correct = total = 0
    with torch.inference_mode():
        for ex in heldout[:12]:
            p = tok(tok.apply_chat_template(ex.conversations(with_answer=False), tokenize=False,
                                            add_generation_prompt=True), add_special_tokens=False)["input_ids"]
            f = tok(tok.apply_chat_template(ex.conversations(), tokenize=False),
                    add_special_tokens=False)["input_ids"]
            logits = model(torch.tensor([f])).logits[0]
            pred = logits[len(p) - 1 : len(f) - 1].argmax(-1)
            correct += int((pred == torch.tensor(f[len(p):])).sum())
            total += len(f) - len(p)
    acc = correct / total
    assert acc > 0.7 and acc > 100 / len(tok), acc

    # 2. on its own greedy answers the target is confident: the mean probability of the chosen token is
    # high (low-entropy text is what lets a drafter guess several tokens ahead)
    prompts = [tok(tok.apply_chat_template(ex.conversations(with_answer=False), tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for ex in heldout[:6]]
    gens = greedy_continuations(model, prompts, max_new_tokens=64, stop_ids=stop_token_ids(tok),
                                pad_id=tok.pad_token_id)
    probs = []
    with torch.inference_mode():
        for p, (g, _) in zip(prompts, gens, strict=True):
            ids = torch.tensor([p + g])
            lp = model(ids).logits[0, len(p) - 1 : len(p) + len(g) - 1].softmax(-1)
            probs.append(lp.gather(-1, torch.tensor(g)[:, None]).mean().item())
    assert sum(probs) / len(probs) > 0.75, probs


def test_ensure_target_returns_the_shipped_asset(target_dir, tmp_path):
    assert ensure_target(tmp_path) == target_dir
    assert not any(tmp_path.iterdir())  # nothing was trained


def test_training_is_deterministic_and_cached(tmp_path):
    # A tiny recipe (not the shipped one) exercises the cached build path end to end in seconds.
    tiny = TargetRecipe(hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128, n_train=60,
                        n_eval=4, seq_len=256, steps=3, batch_size=2, warmup_steps=1)
    logs = []
    first = ensure_target(tmp_path / "cache", tiny, log=logs.append)
    assert first.parent == tmp_path / "cache" and first.name == f"target-{tiny.key()}"
    assert any("training one" in m for m in logs)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    logs.clear()
    assert ensure_target(tmp_path / "cache", tiny, log=logs.append) == first
    assert not logs and (first / "model.safetensors").stat().st_mtime_ns == mtime
    train_target(tmp_path / "again", tiny, log=lambda m: None)
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()
