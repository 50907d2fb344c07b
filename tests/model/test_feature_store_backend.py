"""``StoreBackend`` (``model.store_backend``) against the TargetBackend protocol, with a real tiny target (the
in-process extractor): offline rows equal the rows the target computes (fp32: bit for bit) with no target
loaded; hybrid computes each sample once, writes it, and reads it back in later epochs with the same values
(also in fp8: what is trained on in the first epoch is what later epochs read); the RAM tier; a store from
other data, layers or target refused naming the field."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
from store_testlib import LAYERS, ExtractorBackend, extractor_compute, make_samples, padded

from dflash_flow.model.feature_cache import FeatureCache, per_sample_features
from dflash_flow.model.feature_store import (
    MANIFEST,
    FeatureStore,
    FeatureStoreError,
    StoreMismatch,
    build_store,
)
from dflash_flow.model.features import TargetFeatureExtractor
from dflash_flow.model.store_backend import StoreBackend
from dflash_flow.model.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

IDENTITY = {"target": {"config": "c", "weights": "w"}, "layer_ids": LAYERS, "tokenizer": "t", "chat_template": None,
            "template_kwargs": None}
WIDTH = 2 * 64


@pytest.fixture(scope="module")
def model():
    return load_target("tiny-qwen3-8l")


@pytest.fixture(scope="module")
def extractor(model):
    return TargetFeatureExtractor(model, LAYERS)


@pytest.fixture(scope="module")
def data():
    return make_samples(24, first_id=500, hi=30)


def batches(toks, seed):
    order = np.random.default_rng(seed).permutation(len(toks)).tolist()
    return [order[i : i + 5] for i in range(0, len(order), 5)]


def test_offline_rows_equal_the_targets_per_sample_rows_bit_for_bit_with_no_target(tmp_path, extractor, data):
    samples, toks = data
    build_store(tmp_path / "s", identity=IDENTITY, dtype="fp32", width=WIDTH, samples=samples,
                compute=extractor_compute(extractor), shard_bytes=8000, margin_bytes=0, vocab_size=151936)
    backend = StoreBackend(mode="offline", path=tmp_path / "s", identity=IDENTITY, layer_ids=LAYERS)
    backend.setup(devices=["cpu"], out_device="cpu", name="target")
    assert backend.layer_ids == LAYERS and backend.hidden_size == 64 and backend.vocab_size == 151936
    for order in batches(toks, 0):
        ids, mask, lengths = padded(toks, order)
        sids = [500 + i for i in order]
        got = backend.features(ids, mask, lengths, sids)
        want, _ = per_sample_features(lambda i, m, n, s: extractor(i, m), ids, lengths, sids, None)  # today's cache path, online
        assert got.dtype == torch.float32 and torch.equal(got, want)
    backend.close()


def test_offline_refuses_other_layers_target_or_tokens_and_names_a_sample_it_lacks(tmp_path, extractor, data):
    samples, toks = data
    build_store(tmp_path / "s", identity=IDENTITY, dtype="fp16", width=WIDTH, samples=samples,
                compute=extractor_compute(extractor), margin_bytes=0)
    for kw, field in (({"layer_ids": [1, 6]}, "layer_ids"),
                      ({"identity": {**IDENTITY, "target": {"config": "c", "weights": "other"}}}, "target.weights"),
                      ({"identity": {**IDENTITY, "tokenizer": "t2"}}, "tokenizer"),
                      ({"dtype": "bf16"}, "dtype")):
        b = StoreBackend(mode="offline", path=tmp_path / "s", **{"identity": IDENTITY, **kw})
        with pytest.raises(StoreMismatch, match=f"built for another {field} "):
            b.setup(devices=["cpu"], out_device="cpu", name="target")
    b = StoreBackend(mode="offline", path=tmp_path / "s", identity=IDENTITY)
    b.setup(devices=["cpu"], out_device="cpu", name="target")
    ids, mask, lengths = padded(toks, [0, 1])
    swapped = ids.clone()
    swapped[0, 0] += 1  # the same sample id, other tokens (another tokenizer or template)
    with pytest.raises(FeatureStoreError, match="tokens of sample 500 differ"):
        b.features(swapped, mask, lengths, [500, 501])
    with pytest.raises(FeatureStoreError, match="target: sample 9999 is not in feature store"):
        b.features(ids[:1], mask[:1], lengths[:1], [9999])
    b.close()
    with pytest.raises(FeatureStoreError, match="no manifest.json|not a feature store"):
        StoreBackend(mode="offline", path=tmp_path / "nothing").setup(devices=["cpu"], out_device="cpu", name="t")


@pytest.mark.parametrize("dtype", ["fp32", "fp8"])
def test_hybrid_computes_each_sample_once_writes_it_and_later_epochs_read_the_same_values(tmp_path, model, extractor,
                                                                                          data, dtype):
    samples, toks = data
    inner = ExtractorBackend(model)
    backend = StoreBackend(mode="hybrid", path=tmp_path / "s", inner=inner, identity=IDENTITY, dtype=dtype,
                           ram_budget_bytes=0, shard_bytes=6000)  # no RAM tier: later epochs read the disk
    replica = copy.deepcopy(backend)
    assert replica is backend  # the replicas of a stage share it
    for b in (backend, replica):
        b.setup(devices=["cpu"], out_device="cpu", name="target")
    assert inner.setups == 1
    epochs = []
    for epoch in range(3):
        outs = {}
        for order in batches(toks, epoch):
            ids, mask, lengths = padded(toks, order)
            got = backend.features(ids, mask, lengths, [500 + i for i in order])
            for r, i in enumerate(order):
                outs[i] = got[r, : lengths[r]].clone()
                assert not got[r, lengths[r] :].any()
        epochs.append(outs)
        if epoch == 0:
            assert inner.rows == 24  # each sample computed once, alone
    assert inner.rows == 24 and backend.disk_hits == 48  # epochs 1 and 2 read the store
    for i in range(24):
        assert torch.equal(epochs[0][i], epochs[1][i]) and torch.equal(epochs[1][i], epochs[2][i])
        ids = torch.as_tensor(toks[i], dtype=torch.long)[None]
        alone = extractor(ids, torch.ones_like(ids))[0]
        if dtype == "fp32":
            assert torch.equal(epochs[0][i], alone)
        else:  # the stored (fp8) values from the first epoch on
            amax = alone.abs().amax(-1, keepdim=True)
            assert ((epochs[0][i] - alone).abs() <= amax / 16 + 1e-12).all() and not torch.equal(epochs[0][i], alone)
    for b in (replica, backend):
        b.close()
    assert inner.closed == 1
    m = json.loads((tmp_path / "s" / MANIFEST).read_text())
    assert m["samples"] == 24 and m["dtype"] == dtype and m["identity"].get("tokens") is None  # merged at the end
    # A build of this pipeline's data then finishes it into an offline store (nothing to compute).
    calls = [0]
    r = build_store(tmp_path / "s", identity=IDENTITY, dtype=dtype, width=WIDTH, samples=samples,
                    compute=extractor_compute(extractor, calls), margin_bytes=0)
    assert r.complete and calls[0] == 0
    with FeatureStore(tmp_path / "s") as store:
        assert all(torch.equal(store.row(500 + i, epochs[0][i].dtype), epochs[0][i]) for i in range(24))


def test_hybrid_keeps_rows_in_the_ram_tier_within_its_budget(tmp_path, model, data):
    samples, toks = data
    inner = ExtractorBackend(model)
    budget = sum(len(t) for t in toks[:10]) * WIDTH * 4
    backend = StoreBackend(mode="hybrid", path=tmp_path / "s", inner=inner, identity=IDENTITY, ram_budget_bytes=budget)
    backend.setup(devices=["cpu"], out_device="cpu", name="target")
    for _ in range(2):
        for order in batches(toks, 0):
            ids, mask, lengths = padded(toks, order)
            backend.features(ids, mask, lengths, [500 + i for i in order])
    assert isinstance(backend.ram, FeatureCache) and backend.ram.bytes <= budget and backend.ram.full
    assert backend.ram.hits + backend.disk_hits == 24 and backend.ram.hits > 0 and backend.disk_hits > 0
    assert inner.rows == 24
    backend.close()


def test_hybrid_without_a_path_is_the_ram_cache_of_today(model, extractor, data):
    _, toks = data
    inner = ExtractorBackend(model)
    backend = StoreBackend(mode="hybrid", path=None, inner=inner, ram_budget_bytes=2**30)
    backend.setup(devices=["cpu"], out_device="cpu", name="target")
    cache = FeatureCache(budget_bytes=2**30)
    for epoch in range(2):
        for order in batches(toks, epoch):
            ids, mask, lengths = padded(toks, order)
            sids = [500 + i for i in order]
            got = backend.features(ids, mask, lengths, sids)
            want, _ = per_sample_features(lambda i, m, n, s: extractor(i, m), ids, lengths, sids, cache)
            assert torch.equal(got, want)
    assert inner.rows == 24 and backend.ram.hits == 24
    backend.close()


def test_hybrid_refuses_a_store_of_another_identity_and_a_running_build(tmp_path, model, extractor, data):
    samples, _ = data
    build_store(tmp_path / "s", identity=IDENTITY, dtype="fp32", width=WIDTH, samples=samples,
                compute=extractor_compute(extractor), margin_bytes=0)
    b = StoreBackend(mode="hybrid", path=tmp_path / "s", inner=ExtractorBackend(model),
                     identity={**IDENTITY, "target": {"config": "c", "weights": "w2"}})
    with pytest.raises(StoreMismatch, match="another target.weights"):
        b.setup(devices=["cpu"], out_device="cpu", name="target")
    from dflash_flow.model.feature_store import StoreLock

    with StoreLock(tmp_path / "s") as lock:
        lock.acquire(exclusive=True, what="dflash-flow features build")
        b = StoreBackend(mode="hybrid", path=tmp_path / "s", inner=ExtractorBackend(model), identity=IDENTITY)
        with pytest.raises(FeatureStoreError, match="locked by dflash-flow features build"):
            b.setup(devices=["cpu"], out_device="cpu", name="target")


def test_the_replicas_of_a_stage_share_one_tier_and_the_last_one_to_close_merges(tmp_path, model, data):
    from dflash_flow.model.spec import FeaturesConfig, ModelSpec
    from dflash_flow.model.store_backend import store_backend

    _, toks = data
    spec = ModelSpec(target="tiny-qwen3-8l", explicit_layer_ids=tuple(LAYERS),
                     features=FeaturesConfig(mode="hybrid", path=str(tmp_path / "s"), ram_budget_mb=64))
    inners = [ExtractorBackend(model), ExtractorBackend(model)]  # each replica its own target (its device)
    replicas = [store_backend(spec, inner=inner, name="target") for inner in inners]
    assert replicas[0] is not replicas[1] and replicas[0].tier is replicas[1].tier
    for r in replicas:
        r.setup(devices=["cpu"], out_device="cpu", name="target")
    assert replicas[0].tier.identity["target"]["weights"].startswith("preset:")
    for epoch in range(2):
        for k, order in enumerate(batches(toks, epoch)):  # batches dealt round-robin, another deal each epoch
            ids, mask, lengths = padded(toks, order)
            replicas[(k + epoch) % 2].features(ids, mask, lengths, [500 + i for i in order])
    assert inners[0].rows + inners[1].rows == 24  # a row one replica computed, the other read from the RAM tier
    assert replicas[0].ram.hits == 24
    replicas[0].close()
    assert not (tmp_path / "s" / MANIFEST).exists() or json.loads((tmp_path / "s" / MANIFEST).read_text())["samples"] < 24
    replicas[1].close()  # the last one: the shard being written flushed, the manifest merged
    assert json.loads((tmp_path / "s" / MANIFEST).read_text())["samples"] == 24
    assert store_backend(spec, inner=ExtractorBackend(model), name="target").tier is not replicas[0].tier  # a new run
