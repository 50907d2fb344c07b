"""Checkpoint export / load: HF layout, round trip, validation errors."""

from __future__ import annotations

import json

import pytest
import torch
from model_testlib import HIDDEN, MASK_ID, build_drafter, build_target, randomize
from safetensors.torch import load_file

from dflash_flow.model.export import CheckpointError, load_drafter, save_drafter


def test_config_json_has_inference_keys(target, tmp_path):
    d = build_drafter(
        target, num_layers=3, layer_types=["sliding_attention"] * 2 + ["full_attention"], sliding_window=64
    )
    path = save_drafter(d, tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert "auto_map" not in cfg  # the engines load their own DFlash model (export_contract)
    assert cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8
    assert cfg["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 64
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 3, 5]}
    keys = set(load_file(str(path / "model.safetensors")))
    assert keys == set(d.state_dict())
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in keys)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]


def test_round_trip_same_weights_and_outputs(target, tmp_path):
    d = randomize(
        build_drafter(
            target, num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=4
        ),
        2,
    ).eval()
    path = save_drafter(d, tmp_path / "c")
    back = load_drafter(path, target_config=target.config, mask_token_id=MASK_ID).eval()
    for k, v in d.state_dict().items():
        assert torch.equal(back.state_dict()[k], v)
    assert back.config.sliding_window == 4 and back.layer_types == d.layer_types
    x = dict(
        position_ids=torch.arange(14)[None],
        noise_embedding=torch.randn(1, 6, HIDDEN),
        target_hidden=torch.randn(1, 8, HIDDEN * 2),
    )
    with torch.no_grad():
        torch.testing.assert_close(back(**x), d(**x), atol=0, rtol=0)
    assert back.rotary_emb.inv_freq.dtype == torch.float32
    bf = load_drafter(path, dtype=torch.bfloat16)
    assert bf.fc.weight.dtype == torch.bfloat16 and bf.rotary_emb.inv_freq.dtype == torch.float32


def test_corrupted_weights_file_raises_clear_error(target, tmp_path):
    path = save_drafter(build_drafter(target, num_layers=1), tmp_path / "c")
    w = path / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])  # truncated download
    with pytest.raises(CheckpointError, match="corrupted"):
        load_drafter(path)
    w.write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="corrupted"):
        load_drafter(path)
    w.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter(path)


def test_pickle_is_never_loaded(target, tmp_path):
    path = save_drafter(build_drafter(target, num_layers=1), tmp_path / "c")
    (path / "model.safetensors").unlink()
    torch.save(build_drafter(target, num_layers=1).state_dict(), path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter(path)


def test_weights_from_another_config_raise(target, tmp_path):
    a = save_drafter(build_drafter(target, num_layers=1), tmp_path / "a")
    b = save_drafter(build_drafter(target, num_layers=2), tmp_path / "b")
    (a / "model.safetensors").write_bytes((b / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="another config") as e:
        load_drafter(a)
    assert "unexpected" in str(e.value) and "shape" in str(e.value)  # layers.1.* and fc [64, 128]


def test_invalid_config_raises(target, tmp_path):
    path = save_drafter(build_drafter(target, num_layers=1), tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    bad = dict(cfg, dflash_config={"target_layer_ids": [4]})
    (path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(path)
    (path / "config.json").write_text(json.dumps(dict(cfg, architectures=["Qwen3ForCausalLM"])))
    with pytest.raises(CheckpointError, match="architectures"):
        load_drafter(path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(path)


def test_target_or_mask_mismatch_raises(tmp_path):
    target = build_target()
    path = save_drafter(build_drafter(target, num_layers=1), tmp_path / "c")
    other = build_target(num_hidden_layers=12)
    with pytest.raises(CheckpointError, match="num_target_layers"):
        load_drafter(path, target_config=other.config)
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(path, mask_token_id=MASK_ID - 1)
    wide = build_target(hidden_size=128)
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_drafter(path, target_config=wide.config)


def test_a_stop_while_the_weights_are_gathered_abandons_the_export_before_any_file(target, tmp_path):
    """A run's export checks for a stop between tensors: a stop writes nothing (no half export)."""
    from dflash_flow.core import StopRequested

    d = build_drafter(target, num_layers=1)
    calls = []

    def check_stop() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise StopRequested("stage 'drafter': stopped")

    out = tmp_path / "export"
    with pytest.raises(StopRequested):
        save_drafter(d, out, check_stop=check_stop)
    assert len(calls) == 3 and len(d.state_dict()) > 3  # it stopped between tensors, not at the end
    assert not out.exists() or not any(out.iterdir())
    # Not stopped: every tensor and the point before the files are checked, and the export is complete.
    calls.clear()
    save_drafter(d, out, check_stop=lambda: calls.append(1))
    assert len(calls) == 2 * len(d.state_dict()) + 1
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
