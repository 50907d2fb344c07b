"""A target split layer-wise over several devices, and loaded only as deep as needed.

Real tiny transformers models (seeded presets, a saved checkpoint directory). How the split is made real
on a CPU machine: the same ``place_on_devices`` code runs over ``cpu`` entries (every hook installed and
called, the moves being no-ops) and its features are compared bit for bit with an unsplit forward (fp32);
and over ``[cpu, meta]``, where ``meta`` is a genuine second device (no data, real placement and shapes):
that forward runs only because the hooks move every input of the later layers, and counting the copies
onto ``meta`` shows the inputs the layers share are moved once per device, not once per layer.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dflash_flow.model.target import (
    TargetFeatureExtractor,
    decoder_layers,
    layer_devices,
    load_target,
    peek_target_depth,
    place_on_devices,
    split_device_map,
    target_depth,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: 1 thread is fastest



@pytest.fixture(scope="module")
def qwen():
    return load_target("tiny-qwen3-8l")


def _batch(b: int = 3, s: int = 20, seed: int = 0):
    ids = torch.randint(0, 512, (b, s), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, 13:] = 0  # right padding in one row
    mask[2, 5:] = 0
    return ids, mask


# ----------------------------------------------------------------------------------------- the plan


@pytest.mark.parametrize("layers,devices,expected", [
    (8, 1, [0] * 8),
    (8, 2, [0] * 4 + [1] * 4),
    (7, 2, [0] * 3 + [1] * 4),  # the first device also holds the embedding: the later one takes the extra layer
    (5, 3, [0, 1, 1, 2, 2]),
    (34, 2, [0] * 17 + [1] * 17),  # Qwen3-8B up to layer 33
    (3, 3, [0, 1, 2]),
])
def test_layers_are_split_into_contiguous_balanced_runs(layers, devices, expected):
    assert layer_devices(layers, devices) == expected


def test_more_devices_than_layers_is_refused():
    with pytest.raises(ValueError, match="every device needs at least one layer"):
        layer_devices(2, 3)
    with pytest.raises(ValueError, match="at least one device"):
        layer_devices(4, 0)


def test_device_map_puts_embedding_first_and_norm_and_untied_head_last():
    # The map is pure (nothing moves), so it can name GPUs on a machine without any.
    model = load_target("tiny-qwen3-8l", num_layers=6)
    dmap = split_device_map(model, ["cuda:0", "cuda:1"])
    assert dmap["model.embed_tokens"] == dmap["model.rotary_emb"] == "cuda:0"
    assert [dmap[f"model.layers.{i}"] for i in range(6)] == ["cuda:0"] * 3 + ["cuda:1"] * 3
    assert dmap["model.norm"] == "cuda:1" and "lm_head" not in dmap  # loaded partway: no LM head (issue 41)
    assert split_device_map(load_target("tiny-qwen3-8l"), ["cuda:0", "cuda:1"])["lm_head"] == "cuda:1"
    assert "model.layers.6" not in dmap and "model" not in dmap  # largest single-device subtrees only
    # Tied embeddings: the head is the embedding's tensor, so it stays with it on the first device.
    tied = split_device_map(load_target("tiny-qwen3-8l-tied"), ["cuda:0", "cuda:1", "cuda:2"])
    assert tied["lm_head"] == tied["model.embed_tokens"] == "cuda:0" and tied["model.norm"] == "cuda:2"


# ------------------------------------------------------------------------------ features of a split


@pytest.mark.parametrize("preset,layer_ids,n_devices", [
    ("tiny-qwen3-8l", [1, 3, 5], 2),
    ("tiny-qwen3-8l", [0, 2, 4, 6], 3),
    ("tiny-llama-8l", [1, 4], 2),
    ("tiny-qwen3-8l", [2, 7], 2),  # the last layer: HF's post-norm state, the norm on the last device
])
def test_split_features_equal_the_unsplit_forward_exactly(preset, layer_ids, n_devices):
    ids, mask = _batch()
    full = load_target(preset)
    ref = TargetFeatureExtractor(full, layer_ids)(ids, mask)
    split = load_target(preset, devices=["cpu"] * n_devices, num_layers=max(layer_ids) + 1)
    assert len(decoder_layers(split)) == max(layer_ids) + 1 and target_depth(split) == 8
    assert set(split.dflash_device_map.values()) == {"cpu"}
    got = TargetFeatureExtractor(split, layer_ids)(ids, mask)
    assert got.shape == ref.shape and torch.equal(got, ref)


def test_split_model_runs_a_whole_forward_too():
    ids, _ = _batch()
    for preset in ("tiny-qwen3-8l", "tiny-qwen3-8l-tied"):
        with torch.no_grad():
            ref = load_target(preset)(input_ids=ids).logits
            got = load_target(preset, devices=["cpu", "cpu"])(input_ids=ids).logits
        assert torch.equal(got, ref), preset


def test_meta_as_a_second_device_needs_the_hooks_and_moves_shared_inputs_once():
    ids, mask = _batch()
    unhooked = load_target("tiny-qwen3-8l")
    decoder_layers(unhooked)[5].to("meta")  # a layer on another device, nothing moving its inputs
    with pytest.raises(RuntimeError, match="device"):
        TargetFeatureExtractor(unhooked, [1, 5])(ids, mask)

    copies = {}
    for n_devices in (2, 4):  # 4 layers on meta, then 2
        model = place_on_devices(load_target("tiny-qwen3-8l"), ["cpu"] * (n_devices - 1) + ["meta"])
        on_meta = [i for i in range(8) if model.dflash_device_map[f"model.layers.{i}"] == "meta"]
        assert on_meta == list(range(8 - 8 // n_devices, 8))
        ex = TargetFeatureExtractor(model, [1, 7], output_device="meta")
        with _CopiesTo("meta") as count:
            feats = ex(ids, mask)
        assert feats.device.type == "meta" and feats.shape == (3, 20, 128)
        copies[len(on_meta)] = count.n
    # Residual stream, mask, cos, sin, position ids, one gathered layer output and the padding mask: the
    # same count whether 4 or 2 layers run on meta (each shared input is moved once per device).
    assert copies[4] == copies[2] == 7


class _CopiesTo(TorchFunctionMode):
    """Counts ``Tensor.to`` calls that copy a tensor onto ``device``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device = device
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.device.type == self.device \
                and args[0].device.type != self.device:
            self.n += 1
        return out


def test_concurrent_callers_of_one_split_model_get_their_own_features():
    model = load_target("tiny-qwen3-8l", devices=["cpu", "cpu"], num_layers=6)
    ex = TargetFeatureExtractor(model, [1, 3, 5])
    batches = [_batch(s=12 + k, seed=k) for k in range(4)]
    expected = [ex(*b) for b in batches]
    results: dict[int, torch.Tensor] = {}
    start = threading.Barrier(4)

    def work(k: int) -> None:
        start.wait(timeout=60)
        for _ in range(3):
            results[k] = ex(*batches[k])

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(torch.equal(results[k], expected[k]) for k in range(4))


def test_features_are_gathered_on_the_output_device_and_usable_in_autograd():
    ids, mask = _batch()
    model = load_target("tiny-qwen3-8l", devices=["cpu", "cpu"], num_layers=4)
    feats = TargetFeatureExtractor(model, [1, 3], output_device="cpu")(ids, mask)
    assert feats.device.type == "cpu" and not feats.is_inference()
    w = torch.ones(128, requires_grad=True)
    (feats * w).sum().backward()
    assert w.grad is not None


# ------------------------------------------------------------------------ loading only as deep as needed


def test_a_checkpoint_is_loaded_only_up_to_the_needed_layer(qwen, tmp_path, capfd):
    qwen.save_pretrained(tmp_path / "tgt")
    capfd.readouterr()
    part = load_target(str(tmp_path / "tgt"), devices=["cpu", "cpu"], num_layers=4)
    err = capfd.readouterr().err
    # The skipped layers are in the checkpoint on purpose: transformers' UNEXPECTED report is not shown.
    assert "UNEXPECTED" not in err and "LOAD REPORT" not in err
    assert len(decoder_layers(part)) == 4 and part.config.num_hidden_layers == 4 and target_depth(part) == 8
    assert not any(".layers.4." in name for name, _ in part.named_parameters())
    ids, mask = _batch()
    assert torch.equal(TargetFeatureExtractor(part, [0, 3])(ids, mask), TargetFeatureExtractor(qwen, [0, 3])(ids, mask))
    # One device, partial load: the same features.
    one = load_target(str(tmp_path / "tgt"), num_layers=2)
    assert len(decoder_layers(one)) == 2
    assert torch.equal(TargetFeatureExtractor(one, [1])(ids, mask), TargetFeatureExtractor(qwen, [1])(ids, mask))


def test_partial_models_refuse_layers_they_do_not_have():
    part = load_target("tiny-qwen3-8l", num_layers=3)
    with pytest.raises(ValueError, match=r"target layer ids \[5\] were not loaded: this target was loaded only 3 of its 8"):
        TargetFeatureExtractor(part, [1, 5])
    with pytest.raises(ValueError, match=r"outside \[0, 7\]"):
        TargetFeatureExtractor(part, [9])
    with pytest.raises(ValueError, match="num_layers=9 but the target has only 8 decoder layers"):
        load_target("tiny-qwen3-8l", num_layers=9)
    with pytest.raises(ValueError, match="every device needs at least one layer"):
        load_target("tiny-qwen3-8l", devices=["cpu"] * 3, num_layers=2)
    with pytest.raises(ValueError, match="either device or devices"):
        load_target("tiny-qwen3-8l", device="cpu", devices=["cpu", "cpu"])


def test_a_partial_preset_has_the_full_presets_weights(qwen):
    part = load_target("tiny-qwen3-8l", num_layers=5)
    full = dict(qwen.named_parameters())
    for name, p in part.named_parameters():
        assert torch.equal(p, full[name]), name


def test_depth_is_read_without_weights_and_without_the_network(qwen, tmp_path):
    assert peek_target_depth("tiny-qwen3-12l") == 12
    assert peek_target_depth({"preset": "tiny-qwen3-8l", "num_hidden_layers": 10}) == 10
    qwen.config.save_pretrained(tmp_path / "cfg-only")  # a config.json and no weights at all
    assert peek_target_depth(str(tmp_path / "cfg-only")) == 8
    assert peek_target_depth("dflash-flow-tests/not-cached-9f3e") is None  # never asks the hub
    assert peek_target_depth(str(tmp_path / "missing")) is None


# --------------------------------------------------------------------------------- the stage


def _stage_features(devices: list[str], layer_ids: list[int]):
    from dflash_flow.core.stage import StageContext
    from dflash_flow.items import BatchMeta, PaddedBatch
    from dflash_flow.model.spec import ModelSpec
    from dflash_flow.services import RunServices
    from dflash_flow.stages.target_forward import TargetForward

    stage = TargetForward()
    spec = ModelSpec(declared="tiny-qwen3-8l", target="tiny-qwen3-8l", explicit_layer_ids=tuple(layer_ids))
    stage.setup(StageContext(name="target", device=devices[0], devices=devices, downstream_devices=["cpu"],
                             services=RunServices(model=spec)))
    ids, mask = _batch()
    meta = BatchMeta(epoch=0, index=0, bucket=0, lengths=[20, 13, 5], real_tokens=38, padded_tokens=60, num_samples=3)
    (out,) = stage.process(PaddedBatch(meta=meta, input_ids=ids, attention_mask=mask, position_ids=None, loss_mask=mask))
    return stage, out


def test_target_forward_splits_over_its_replicas_devices():
    split, got = _stage_features(["cpu", "cpu"], [1, 3, 5])
    assert len(decoder_layers(split._backend.model)) == 6  # loaded up to layer 5 only
    assert list(split._backend.model.dflash_device_map)[0] == "model.embed_tokens"
    _, ref = _stage_features(["cpu"], [1, 3, 5])
    assert torch.equal(got.hidden_states, ref.hidden_states) and got.hidden_states.shape == (3, 20, 192)


def test_target_forward_checks_its_devices_against_the_target():
    from dflash_flow.model.facts import target_facts
    from dflash_flow.model.spec import ModelSpec
    from dflash_flow.stages.target_forward import TargetForward

    def problems(devices, target="tiny-qwen3-8l", ids=None, n=1):
        spec = ModelSpec(declared=target, target=target, num_draft_layers=n, facts=target_facts(target),
                         explicit_layer_ids=tuple(ids) if ids is not None else None)
        return TargetForward().model_problems(spec, devices)

    two = [["cuda:0", "cuda:1"]]
    assert problems(two, ids=[1, 5]) == []
    [(field, message)] = problems([["cuda:0", "cuda:1", "cuda:2"]], ids=[0, 1])
    assert field == "devices" and "spans 3 devices but the target runs only 2 layer(s)" in message
    # The default ids (DFlash rule) on a 12-layer preset reach layer 9: ten devices at most.
    assert problems([["cpu"] * 10], "tiny-qwen3-12l", n=3) == []
    assert problems([["cpu"] * 11], "tiny-qwen3-12l", n=3)[0][0] == "devices"
    # A target whose config cannot be read here is left to setup; none at all is named.
    assert problems(two, "/no/such/dir", ids=[40]) == []
    assert problems(two, None)[0][0] == "model.target"


def test_a_feature_cache_larger_than_the_machines_memory_is_refused_by_validation():
    import os

    from dflash_flow.stages.target_forward import TargetForward

    ram_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    [(field, message)] = TargetForward(cache_features=True, cache_budget_mb=4 * ram_mb).device_problems([["cpu"]])
    assert field == "cache_budget_mb" and "more than this machine's memory" in message and "lower it" in message
    assert TargetForward(cache_features=True, cache_budget_mb=ram_mb / 8).device_problems([["cpu"]]) == []
    assert TargetForward(cache_features=False, cache_budget_mb=4 * ram_mb).device_problems([["cpu"]]) == []
