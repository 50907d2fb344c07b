"""Several sources mixed by weight: exact per-epoch proportions, deterministic draws, per-source
reporting, exact resume in the middle of a mixed epoch; a file listed twice is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_flow.core import Graph, StageContext
from dflash_flow.core.validate import validate
from dflash_flow.data.plan import draw_epoch, mixture_counts
from dflash_flow.stages.bucketer import Bucketer
from dflash_flow.stages.interleaver import Interleaver
from dflash_flow.stages.sources import TokenizedSource

SIZES = {"chat": 300, "code": 120, "math": 40}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    rng = np.random.default_rng(5)
    out = {}
    for k, (name, n) in enumerate(SIZES.items()):
        f = d / f"{name}.jsonl"
        with f.open("w") as fh:
            for _ in range(n):
                m = int(rng.integers(8, 120))
                fh.write(json.dumps({"input_ids": (rng.integers(0, 90, m) + 100 * k).tolist(), "loss_mask": [1] * m}) + "\n")
        out[name] = f
    return out


def _tables(sources):
    tables = []
    for name, f in sources.items():
        src = TokenizedSource(paths=[str(f)], cache_dir=None)
        src.setup(StageContext(name=name, seed=3))
        tables += list(src.produce())
    return tables


def _epochs(sources, epochs=2, **mix):
    b = Bucketer(max_tokens=1024, num_buckets=3, epochs=epochs, **mix)
    ctx = StageContext(name="bucket", seed=3)
    b.setup(ctx)
    for t in reversed(_tables(sources)):  # arrival order must not matter
        b.process(t)
    return list(b.finish()), ctx


def _source_of(sample) -> str:
    return sample.source.rsplit("/", 1)[-1].split(".jsonl")[0]


def _drawn(item) -> dict[str, int]:
    counts: dict[str, int] = {}
    for bucket in item.packed.per_bucket:
        for batch in bucket:
            for p in batch.tolist():
                s = _source_of(item.samples[p])
                counts[s] = counts.get(s, 0) + 1
    return counts


@pytest.mark.parametrize("replacement", [False, True])
def test_each_epoch_draws_the_weights_proportions(sources, replacement):
    weights = {"chat": 0.6, "code": 0.3, "math": 0.1}
    items, ctx = _epochs(sources, mixture=weights, samples_per_epoch=500, mixture_replacement=replacement)
    for item in items:
        got = _drawn(item)
        assert sum(got.values()) == 500
        for name, w in weights.items():
            assert abs(got[name] - w * 500) <= 1, (name, got)  # stated tolerance: one sample (rounding)
        # every sample's tokens came from its own source's file (ids are offset per source)
        for p in range(len(item.samples)):
            s = item.samples[p]
            assert int(np.asarray(s.input_ids).max()) // 100 == list(SIZES).index(_source_of(s))
    assert items[0].packed.sample_ids.tolist() != items[1].packed.sample_ids.tolist()  # a new draw per epoch
    reported = ctx.metrics.read()["mixture_samples"]  # per source, in MLflow as stage/bucket/metric/mixture_samples/<source>
    assert reported == {name: sum(_drawn(i)[name] for i in items) for name in weights}
    if not replacement:  # math (40 samples) is drawn 50 times: every sample once, 10 twice
        ids = items[0].packed.sample_ids
        per = np.bincount(ids[(ids >= 420)] - 420, minlength=40)
        assert per.min() == 1 and per.max() == 2 and int(per.sum()) == 50


def test_draws_are_deterministic_and_independent_of_arrival(sources):
    a, _ = _epochs(sources, mixture={"chat": 1, "code": 1, "math": 2})
    b, _ = _epochs(sources, mixture={"chat": 1, "code": 1, "math": 2})
    for x, y in zip(a, b, strict=True):
        assert x.packed.sample_ids.tolist() == y.packed.sample_ids.tolist()
    groups = [("a", 0, 10), ("b", 10, 14)]
    pos, drawn = draw_epoch(groups, {"a": 1.0, "b": 1.0}, samples_per_epoch=None, replacement=False, seed=1, epoch=0)
    assert drawn == {"a": 7, "b": 7} and pos.size == 14
    assert mixture_counts([0.6, 0.3, 0.1], 7) == [4, 2, 1]


def test_mixture_names_every_source(sources):
    with pytest.raises(ValueError, match=r"give every source a weight.*no input is called \['poetry'\]"):
        _epochs(sources, mixture={"chat": 1.0, "code": 1.0, "poetry": 1.0})


def _drive(inter, items, take=None):
    inter.setup(StageContext(name="inter", seed=3, world_size=2, rank=1))
    out = []
    for item in items:
        for pb in inter.process(item) or ():
            out.append((pb.meta.epoch, pb.meta.index, pb.meta.sample_ids,
                        [int(np.asarray(s.input_ids)[0]) for s in pb.samples]))
            if take is not None and len(out) == take:
                return out
    return out


def test_resume_in_the_middle_of_a_mixed_epoch_is_exact(sources):
    mix = {"mixture": {"chat": 0.5, "code": 0.25, "math": 0.25}, "samples_per_epoch": 400}
    items, _ = _epochs(sources, **mix)
    full = _drive(Interleaver(), items)
    k = len(full) // 4 + 1  # inside epoch 0
    first = Interleaver()
    _drive(first, items, take=k)
    state = json.loads(json.dumps(first.state_dict()))
    assert len(json.dumps(state)) < 1000  # no per-sample list in the checkpoint
    again, _ = _epochs(sources, **mix)  # a new process redraws the same epochs
    second = Interleaver()
    second.load_state_dict(state)
    assert _drive(second, again) == full[k:]


def test_a_file_listed_twice_is_refused_and_a_copy_warned(sources, tmp_path, caplog):
    g = Graph(name="dup")
    g.add("src", "TokenizedSource", config={"paths": [str(sources["chat"]), str(sources["chat"].parent / "." / "chat.jsonl")]})
    problems = validate(g, check_devices=False)
    assert any("listed twice" in p.message and "mixture weight" in p.message for p in problems), problems
    copy = tmp_path / "copy.jsonl"
    copy.write_bytes(sources["chat"].read_bytes())
    src = TokenizedSource(paths=[str(sources["chat"]), str(copy)], cache_dir=None)
    src.setup(StageContext(name="src"))
    with caplog.at_level("WARNING"):
        (table,) = list(src.produce())
    assert len(table) == 2 * SIZES["chat"]
    assert "same content" in caplog.text and "twice per epoch" in caplog.text
