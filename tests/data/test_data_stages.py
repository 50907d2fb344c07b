"""The data stages in a real pipeline: sources -> Bucketer -> Interleaver -> Padder; ranks and resume."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_flow.core import Graph, Pipeline, RuntimeOptions, StageContext
from dflash_flow.services import RunServices
from dflash_flow.stages.bucketer import Bucketer
from dflash_flow.stages.interleaver import Interleaver
from dflash_flow.stages.padder import Padder
from dflash_flow.stages.sources import ChatSource, TokenizedSource


def _runtime():
    return RuntimeOptions(capacity=4, stall_timeout_s=30.0, drain_timeout_s=5.0, shutdown_grace_s=5.0)


@pytest.fixture
def token_file(tmp_path):
    rng = np.random.default_rng(0)
    f = tmp_path / "tok.jsonl"
    with f.open("w") as fh:
        for _ in range(300):
            n = int(rng.integers(4, 200))
            fh.write(
                json.dumps(
                    {"input_ids": rng.integers(0, 500, n).tolist(), "loss_mask": [0] * 2 + [1] * (n - 2)}
                )
                + "\n"
            )
        fh.write("{broken\n")
    return f


def _graph(path, epochs=2, **inter):
    g = Graph(name="data", seed=11, runtime=_runtime())
    g.add("src", TokenizedSource(paths=[str(path)], cache_dir=None, vocab_size=500))
    g.add(
        "bucket", Bucketer(max_tokens=2048, num_buckets=4, epochs=epochs, pad_to_multiple=8), inputs=["src"]
    )
    g.add("inter", Interleaver(**inter), inputs=["bucket"])
    g.add("pad", Padder(pad_to_multiple=8, pin_memory=False), inputs=["inter"])
    return g


def test_pipeline_every_sample_once_per_epoch_within_budget(token_file, tmp_path):
    pipe = Pipeline(_graph(token_file), collect=["pad"], check_devices=False, output_dir=tmp_path / "run")
    batches = list(pipe.iterate("pad"))
    by_epoch: dict[int, list[int]] = {0: [], 1: []}
    buckets: dict[int, list[int]] = {0: [], 1: []}
    for b in batches:
        by_epoch[b.meta.epoch] += b.meta.sample_ids
        buckets[b.meta.epoch].append(b.meta.bucket)
        assert b.input_ids.numel() == b.meta.padded_tokens <= 2048
        assert b.input_ids.shape[1] % 8 == 0
        assert int(b.attention_mask.sum()) == b.meta.real_tokens
    for e in (0, 1):
        assert sorted(by_epoch[e]) == list(range(300))
        runs = np.diff(np.flatnonzero(np.diff(np.r_[-1, buckets[e], -1]) != 0))
        assert runs.max() <= 3
    metrics = pipe.snapshot().stages["pad"].replicas[0].metrics
    assert metrics["padding_efficiency"] > 0.8
    src = pipe.snapshot().stages["src"].replicas[0].metrics
    assert src["samples"] == 300 and src["bad_records"] == {"invalid_json": 1}


def _drive(inter: Interleaver, ctx: StageContext, items, take: int | None = None):
    inter.setup(ctx)
    out = []
    for item in items:
        for pb in inter.process(item) or ():
            out.append(pb.meta)
            if take is not None and len(out) == take:
                return out
    return out


def _epochs(path, epochs=2):
    b = Bucketer(max_tokens=2048, num_buckets=4, epochs=epochs)
    b.setup(StageContext(name="bucket", seed=11))
    src = TokenizedSource(paths=[str(path)], cache_dir=None)
    src.setup(StageContext(name="src", seed=11))
    for s in src.produce():
        b.process(s)
    return list(b.finish())


def test_interleaver_resume_mid_epoch_continues_exactly(token_file):
    items = _epochs(token_file)
    full = _drive(Interleaver(), StageContext(name="inter", seed=11), items)
    k = len(full) // 2 + 3  # into the second half of epoch 0 or into epoch 1
    first = Interleaver()
    _drive(first, StageContext(name="inter", seed=11), items, take=k)
    state = first.state_dict()
    second = Interleaver()
    second.load_state_dict(json.loads(json.dumps(state)))  # states must survive JSON
    rest = _drive(second, StageContext(name="inter", seed=11), items)
    assert [(m.epoch, m.index) for m in rest] == [(m.epoch, m.index) for m in full[k:]]


@pytest.mark.parametrize("tail", ["filler", "drop"])
def test_ranks_take_equal_disjoint_shares(token_file, tail):
    items = _epochs(token_file, epochs=1)
    shares = [
        _drive(Interleaver(tail=tail), StageContext(name="inter", seed=11, rank=r, world_size=3), items)
        for r in range(3)
    ]
    assert len({len(s) for s in shares}) == 1  # same number of steps: collectives never wait forever
    n = sum(items[0].packed.counts)
    real = [m for s in shares for m in s if not m.filler]
    positions = sorted(m.index for m in real)
    if tail == "drop":
        assert positions == list(range(n // 3 * 3))
    else:
        assert positions == list(range(n))  # every batch exactly once
        fillers = [m for s in shares for m in s if m.filler]
        assert len(fillers) == len(shares[0]) * 3 - n and all(m.num_samples == 0 for m in fillers)
    # the run cap holds for the sequence of global steps (step s = the ranks' s-th batches)
    labels = [shares[0][k].bucket for k in range(len(shares[0])) if not shares[0][k].filler]
    assert max(len(list(g)) for g in _runs(labels)) <= 3
    assert [m.last_of_epoch for m in shares[1]] == [False] * (len(shares[1]) - 1) + [True]


def _runs(seq):
    import itertools

    return (list(g) for _, g in itertools.groupby(seq))


def test_chat_source_with_tokenizer_service(tmp_path, chatml_tokenizer):
    f = tmp_path / "chat.jsonl"
    rows = [
        {
            "conversations": [
                {"role": "user", "content": f"Question {i}"},
                {"role": "assistant", "content": f"Answer {i}"},
            ]
        }
        for i in range(20)
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    g = Graph(name="chat", seed=1, runtime=_runtime())
    g.add("src", ChatSource(paths=[str(f)], cache_dir=str(tmp_path / "cache")))
    g.add("bucket", Bucketer(max_tokens=256, num_buckets=2), inputs=["src"])
    g.add("inter", Interleaver(), inputs=["bucket"])
    g.add("pad", Padder(pin_memory=False), inputs=["inter"])
    for attempt in range(2):
        pipe = Pipeline(
            g,
            collect=["pad"],
            services=RunServices(tokenizer=chatml_tokenizer),
            check_devices=False,
            output_dir=tmp_path / "r",
        )
        batches = list(pipe.iterate("pad"))
        assert sorted(i for b in batches for i in b.meta.sample_ids) == list(range(20))
        for b in batches:
            for row in range(b.input_ids.shape[0]):
                sup = b.input_ids[row][b.loss_mask[row] == 1].tolist()
                assert chatml_tokenizer.decode(sup).startswith("Answer ")
        cached = pipe.snapshot().stages["src"].replicas[0].metrics["files_from_cache"]
        assert cached == attempt  # the second run reads the tokenization cache
