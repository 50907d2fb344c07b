"""The target-feature cache (``TargetForward.cache_features``): each sample's features computed alone,
kept after the first epoch, read back in later ones; a run's result does not depend on what the cache
holds (so a resumed run, whose cache starts empty, trains what the uninterrupted run trained).

Real tiny transformers targets built from a config (random weights, no hub), real pipelines in this
process."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from dflash_flow.model.feature_cache import FeatureCache, per_sample_features
from dflash_flow.model.features import TargetFeatureExtractor
from dflash_flow.model.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def extractor():
    return TargetFeatureExtractor(load_target("tiny-qwen3-8l"), [1, 5])


def features_of(extractor):
    """The TargetBackend ``features`` signature over a bare extractor."""
    return lambda ids, mask, lengths, sample_ids: extractor(ids, mask)


def _batch(lengths, s: int, seed: int = 0):
    ids = torch.randint(1, 500, (len(lengths), s), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(s)[None] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


def test_rows_are_each_samples_own_features_padding_zero_and_cached_rows_come_back(extractor):
    lengths = [20, 13, 7]
    ids, mask = _batch(lengths, 20)
    cache = FeatureCache(budget_bytes=2**30)
    got, computed = per_sample_features(features_of(extractor), ids, lengths, [10, 11, 12], cache)
    assert computed == [0, 1, 2] and len(cache) == 3 and cache.misses == 3 and cache.hits == 0
    batched = extractor(ids, mask)
    assert got.shape == batched.shape
    for i, n in enumerate(lengths):
        alone = extractor(ids[i : i + 1, :n], mask[i : i + 1, :n])[0]
        assert torch.equal(got[i, :n], alone)  # computed alone: independent of the batch it came in
        assert torch.allclose(got[i, :n], batched[i, :n], atol=1e-5)  # ... and the batched forward's values
        assert not got[i, n:].any()  # padding is zero, as the extractor gives it
    assert cache.bytes == sum(lengths) * got.shape[-1] * 4
    # Another batch (another epoch): the same samples in another order and padding, none recomputed.
    ids2 = torch.zeros(2, 24, dtype=torch.long)
    ids2[0, :7], ids2[1, :20] = ids[2, :7], ids[0, :20]
    again, computed = per_sample_features(features_of(extractor), ids2, [7, 20], [12, 10], cache)
    assert computed == [] and cache.hits == 2
    assert torch.equal(again[0, :7], got[2, :7]) and torch.equal(again[1, :20], got[0, :20])
    assert not again[0, 7:].any()


def test_a_full_cache_recomputes_what_does_not_fit_with_the_same_values(extractor):
    lengths = [16, 16]
    ids, _ = _batch(lengths, 16, seed=1)
    row_bytes = 16 * 2 * 64 * 4  # tokens x (2 layers x hidden 64) x fp32
    small = FeatureCache(budget_bytes=row_bytes)  # room for one sample
    first, computed = per_sample_features(features_of(extractor), ids, lengths, [0, 1], small)
    assert computed == [0, 1] and len(small) == 1 and small.full
    second, computed = per_sample_features(features_of(extractor), ids, lengths, [0, 1], small)
    assert computed == [1]  # the one that did not fit runs again; nothing is evicted
    assert torch.equal(first, second)
    unchanged, _ = per_sample_features(features_of(extractor), ids, lengths, [0, 1], None)
    assert torch.equal(first, unchanged)


def test_a_sample_whose_length_changed_is_not_read_from_the_cache(extractor):
    ids, _ = _batch([12], 12, seed=2)
    cache = FeatureCache(budget_bytes=2**30)
    per_sample_features(features_of(extractor), ids, [12], [5], cache)
    assert cache.get(5, 12) is not None and cache.get(5, 11) is None


def test_a_backend_whose_rows_are_independent_gets_the_missing_rows_in_one_call(extractor):
    """An engine's rows are its own requests (``rows_independent``): the cache sends all the rows it lacks in
    one call (the engine keeps them concurrent) and gets what each row alone gives; a backend without that
    property (a padded in-process batch) still gets one call per row."""
    lengths = [20, 13, 7]
    ids, _ = _batch(lengths, 20, seed=3)
    calls: list[list] = []

    def engine_like(ids, mask, lengths, sample_ids):  # each row alone, as an engine request is
        calls.append(list(sample_ids))
        out = torch.zeros(ids.shape[0], ids.shape[1], 128)
        for i, n in enumerate(lengths):
            out[i, :n] = extractor(ids[i : i + 1, :n], torch.ones(1, n, dtype=torch.long))[0]
        return out

    cache = FeatureCache(budget_bytes=2**30)
    per_sample_features(engine_like, ids[2:], [7], [12], cache, together=True)  # one row cached before
    calls.clear()
    together, computed = per_sample_features(engine_like, ids, lengths, [10, 11, 12], cache, together=True)
    assert computed == [0, 1] and calls == [[10, 11]]  # one call, the missing rows only
    alone, _ = per_sample_features(features_of(extractor), ids, lengths, [10, 11, 12], None)
    assert torch.equal(together, alone)
    calls.clear()
    per_sample_features(engine_like, ids, lengths, [1, 2, 3], None)
    assert calls == [[1], [2], [3]]


def test_the_replicas_of_a_stage_share_one_cache():
    from dflash_flow.stages.target_forward import TargetForward

    stage = TargetForward(cache_features=True)
    replica = copy.deepcopy(stage)  # how the runtime makes a stage's replicas
    assert replica._cache is stage._cache
    assert TargetForward()._cache is not stage._cache  # but not two stages


def _doc(tmp_path: Path, data: Path, name: str, **target) -> dict:
    out = tmp_path / name
    return {
        "name": name, "seed": 3, "output_dir": str(out), "tracking": {"enabled": False},
        "checkpoint": {"every_steps": 0, "at_epoch_end": False},
        "model": {"target": "tiny-qwen3-8l", "num_draft_layers": 1, "block_size": 4, "mask_token_id": 511},
        "stages": [
            {"name": "source", "type": "TokenizedSource", "config": {"paths": [str(data)], "cache_dir": None, "max_length": 48}},
            {"name": "bucketer", "type": "Bucketer", "inputs": ["source"],
             "config": {"max_tokens": 96, "num_buckets": 2, "epochs": 3}},
            {"name": "interleaver", "type": "Interleaver", "inputs": ["bucketer"]},
            {"name": "padder", "type": "Padder", "inputs": ["interleaver"]},
            {"name": "target", "type": "TargetForward", "inputs": ["padder"], "replicas": 2,
             "config": {"torch_threads": 1, "cache_features": True, **target}},
            {"name": "drafter", "type": "DrafterStep", "inputs": ["target"], "ordered": True,
             "config": {"num_anchors": 8, "torch_threads": 1, "torch_threads_after_first_epoch": 2}},
            {"name": "monitor", "type": "Monitor", "inputs": ["drafter"],
             "config": {"interval_s": 0.2, "progress": False, "plots": False}},
        ],
    }


def test_a_cached_run_skips_the_target_after_the_first_epoch_and_trains_what_an_uncached_one_does(tmp_path):
    import yaml
    from safetensors.torch import load_file

    from dflash_flow.app import run

    data = tmp_path / "tokens.jsonl"
    g = torch.Generator().manual_seed(0)
    with data.open("w") as f:
        for n in torch.randint(10, 40, (24,), generator=g).tolist():
            ids = torch.randint(1, 500, (n,), generator=g).tolist()
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * 3 + [1] * (n - 3)}) + "\n")
    weights, stages = {}, {}
    # Everything cached, against a budget too small for any sample (every forward runs, every epoch).
    for name, budget in (("cached", 4096.0), ("recomputed", 1e-6)):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_doc(tmp_path, data, name, cache_budget_mb=budget)))
        report = run(path)
        assert report.ok, report
        out = tmp_path / name
        weights[name] = load_file(str(out / "drafter" / "model.safetensors"))
        last = json.loads((out / "monitor" / "history.json").read_text())["samples"][-1]
        stages[name] = last["stages"]["target"]
        # The drafter's threads after the first epoch, as MLflow sees them (stage/drafter/metric/torch_threads).
        assert last["stages"]["drafter"]["gauges"]["torch_threads"] == 2
    counters = stages["cached"]["counters"]
    assert counters["cache_hits"] + counters["cache_misses"] == 3 * 24
    # Epochs 2 and 3 read every sample from the cache, but for a sample of an epoch's first batch that is
    # still in flight in the other replica at the end of the epoch before (it runs again, same values).
    assert counters["cache_hits"] >= 2 * 24 - 12
    assert stages["cached"]["gauges"]["cached_samples"] == 24
    # Tokens forwarded count only the rows that ran the target.
    assert stages["cached"]["counters"]["tokens"] < stages["recomputed"]["counters"]["tokens"]
    assert stages["recomputed"]["counters"].get("cache_hits", 0) == 0
    assert weights["cached"].keys() == weights["recomputed"].keys()
    for k, w in weights["cached"].items():
        assert torch.equal(w, weights["recomputed"][k]), k  # bit-equal: the cache changes no value


def test_the_drafters_threads_follow_the_epoch():
    from dflash_flow.model.training import ThreadKnobs, ThreadPolicy

    before = torch.get_num_threads()
    try:
        policy = ThreadPolicy(ThreadKnobs(torch_threads=1, torch_threads_after_first_epoch=2))
        policy.apply(0, 0)
        assert torch.get_num_threads() == 1
        policy.apply(1, 0)
        assert torch.get_num_threads() == 2
        policy.apply(3, 0)
        assert torch.get_num_threads() == 2
        ThreadPolicy(ThreadKnobs(torch_threads=1)).apply(4, 0)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_a_thread_switch_that_made_steps_slower_is_reported_once_with_what_to_set():
    from dflash_flow.model.training import ThreadSwitchWatch

    watch = ThreadSwitchWatch(window=4)
    assert [watch.observe(0.10) for _ in range(6)] == [None] * 6
    watch.switched(1, 2)
    said = [watch.observe(0.30) for _ in range(4)]
    assert said[:3] == [None] * 3 and "torch_threads_after_first_epoch: 1" in said[3] and "100 -> 300 ms" in said[3]
    assert [watch.observe(0.30) for _ in range(8)] == [None] * 8  # once
    faster = ThreadSwitchWatch(window=4)
    for _ in range(4):
        faster.observe(0.10)
    faster.switched(1, 2)
    assert [faster.observe(0.06) for _ in range(8)] == [None] * 8  # the switch paid: nothing to say
    later = ThreadSwitchWatch(window=4)  # the cores were free at the switch and taken later on
    for _ in range(4):
        later.observe(0.10)
    later.switched(1, 2)
    assert [later.observe(0.06) for _ in range(12)] == [None] * 12
    said = [later.observe(0.25) for _ in range(4)]  # 2.5x: said at the window's end
    assert said[:3] == [None] * 3 and "100 -> 250 ms median over 4 steps" in said[3]
    assert [later.observe(0.25) for _ in range(8)] == [None] * 8  # once
    sudden = ThreadSwitchWatch(window=16)  # many times slower: said after 3 such steps, not a window
    for _ in range(16):
        sudden.observe(0.10)
    sudden.switched(1, 2)
    said = [sudden.observe(s) for s in (0.06, 0.9, 5.0, 4.0)]
    assert said[:3] == [None] * 3 and "100 -> 4000 ms median over 3 steps" in said[3]
    blip = ThreadSwitchWatch(window=16)  # one slow step among fast ones (a pause): nothing
    for _ in range(16):
        blip.observe(0.10)
    blip.switched(1, 2)
    assert [blip.observe(s) for s in (0.06, 0.9, 0.06, 0.9, 0.9, 0.06) + (0.06,) * 10] == [None] * 16
    early = ThreadSwitchWatch(window=4)
    early.switched(1, 2)  # no steps before the switch to compare with (a resumed run): nothing to say
    assert [early.observe(0.30) for _ in range(8)] == [None] * 8


def test_two_threads_that_made_steps_slower_fall_back_to_one_for_the_rest_of_the_run_and_resume_so():
    from dflash_flow.model.training import ThreadKnobs, ThreadPolicy, ThreadSwitchWatch

    def policy(fallback_at=None, **knobs):
        p = ThreadPolicy(ThreadKnobs(torch_threads=1, torch_threads_after_first_epoch=2, **knobs), fallback_at)
        p._watch = ThreadSwitchWatch(window=4)
        return p

    before = torch.get_num_threads()
    try:
        step, consumed, said = policy(), 0, []

        def train(epoch, step_s):  # as the run does: threads for the batch, the batch counted, its time watched
            nonlocal consumed
            step.apply(epoch, consumed)
            consumed += 1
            said.append(step.observe(step_s, consumed))

        for _ in range(4):
            train(0, 0.10)
        for _ in range(8):  # the cores were free: two threads pay
            train(1, 0.06)
        assert torch.get_num_threads() == 2 and step.fallback_at is None and not any(said)
        for _ in range(3):  # a neighbour took a core: three steps 9x slower
            train(1, 0.90)
        assert "going back to 1 torch thread from batch 15 on" in said[-1]
        step.apply(1, consumed)
        assert torch.get_num_threads() == 1 and step.fallback_at == 15
        for _ in range(8):  # and it stays there
            train(3, 0.10)
        assert torch.get_num_threads() == 1

        # A resumed run: the state says where the threads went back; before that batch, two threads as then.
        resumed = policy(fallback_at=step.fallback_at)
        resumed.apply(1, 10)
        assert torch.get_num_threads() == 2
        resumed.apply(1, 15)
        assert torch.get_num_threads() == 1

        kept = policy(threads_fallback=False)
        kept.apply(0, 0)
        for _ in range(4):
            kept.observe(0.10, 0)
        kept.apply(1, 0)
        warnings = [kept.observe(0.90, 0) for _ in range(4)]
        kept.apply(1, 0)
        assert any(warnings) and torch.get_num_threads() == 2 and kept.fallback_at is None  # warned only
    finally:
        torch.set_num_threads(before)
