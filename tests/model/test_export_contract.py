"""The export contract (``model.export_contract``): DFlash and DFlash 2 exports pass what vLLM and SGLang
read, each broken field is named; files a server running as another user can read, whatever the umask;
the serve commands; an export that never destroys a checkpoint, an input or another model."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from model_testlib import MASK_ID, build_drafter
from safetensors.torch import load_file, save_file

from dflash_flow.app.checkpoint import Checkpointer
from dflash_flow.app.commands import export_checkpoint
from dflash_flow.core.errors import CheckpointError
from dflash_flow.model.dflash2 import DFlash2Drafter, make_dflash2_config
from dflash_flow.model.export import drafter_config_dict, save_drafter
from dflash_flow.model.export_contract import check_export, serve_commands

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def private_umask():
    old = os.umask(0o077)
    yield
    os.umask(old)


def _dflash2(target) -> DFlash2Drafter:
    torch.manual_seed(1)
    return DFlash2Drafter(make_dflash2_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK_ID,
                                             selector_rank=8, selector_top_k=6))


def test_dflash_and_dflash2_exports_meet_the_serving_contract(target, tmp_path):
    facts = check_export(save_drafter(build_drafter(target), tmp_path / "d1"))
    assert facts == {"variant": "dflash", "block_size": 8, "target_layer_ids": [1, 5], "mask_token_id": MASK_ID}
    facts2 = check_export(save_drafter(_dflash2(target), tmp_path / "d2"))
    assert facts2["variant"] == "dflash2" and facts2["block_size"] == 8
    cfg2 = json.loads((tmp_path / "d2" / "config.json").read_text())
    assert "auto_map" not in cfg2 and cfg2["dflash_config"]["block_size"] == 8
    assert {"conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"} <= set(cfg2["dflash_config"])
    cfg1 = json.loads((tmp_path / "d1" / "config.json").read_text())
    assert "auto_map" not in cfg1 and cfg1["hidden_act"] == "silu" and cfg1["num_target_layers"] == 8


def test_export_is_world_readable_whatever_the_umask(target, tmp_path, private_umask):
    out = save_drafter(build_drafter(target), tmp_path / "d")
    for p in (out / "config.json", out / "model.safetensors"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o644, p
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    # Re-exporting over it (a resumed run) keeps the modes; a file made private is named by the contract.
    os.chmod(out / "model.safetensors", 0o600)
    with pytest.raises(CheckpointError, match=r"model.safetensors is mode 0600: a server running as another user"):
        check_export(out)
    save_drafter(build_drafter(target), out)
    assert stat.S_IMODE((out / "model.safetensors").stat().st_mode) == 0o644


CONFIG_BREAKS = [
    (lambda d: d.__setitem__("auto_map", {"AutoModel": "dflash.DFlashDraftModel"}), "auto_map must be absent"),
    (lambda d: d["dflash_config"].__setitem__("eagle_aux_hidden_state_layer_ids", [1, 5]),
     r"eagle_aux_hidden_state_layer_ids \[1, 5\] is not target_layer_ids \+ 1 \(\[2, 6\]\)"),
    (lambda d: d.__setitem__("eagle_aux_hidden_state_layer_ids", [2, 7]), "vLLM would feed the drafter other"),
    (lambda d: d["dflash_config"].pop("mask_token_id"), "dflash_config.mask_token_id must be an integer"),
    (lambda d: d.pop("layer_types"), "layer_types must list one type per drafter layer"),
    (lambda d: d.pop("block_size"), "block_size must be an integer >= 2 at the top level"),
    (lambda d: d["dflash_config"].__setitem__("block_size", 16), "dflash_config.block_size 16 differs"),
    (lambda d: d.pop("num_target_layers"), "num_target_layers must be a positive integer"),
    (lambda d: d.__setitem__("hidden_act", "gelu"), "hidden_act must be 'silu'"),
    (lambda d: d.__setitem__("is_causal", True), "a DFlash block attends both ways"),
    (lambda d: d.__setitem__("architectures", ["Qwen3ForCausalLM"]), "architectures must be"),
    (lambda d: d.__setitem__("target_hidden_size", 128), "target_hidden_size 128 != hidden_size 64"),
    (lambda d: d["dflash_config"].__setitem__("target_layer_ids", [1, 9]), r"out of range for num_target_layers 8"),
]


@pytest.mark.parametrize(("breaks", "message"), CONFIG_BREAKS)
def test_each_broken_config_field_is_named(target, tmp_path, breaks, message):
    out = save_drafter(build_drafter(target), tmp_path / "d")
    d = json.loads((out / "config.json").read_text())
    breaks(d)
    (out / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=message):
        check_export(out)


def test_dflash2_fields_are_required(target, tmp_path):
    out = save_drafter(_dflash2(target), tmp_path / "d")
    d = json.loads((out / "config.json").read_text())
    del d["dflash_config"]["selector_top_k"], d["dflash_config"]["block_size"]
    (out / "config.json").write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match="dflash_config.block_size is missing") as e:
        check_export(out)
    assert "dflash_config.selector_top_k must be a positive integer" in str(e.value)


def test_weights_named_as_the_loaders_map_them(target, tmp_path):
    out = save_drafter(build_drafter(target), tmp_path / "d")
    state = load_file(str(out / "model.safetensors"))
    renamed = {("model." + k if k == "norm.weight" else k): v for k, v in state.items()}
    renamed["mask_hidden"] = torch.zeros(4)
    save_file(renamed, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="must be bare drafter weights") as e:
        check_export(out)
    assert "mask_hidden must be absent" in str(e.value) and "missing tensors ['norm.weight']" in str(e.value)


def test_serve_commands_carry_the_block_size_each_engine_wants(target, tmp_path):
    out = save_drafter(build_drafter(target, block_size=8), tmp_path / "d")
    cmds = serve_commands(out, "/models/target")
    assert cmds["vllm"] == ("vllm serve /models/target --speculative-config '{\"method\": \"dflash\", \"model\": "
                            f"\"{out.resolve()}\", \"num_speculative_tokens\": 7}}'")
    assert cmds["sglang"] == ("python -m sglang.launch_server --model-path /models/target --speculative-algorithm "
                              f"DFLASH --speculative-draft-model-path {out.resolve()} --speculative-num-draft-tokens 8")
    assert set(serve_commands(save_drafter(_dflash2(target), tmp_path / "d2"))) == {"vllm"}  # no SGLang DFlash 2
    from dflash_flow.model.export_contract import format_serve_commands

    assert "DFlash 2" not in format_serve_commands(cmds)
    d2 = format_serve_commands(serve_commands(save_drafter(_dflash2(target), tmp_path / "d2b")))
    # The engines that do not load it are named, with the recipe that trains one they do.
    assert "vLLM's GPU runner serves it" in d2 and "pipelines/dflash1.yaml" in d2


# ------------------------------------------------------------------------------ refusals (issue 23.3)


def _checkpoint(target, root):
    d = build_drafter(target)
    files = {"config.json": json.dumps(drafter_config_dict(d.config))}
    return Checkpointer(root).save(step=3, epoch=0, model_state=d.state_dict(), optimizer_state={"step": 3},
                                   data_position={"epoch": 0, "plan": None, "total": 3}, files=files)


def _snapshot(root):
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_export_never_writes_into_its_checkpoint_or_input(target, tmp_path, capsys):
    ck_root = tmp_path / "checkpoints"
    ck = _checkpoint(target, ck_root)
    before = _snapshot(ck_root)
    for out in (ck, ck_root, ck / "sub", ck_root / "drafter"):
        assert export_checkpoint(ck, out) == 2, out
        err = capsys.readouterr().err
        assert "refusing to export into" in err, err
    assert export_checkpoint(ck_root, ck_root / "x") == 2
    assert "inside the input" in capsys.readouterr().err
    assert _snapshot(ck_root) == before  # nothing written, nothing rewritten
    # A good destination works, and the output says how to serve it.
    assert export_checkpoint(ck, tmp_path / "exported", target="/models/t") == 0
    out = capsys.readouterr().out
    assert "vllm serve /models/t --speculative-config" in out and "--speculative-num-draft-tokens 8" in out
    check_export(tmp_path / "exported")
    assert export_checkpoint(ck, tmp_path / "exported") == 0  # over an earlier export: fine


def test_export_never_overwrites_a_foreign_model_or_files(target, tmp_path, capsys):
    ck = _checkpoint(target, tmp_path / "checkpoints")
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    (other / "model.safetensors").write_bytes(b"their weights")
    assert export_checkpoint(ck, other) == 2
    assert "its config.json is another model's" in capsys.readouterr().err
    assert (other / "model.safetensors").read_bytes() == b"their weights"
    (other / "config.json").unlink()
    (other / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"holds other files \(tokenizer.json\)"):
        save_drafter(build_drafter(target), other)
    assert (other / "model.safetensors").read_bytes() == b"their weights"
    (other / "tokenizer.json").unlink()  # weights alone, not a drafter's: still refused
    with pytest.raises(CheckpointError, match="its model.safetensors is not a drafter's"):
        save_drafter(build_drafter(target), other)
    assert (other / "model.safetensors").read_bytes() == b"their weights"
