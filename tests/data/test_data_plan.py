"""The epoch plan: buckets, token budget, each sample once, run cap, determinism, ranks, resume."""

from __future__ import annotations

import functools
import itertools
import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_flow.data.epoch import FILLER, resume_plan
from dflash_flow.data.packing import (
    PlanConfig,
    _run_cap_ok,
    assign_buckets,
    bucket_boundaries,
    epoch_rng,
    interleave_buckets,
    min_feasible_run,
)
from dflash_flow.data.plan import (
    BatchPlanner,
    max_same_bucket_run,
    padding_efficiency,
    window_mix_max_deviation,
)

# ------------------------------------------------------------------------------------------------ buckets


def test_explicit_boundaries_are_inclusive_upper_bounds():
    cfg = PlanConfig(boundaries=(4, 8))
    b = bucket_boundaries([1, 2, 3], cfg)
    assert b.tolist() == [4, 8]
    assert assign_buckets([1, 4, 5, 8, 9, 100], b).tolist() == [0, 0, 1, 1, 2, 2]


def test_quantile_boundaries_split_evenly_and_drop_duplicates():
    lengths = np.arange(1, 1001)
    b = bucket_boundaries(lengths, PlanConfig(num_buckets=4))
    assert b.tolist() == [250, 500, 750]
    counts = np.bincount(assign_buckets(lengths, b))
    assert counts.tolist() == [250, 250, 250, 250]
    # Repeated lengths cannot be split: fewer buckets, never an empty last one.
    same = np.full(100, 7)
    assert bucket_boundaries(same, PlanConfig(num_buckets=6)).tolist() == []


@pytest.mark.parametrize("bad", [(8, 4), (0, 5), (3, 3)])
def test_bad_explicit_boundaries_rejected(bad):
    with pytest.raises(ValueError, match="boundaries"):
        PlanConfig(boundaries=bad)


def test_sample_longer_than_budget_is_an_error():
    with pytest.raises(ValueError, match="max_tokens"):
        BatchPlanner([10, 300], PlanConfig(max_tokens=256), seed=0).plan(0)


# ------------------------------------------------------------------------------------------- properties

lengths_st = st.lists(st.integers(1, 400), min_size=1, max_size=300)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=lengths_st,
    extra_budget=st.integers(0, 3000),
    max_bs=st.one_of(st.none(), st.integers(1, 40)),
    multiple=st.sampled_from([1, 8, 64]),
    buckets=st.integers(1, 8),
    max_run=st.integers(1, 4),
    jitter=st.sampled_from([0.0, 0.02, 0.3]),
    seed=st.integers(0, 2**32),
    epoch=st.integers(0, 5),
)
def test_plan_properties(lengths, extra_budget, max_bs, multiple, buckets, max_run, jitter, seed, epoch):
    lengths = np.asarray(lengths)
    budget = int(-(-lengths.max() // multiple) * multiple) + extra_budget
    cfg = PlanConfig(
        max_tokens=budget,
        max_batch_size=max_bs,
        pad_to_multiple=multiple,
        num_buckets=buckets,
        max_run=max_run,
        length_jitter=jitter,
    )
    planner = BatchPlanner(lengths, cfg, seed=seed)
    plan = planner.plan(epoch)

    # Every sample exactly once.
    assert sorted(plan.order.tolist()) == list(range(lengths.size))
    counts = np.bincount(plan.buckets, minlength=plan.num_buckets)
    for p in range(len(plan)):
        m = plan.meta(p)
        idx = plan.batch(p)
        # Budget in padded tokens, batch size cap, padded length a multiple, one bucket per batch.
        assert m.padded_tokens <= budget
        assert m.padded_len % multiple == 0 and m.padded_len >= max(m.lengths)
        assert m.padded_len < max(m.lengths) + multiple
        assert max_bs is None or m.num_samples <= max_bs
        assert set(planner.bucket_of[idx].tolist()) == {m.bucket}
        assert m.real_tokens == int(lengths[idx].sum())
        lo, hi = m.bucket_range  # the lengths its bucket holds (the bucket-mix plot's legend)
        assert all(lo <= n <= hi for n in m.lengths) and lo >= 1
    # Run cap: holds whenever the mix allows it, else the smallest feasible cap is met exactly.
    run = max_same_bucket_run(plan.buckets)
    if max(counts) * (max_run + 1) <= max_run * (len(plan) + 1):
        assert plan.run_cap_feasible and run <= max_run
    else:
        assert not plan.run_cap_feasible
        assert plan.max_run == min_feasible_run(counts) and run <= plan.max_run
    # Same inputs, same plan; another epoch is planned independently.
    again = BatchPlanner(lengths, cfg, seed=seed).plan(epoch)
    assert again.fingerprint() == plan.fingerprint()
    assert again.buckets.tolist() == plan.buckets.tolist()


def _exact_feasible(rem: tuple[int, ...], last: int, run: int, cap: int) -> bool:
    @functools.cache
    def ok(rem, last, run):
        if sum(rem) == 0:
            return True
        for b, r in enumerate(rem):
            if r == 0 or (b == last and run == cap):
                continue
            nxt = rem[:b] + (r - 1,) + rem[b + 1 :]
            if ok(nxt, b, run + 1 if b == last else 1):
                return True
        return False

    return ok(rem, last, run)


def test_run_cap_test_is_exact_against_exhaustive_search():
    # The interleaver looks only one step ahead; that is safe only if _run_cap_ok is exact.
    for cap in (1, 2, 3):
        for rem in itertools.product(range(6), repeat=3):
            for last in (-1, 0, 1, 2):
                for run in range(1, cap + 1) if last >= 0 else (0,):
                    expected = _exact_feasible(rem, last, run, cap)
                    assert _run_cap_ok(list(rem), sum(rem), last, run, cap) == expected, (rem, last, run, cap)


@settings(max_examples=200, deadline=None)
@given(
    counts=st.lists(st.integers(0, 60), min_size=1, max_size=7),
    max_run=st.integers(1, 5),
    seed=st.integers(0, 2**31),
)
def test_interleave_never_breaks_a_feasible_cap(counts, max_run, seed):
    seq, cap = interleave_buckets(counts, max_run=max_run, rng=epoch_rng(seed, 0))
    assert np.bincount(seq, minlength=len(counts)).tolist() == counts
    assert cap == max(max_run, min_feasible_run(counts))
    assert max_same_bucket_run(seq) <= cap


def test_infeasible_cap_warns_once_and_does_its_best(caplog):
    counts = [30, 2, 1]  # 30 of 33: a cap of 3 would need at least 10 separators
    with caplog.at_level(logging.WARNING, logger="dflash_flow.data.packing"):
        for e in range(3):
            seq, cap = interleave_buckets(counts, max_run=3, rng=epoch_rng(0, e))
            assert cap == min_feasible_run(counts) == 8
            assert max_same_bucket_run(seq) <= 8
    assert sum("cannot hold" in r.message for r in caplog.records) == 1


def test_tail_keeps_the_cap_when_small_buckets_run_out():
    # A dominant bucket (3/4 of the batches: the feasibility limit for max_run=3) must be spread so the
    # end of the epoch still has separators left.
    counts = [75, 13, 12]
    for seed in range(20):
        seq, cap = interleave_buckets(counts, max_run=3, rng=epoch_rng(seed, 0))
        assert cap == 3 and max_same_bucket_run(seq) <= 3
        assert max_same_bucket_run(seq[-20:]) <= 3


# ------------------------------------------------------------------------------ composition and mix


def _long_tailed(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(6.7, 1.0, size=n), 16, 8192).astype(np.int64)


def test_composition_varies_by_epoch_with_low_padding():
    lengths = _long_tailed(20000, 1)
    planner = BatchPlanner(lengths, PlanConfig(max_tokens=65536), seed=7)
    p0, p1 = planner.plan(0), planner.plan(1)
    s0 = {tuple(sorted(p0.batch(i).tolist())) for i in range(len(p0))}
    s1 = {tuple(sorted(p1.batch(i).tolist())) for i in range(len(p1))}
    assert len(s0 & s1) / len(s0) < 0.1
    assert p0.buckets.tolist() != p1.buckets.tolist()
    for p in (p0, p1):
        assert padding_efficiency(p.meta(i) for i in range(len(p))) >= 0.97
        assert max_same_bucket_run(p.buckets) <= 3
        assert window_mix_max_deviation(p.buckets, 32) <= 0.12


def test_different_seed_gives_different_order():
    lengths = _long_tailed(5000, 2)
    a = BatchPlanner(lengths, PlanConfig(max_tokens=32768), seed=1).plan(0)
    b = BatchPlanner(lengths, PlanConfig(max_tokens=32768), seed=2).plan(0)
    assert a.fingerprint() != b.fingerprint()


# ------------------------------------------------------------------------------------- ranks, resume


@pytest.fixture(scope="module")
def plan():
    return BatchPlanner(_long_tailed(3000, 3), PlanConfig(max_tokens=16384), seed=5).plan(2)


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_ranks_take_every_batch_once_in_equal_steps(world):
    planner = BatchPlanner(_long_tailed(3000, 3), PlanConfig(max_tokens=16384), seed=5)
    plan = planner.plan(2, world_size=world)
    n = len(plan)
    shares = [plan.rank_positions(r) for r in range(world)]
    assert len({s.size for s in shares}) == 1  # every rank takes the same number of steps
    assert shares[0].size == -(-n // world)
    flat = np.stack(shares, axis=1).reshape(-1)  # step-major: the global order
    assert flat[:n].tolist() == list(range(n))
    assert (flat[n:] == FILLER).all() and flat.size - n < world  # fillers only in the last step
    assert all(plan.meta(int(p)).filler for p in flat[n:])
    dropped = [plan.rank_positions(r, tail="drop") for r in range(world)]
    assert {s.size for s in dropped} == {n // world}


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_global_step_holds_batches_of_similar_lengths(world):
    """The step waits for its slowest rank: its batches come from one bucket where the mix allows, and
    the run cap holds over the sequence of global steps."""
    lengths = _long_tailed(20000, 4)
    plan = BatchPlanner(lengths, PlanConfig(max_tokens=65536), seed=3).plan(1, world_size=world)
    steps = [plan.buckets[s * world : (s + 1) * world] for s in range(len(plan) // world)]
    one_bucket = sum(len(set(st.tolist())) == 1 for st in steps)
    # at most one mixed step per bucket boundary (the leftovers of each bucket), plus the partial one
    assert len(steps) - one_bucket <= plan.num_buckets
    # the time a step waits for its slowest rank ~ its longest over its shortest padded length: far
    # below what dealing the same batches in a random order gives
    lens = plan.padded_lens[: len(steps) * world].reshape(-1, world).astype(float)
    ours = float((lens.max(1) / lens.min(1)).mean())
    shuffled = np.random.default_rng(0).permutation(lens.reshape(-1)).reshape(-1, world)
    assert ours < 0.7 * float((shuffled.max(1) / shuffled.min(1)).mean()), ours
    labels = np.array([st[0] for st in steps])
    assert max_same_bucket_run(labels) <= 3
    assert sorted(plan.order.tolist()) == list(range(lengths.size))


def test_elastic_redeal_trains_the_rest_exactly_once(plan):
    planner = BatchPlanner(_long_tailed(3000, 3), PlanConfig(max_tokens=16384), seed=5)
    two = planner.plan(2, world_size=2)
    batches = lambda p, a, b: [tuple(p.batch(i).tolist()) for i in range(a, b)]  # noqa: E731
    done = batches(two, 0, 20)  # 10 steps on 2 ranks
    state = two.state_dict(20)
    three, start = resume_plan(planner.plan(2, world_size=2), state, 3)
    assert start == 0 and three.world_size == 3 and three.chain == ((2, 20),)
    done3 = batches(three, 0, 9)  # 3 steps on 3 ranks, then back to 1 rank
    one, start1 = resume_plan(planner.plan(2, world_size=2), three.state_dict(9), 1)
    rest = batches(one, start1, len(one))
    every = done + done3 + rest
    assert len(every) == len(set(every)) == len(two)  # nothing skipped, nothing repeated
    # the same world size continues the very same plan
    same, pos = resume_plan(planner.plan(2, world_size=2), three.state_dict(9), 3)
    assert pos == 9 and same.fingerprint() == three.fingerprint()
    with pytest.raises(ValueError, match="differs"):
        resume_plan(BatchPlanner(_long_tailed(3000, 3), PlanConfig(max_tokens=16384), seed=6).plan(2, world_size=2), state, 2)


def test_resume_continues_with_exactly_the_unconsumed_batches(plan):
    full = [plan.meta(i).sample_ids for i in range(len(plan))]
    k = len(plan) // 3
    state = plan.state_dict(k)
    rebuilt = BatchPlanner(plan.lengths, PlanConfig(max_tokens=16384), seed=5).plan(2)
    pos = rebuilt.check_state(state)
    assert [rebuilt.meta(i).sample_ids for i in range(pos, len(rebuilt))] == full[k:]
    other = BatchPlanner(plan.lengths, PlanConfig(max_tokens=16384), seed=6).plan(2)
    with pytest.raises(ValueError, match="differs"):
        other.check_state(state)
    with pytest.raises(ValueError, match="epoch"):
        BatchPlanner(plan.lengths, PlanConfig(max_tokens=16384), seed=5).plan(3).check_state(state)
    with pytest.raises(ValueError, match="dealt as"):
        BatchPlanner(plan.lengths, PlanConfig(max_tokens=16384), seed=5).plan(2, world_size=2).check_state(state)


def test_sample_ids_are_carried(plan):
    ids = np.arange(plan.lengths.size) * 10 + 3
    p = BatchPlanner(plan.lengths, PlanConfig(max_tokens=16384), seed=5, sample_ids=ids).plan(0)
    m = p.meta(0)
    assert m.sample_ids == (ids[p.batch(0)]).tolist()
    assert m.epoch == 0 and m.index == 0 and m.num_samples == len(m.lengths)
