"""Target loading, depth-bounded feature extraction and the shared embedding / LM head.

Real tiny transformers models built from config (random seeded weights, no hub). Reference values come
from HF's own `output_hidden_states`.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from dflash_flow.model.head import (
    SharedHead,
    clear_shared_head_cache,
    shared_head,
    shared_head_from_checkpoint,
)
from dflash_flow.model.target import (
    TARGET_PRESETS,
    TargetFeatureExtractor,
    TargetOfflineError,
    decoder_layers,
    load_target,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: 1 thread is fastest


@pytest.fixture(scope="module")
def qwen():
    return load_target("tiny-qwen3-8l")


@pytest.fixture(scope="module")
def llama():
    return load_target("tiny-llama-8l")


def _ids(b: int, s: int, seed: int = 0, vocab: int = 512) -> torch.Tensor:
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def _hf_features(model, ids, layer_ids, attention_mask=None):
    with torch.no_grad():
        hs = model(input_ids=ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
    return torch.cat([hs[i + 1] for i in layer_ids], dim=-1)


# --------------------------------------------------------------------------------------- load_target


def test_preset_is_frozen_fp32_sdpa_and_deterministic(qwen):
    assert qwen.dtype == torch.float32
    assert qwen.config._attn_implementation == "sdpa"
    assert not qwen.training
    assert not any(p.requires_grad for p in qwen.parameters())
    assert len(decoder_layers(qwen)) == 8
    assert type(qwen).__name__ == "Qwen3ForCausalLM"
    # Same preset -> same weights, whatever the global RNG state was.
    torch.manual_seed(1234)
    again = load_target("tiny-qwen3-8l")
    for (name, a), (_, b) in zip(qwen.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_dict_preset_overrides_and_seed(qwen):
    m = load_target({"preset": "tiny-qwen3-8l", "vocab_size": 384, "seed": 3})
    assert m.config.vocab_size == 384
    assert m.get_input_embeddings().weight.shape == (384, 64)
    # A different seed gives different weights for the same shapes.
    a = decoder_layers(m)[0].mlp.up_proj.weight
    b = decoder_layers(qwen)[0].mlp.up_proj.weight
    assert a.shape == b.shape and not torch.equal(a, b)
    full = load_target(
        {
            "model_type": "llama",
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 9,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "seed": 1,
        }
    )
    assert type(full).__name__ == "LlamaForCausalLM" and len(decoder_layers(full)) == 9


def test_explicit_dtype_and_attention(qwen):
    m = load_target("tiny-qwen3-8l", dtype=torch.bfloat16, attn_implementation="eager")
    assert m.dtype == torch.bfloat16
    assert m.config._attn_implementation == "eager"


def test_local_directory_roundtrip(qwen, tmp_path):
    qwen.save_pretrained(tmp_path / "tgt")
    loaded = load_target(str(tmp_path / "tgt"))
    assert not loaded.training and not any(p.requires_grad for p in loaded.parameters())
    ids = _ids(1, 9)
    with torch.no_grad():
        assert torch.equal(qwen(ids).logits, loaded(ids).logits)


def test_hub_id_offline_raises_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(TargetOfflineError, match="offline"):
        load_target("dflash-flow-tests/no-such-model-9f3e")


def test_bad_specs():
    with pytest.raises(ValueError, match="unknown target preset"):
        load_target({"preset": "no-such-preset"})
    with pytest.raises(ValueError, match="not a preset"):
        load_target("definitely not//a hub id")


def test_presets_have_enough_layers_for_dflash_ids():
    for name, params in TARGET_PRESETS.items():
        assert params["num_hidden_layers"] >= 8, name


# ---------------------------------------------------------------------------------- feature extractor


@pytest.mark.parametrize("family", ["qwen", "llama"])
@pytest.mark.parametrize("layer_ids", [[1, 3, 5], [0], [5, 1, 2]])
def test_features_equal_hf_hidden_states(family, layer_ids, request):
    model = request.getfixturevalue(family)
    ids = _ids(2, 17, seed=len(layer_ids))
    ext = TargetFeatureExtractor(model, layer_ids)
    got = ext(ids)
    want = _hf_features(model, ids, layer_ids)
    assert got.shape == (2, 17, 64 * len(layer_ids))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_deepest_layer_is_the_last_one_matches_hf_post_norm(qwen):
    # HF's hidden_states[L] is the final-normed state; asking for layer L-1 must give the same.
    ids = _ids(1, 11, seed=5)
    got = TargetFeatureExtractor(qwen, [7, 2])(ids)
    torch.testing.assert_close(got, _hf_features(qwen, ids, [7, 2]), atol=1e-5, rtol=0)


def test_extraction_stops_at_the_deepest_requested_layer(qwen):
    calls: dict[str, int] = {}

    def counter(name):
        def hook(*_):
            calls[name] = calls.get(name, 0) + 1

        return hook

    layers = decoder_layers(qwen)
    # HF installs its own output-capturing hooks lazily; ours must come and go without a trace.
    hooks_before = [len(layer._forward_hooks) for layer in layers]
    handles = [layer.register_forward_hook(counter(f"layer{i}")) for i, layer in enumerate(layers)]
    handles.append(qwen.lm_head.register_forward_hook(counter("lm_head")))
    handles.append(qwen.model.norm.register_forward_hook(counter("norm")))
    try:
        ext = TargetFeatureExtractor(qwen, [1, 3])
        ext(_ids(1, 6))
    finally:
        for h in handles:
            h.remove()
    assert calls == {"layer0": 1, "layer1": 1, "layer2": 1, "layer3": 1}
    # Its own hooks are gone after the call.
    assert [len(layer._forward_hooks) for layer in layers] == hooks_before


def test_right_padding_is_respected(qwen):
    lengths = [13, 8, 1]
    seqs = [_ids(1, n, seed=10 + n)[0] for n in lengths]
    S = max(lengths)
    ids = torch.zeros(len(seqs), S, dtype=torch.long)
    mask = torch.zeros(len(seqs), S, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
        mask[r, : len(s)] = 1
    layer_ids = [1, 4, 6]
    ext = TargetFeatureExtractor(qwen, layer_ids)
    batched = ext(ids, mask)
    for r, s in enumerate(seqs):
        alone = ext(s[None])
        torch.testing.assert_close(batched[r, : len(s)], alone[0], atol=1e-5, rtol=0)
        assert torch.count_nonzero(batched[r, len(s) :]) == 0
    # And the real positions agree with HF run on the padded batch too.
    hf = _hf_features(qwen, ids, layer_ids, mask) * mask[..., None]
    torch.testing.assert_close(batched, hf, atol=1e-5, rtol=0)


def test_features_are_ordinary_tensors_usable_in_autograd(qwen):
    feats = TargetFeatureExtractor(qwen, [1, 2])(_ids(2, 5))
    assert not feats.is_inference() and not feats.requires_grad
    fc = torch.nn.Linear(feats.shape[-1], 3)
    fc(feats).square().mean().backward()  # would raise for an inference tensor
    assert fc.weight.grad is not None and torch.count_nonzero(fc.weight.grad) > 0


def test_dtype_cast_and_1d_input(qwen):
    ids = _ids(1, 7)
    got = TargetFeatureExtractor(qwen, [2], dtype=torch.bfloat16)(ids[0])
    assert got.dtype == torch.bfloat16 and got.shape == (1, 7, 64)
    torch.testing.assert_close(got.float(), _hf_features(qwen, ids, [2]), atol=2e-2, rtol=2e-2)


def test_invalid_layer_ids_raise(qwen):
    with pytest.raises(ValueError, match="outside"):
        TargetFeatureExtractor(qwen, [1, 8])
    with pytest.raises(ValueError):
        TargetFeatureExtractor(qwen, [])


def test_concurrent_extractors_on_one_model_do_not_interfere(qwen):
    # Two stage replicas may share one target: each call's hooks act only in its own context.
    a, b = TargetFeatureExtractor(qwen, [1]), TargetFeatureExtractor(qwen, [6, 0])
    ids_a, ids_b = _ids(2, 30, seed=1), _ids(2, 25, seed=2)
    want_a, want_b = a(ids_a), b(ids_b)
    results: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def run(name, ext, ids):
        try:
            for _ in range(15):
                results[name].append(ext(ids))
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [
        threading.Thread(target=run, args=("a", a, ids_a)),
        threading.Thread(target=run, args=("b", b, ids_b)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(torch.equal(x, want_a) for x in results["a"]) and len(results["a"]) == 15
    assert all(torch.equal(x, want_b) for x in results["b"]) and len(results["b"]) == 15


# --------------------------------------------------------------------------------------- shared head


def test_shared_head_from_model_is_cached_per_device_and_shares_storage(qwen):
    clear_shared_head_cache()
    h1 = shared_head(qwen, "cpu")
    assert isinstance(h1, SharedHead)
    assert shared_head(qwen, torch.device("cpu")) is h1
    # Same device and dtype: no copy at all.
    assert h1.embed_tokens.weight.data_ptr() == qwen.model.embed_tokens.weight.data_ptr()
    assert not h1.tied and h1.vocab_size == 512 and h1.hidden_size == 64
    assert not any(p.requires_grad for p in h1.parameters())
    h1.train()
    assert not h1.training
    ids = _ids(1, 6)
    torch.testing.assert_close(h1.embed(ids), qwen.model.embed_tokens(ids))
    x = torch.randn(2, 3, 64)
    torch.testing.assert_close(h1.logits(x), qwen.lm_head(x))
    # Another device or dtype is another (cached) head.
    h_meta = shared_head(qwen, "meta")
    assert h_meta is not h1 and h_meta.device.type == "meta" and shared_head(qwen, "meta") is h_meta
    h_bf16 = shared_head(qwen, "cpu", torch.bfloat16)
    assert h_bf16 is not h1 and h_bf16.embed_tokens.weight.dtype == torch.bfloat16
    assert shared_head(qwen, "cpu", torch.bfloat16) is h_bf16
    # A different target of the same preset is a different identity.
    other = load_target("tiny-qwen3-8l")
    assert shared_head(other, "cpu") is not h1


def test_shared_head_tied_embeddings():
    tied = load_target("tiny-qwen3-8l-tied")
    h = shared_head(tied, "cpu")
    assert h.tied
    assert h.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    x = torch.randn(4, 64)
    torch.testing.assert_close(h.logits(x), tied.lm_head(x))
    h_meta = shared_head(tied, "meta")  # copied once, still one tensor for both
    assert h_meta.tied


def test_shared_head_from_sharded_checkpoint_reads_only_its_tensors(qwen, tmp_path):
    ckpt = tmp_path / "sharded"
    qwen.save_pretrained(ckpt, max_shard_size="60KB")
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    keep = {index["model.embed_tokens.weight"], index["lm_head.weight"]}
    others = set(index.values()) - keep
    assert others, "the shard size must split the checkpoint for this test to mean anything"
    # Ruin every other shard: a loader that touched them (or the whole model) would fail.
    for name in others:
        (ckpt / name).write_bytes(b"not a safetensors file")
    clear_shared_head_cache()
    h = shared_head_from_checkpoint(ckpt, "cpu")
    assert torch.equal(h.embed_tokens.weight, qwen.model.embed_tokens.weight)
    assert torch.equal(h.lm_head.weight, qwen.lm_head.weight)
    assert not h.tied and not any(p.requires_grad for p in h.parameters())
    assert shared_head(str(ckpt), "cpu") is h  # cached by resolved directory and device
    assert shared_head_from_checkpoint(ckpt, "cpu", torch.bfloat16) is not h


def test_shared_head_from_tied_single_file_checkpoint(tmp_path):
    tied = load_target("tiny-qwen3-8l-tied")
    tied.save_pretrained(tmp_path / "tied")
    h = shared_head_from_checkpoint(tmp_path / "tied", "cpu")
    assert h.tied
    assert torch.equal(h.lm_head.weight, tied.lm_head.weight)


def test_shared_head_from_preset_is_built_once_per_device(qwen):
    clear_shared_head_cache()
    h = shared_head("tiny-qwen3-8l", "cpu")
    assert shared_head("tiny-qwen3-8l", torch.device("cpu")) is h
    # Same weights as the loaded preset, but its own storage (the temporary model is gone).
    assert torch.equal(h.embed_tokens.weight, qwen.model.embed_tokens.weight)
    assert torch.equal(h.lm_head.weight, qwen.lm_head.weight)
    assert h.embed_tokens.weight.data_ptr() != qwen.model.embed_tokens.weight.data_ptr()
    assert shared_head("tiny-qwen3-8l", "meta") is not h
    d = shared_head({"preset": "tiny-qwen3-8l-tied", "vocab_size": 300}, "cpu")
    assert d.tied and d.vocab_size == 300
    assert shared_head({"vocab_size": 300, "preset": "tiny-qwen3-8l-tied"}, "cpu") is d
