"""The teacher-forced walk against real greedy speculative decoding.

On a reply that is the target's own greedy continuation, the walk must give real decoding's acceptance
lengths exactly, at every horizon, with a stop token inside the reply, and feed the drafter the same
inputs (positions, cache length, block embeddings, context features up to float rounding). Drafters: z-lab's
real `DFlashDraftModel`, unwrapped and as the `ScriptedDrafter` of test_speculative (real drafter calls,
proposals from the known continuation with chosen mistakes, so acceptance is partial and predictable).
"""

from __future__ import annotations

import json

import pytest
from test_speculative import (
    LAYER_IDS,
    MASK,
    ScriptedDrafter,
    _assert_same_calls,
    expected_accept_lengths,
    make_drafter,
    prompt,
)

from dflash_flow.model.generation import greedy_generate, spec_generate
from dflash_flow.model.target import load_target
from dflash_flow.model.walk import evaluate_walk, reply_until_stop, teacher_forced_walk

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]



@pytest.fixture(scope="module")
def target():
    return load_target("tiny-qwen3-8l")


def _greedy_reply(target, ids, horizon, stops=None) -> list[int]:
    return greedy_generate(target, ids, horizon, stop_token_ids=stops).new_ids


@pytest.mark.parametrize(("block_size", "horizons"), [(4, [24, 9]), (8, [30, 3]), (2, [12])])
@pytest.mark.parametrize("seed", [0, 5])
def test_walk_equals_real_decoding_of_a_random_drafter(target, block_size, horizons, seed):
    drafter = make_drafter(block_size, seed=seed)
    ids = prompt(seed + 20, n=6)
    reply = _greedy_reply(target, ids, max(horizons))
    walks = teacher_forced_walk(target, drafter, ids[0].tolist(), reply, horizons=horizons)
    for h in horizons:
        real = spec_generate(target, drafter, ids, max_new_tokens=h)
        assert walks[h].accept_lengths == real.accept_lengths, h
        assert walks[h].tokens == real.num_new_tokens and walks[h].complete


@pytest.mark.parametrize(
    ("block_size", "horizon", "wrong"),
    [(4, 24, set()), (4, 24, {10, 11, 17}), (8, 30, {9, 13, 14, 20, 28}), (8, 3, set()), (5, 21, set(range(0, 64, 3)))],
)
def test_walk_feeds_the_drafter_what_real_decoding_feeds_it(target, block_size, horizon, wrong):
    ids = prompt(4)
    n_in = ids.shape[1]
    continuation = greedy_generate(target, ids, horizon).output_ids[0].tolist()
    real_d = ScriptedDrafter(make_drafter(block_size, seed=1), continuation, wrong)
    walk_d = ScriptedDrafter(make_drafter(block_size, seed=1), continuation, wrong)
    real = spec_generate(target, real_d, ids, max_new_tokens=horizon)
    walk = teacher_forced_walk(target, walk_d, continuation[:n_in], continuation[n_in:], horizons=[horizon])[horizon]
    want = expected_accept_lengths(n_in, horizon, block_size, wrong)
    assert walk.accept_lengths == real.accept_lengths == want
    _assert_same_calls(walk_d.calls, real_d.calls)


@pytest.mark.parametrize("wrong", [set(), {11}])
def test_walk_stops_at_the_replys_stop_token(target, wrong):
    ids = prompt(6)
    n_in = ids.shape[1]
    free = greedy_generate(target, ids, 30).output_ids[0].tolist()
    stop = free[n_in + 5]
    reply = _greedy_reply(target, ids, 30, [stop])  # ends with the stop token
    assert reply[-1] == stop and len(reply) < 30
    real_d = ScriptedDrafter(make_drafter(8), free, wrong)
    walk_d = ScriptedDrafter(make_drafter(8), free, wrong)
    real = spec_generate(target, real_d, ids, max_new_tokens=30, stop_token_ids=[stop])
    # The walk gets the reply with whatever follows it in the data (a next turn): cut at the stop.
    walk = teacher_forced_walk(target, walk_d, ids[0].tolist(), reply + [1, 2, 3], horizons=[30], stop_token_ids=[stop])[30]
    assert walk.accept_lengths == real.accept_lengths and walk.complete
    assert walk.tokens == len(reply) == real.num_new_tokens
    _assert_same_calls(walk_d.calls, real_d.calls)


def test_a_truncated_reply_ends_the_walk_early_and_says_so(target):
    ids = prompt(2)
    reply = _greedy_reply(target, ids, 10)
    walk = teacher_forced_walk(target, make_drafter(4), ids[0].tolist(), reply, horizons=[25, 10])
    assert not walk[25].complete and walk[25].tokens == 10  # the data ends before the horizon
    assert walk[10].complete and walk[10].accept_lengths == spec_generate(
        target, make_drafter(4), ids, max_new_tokens=10).accept_lengths


def test_a_reply_that_is_not_the_targets_own_gives_another_walk(target):
    # The walk predicts real decoding only on the target's own replies: on a reference that differs
    # from the target's greedy continuation, a drafter that proposes that reference is "accepted" by
    # the walk but rejected by the target.
    ids = prompt(3)
    n_in = ids.shape[1]
    greedy = greedy_generate(target, ids, 16).output_ids[0].tolist()
    other = greedy[: n_in + 4] + [(t + 1) % MASK for t in greedy[n_in + 4 :]]
    walk = teacher_forced_walk(target, ScriptedDrafter(make_drafter(4), other), other[:n_in], other[n_in:], horizons=[16])
    real = spec_generate(target, ScriptedDrafter(make_drafter(4), other), ids, max_new_tokens=16)
    assert walk[16].accept_lengths == expected_accept_lengths(n_in, 16, 4, set())
    assert walk[16].accept_lengths != real.accept_lengths


def test_evaluate_walk_metrics(target):
    pairs = []
    for s in range(3):
        ids = prompt(s)
        cont = greedy_generate(target, ids, 16).output_ids[0].tolist()
        pairs.append((cont[: ids.shape[1]], cont[ids.shape[1] :]))
    drafter = make_drafter(4, seed=2)
    report = evaluate_walk(target, drafter, pairs, horizons=[16, 6])
    per = [teacher_forced_walk(target, drafter, p, r, horizons=[16, 6]) for p, r in pairs]
    assert report.name == "walk" and report.horizons == (16, 6) and report.max_new_tokens == 16
    for h in (16, 6):
        steps = sum(len(w[h].accept_lengths) for w in per)
        m = report.by_horizon[h]
        assert m["tau"] == pytest.approx(sum(sum(w[h].accept_lengths) for w in per) / steps)
        assert m["verify_steps"] == steps and m["tokens_walked"] == 3 * h
        assert m["complete_frac"] == 1.0
    assert report.metrics["tau"] == report.at(16) and report.num_conversations == 3
    assert 1.0 <= report.metrics["tau"] <= 4.0
    with pytest.raises(ValueError, match="no conversations"):
        evaluate_walk(target, drafter, [], horizons=[4])


def test_reply_until_stop():
    assert reply_until_stop([5, 6, 7, 6], [6]) == ([5, 6], True)
    assert reply_until_stop([5, 7], [6]) == ([5, 7], False)
    assert reply_until_stop([5, 7], None) == ([5, 7], False)


def test_walk_rejects_what_it_cannot_walk(target):
    d = make_drafter(4)
    with pytest.raises(ValueError, match="horizons"):
        teacher_forced_walk(target, d, [1, 2], [3], horizons=[])
    with pytest.raises(ValueError, match="non-empty"):
        teacher_forced_walk(target, d, [1, 2], [], horizons=[4])
    with pytest.raises(ValueError, match="block_size"):
        teacher_forced_walk(target, d, [1, 2], [3, 4], horizons=[4], block_size=1,
                            mask_token_id=MASK, target_layer_ids=LAYER_IDS)


def test_read_walk_conversations_locates_the_reply(tmp_path):
    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.embedded import embedded_target_path, load_tokenizer
    from dflash_flow.model.evaluation import read_prompt_ids, read_walk_conversations

    tok = load_tokenizer(embedded_target_path())
    stops = stop_token_ids(tok)
    path = tmp_path / "eval.jsonl"
    user = {"role": "user", "content": "List 3 months."}
    rows = [
        {"conversations": [user, {"role": "assistant", "content": "May, June, July."}], "finish_reason": "stop"},
        {"conversations": [user, {"role": "assistant", "content": "May, June, Ju"}], "finish_reason": "length"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (p1, r1), (p2, r2) = read_walk_conversations(path, tok, 10, stops)
    assert p1 == p2 == read_prompt_ids(path, tok, 1)[0]  # the prompt real decoding starts from
    assert r1[-1] in stops and tok.decode(r1[:-1]) == "May, June, July."
    assert not set(r2) & set(stops) and tok.decode(r2) == "May, June, Ju"  # the target never ended it
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [user]}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: the last turn must be the target's reply"):
        read_walk_conversations(bad, tok, 10, stops)


def _alone(target, drafter, prompt_ids, reply, h, stops=None):
    """The walk of one horizon by itself: a fresh proposer from the start (no fork)."""
    from dflash_flow.model.block_drafter import BlockDrafter, draft_settings
    from dflash_flow.model.walk import walk_features, walk_input

    settings = draft_settings(drafter)
    inp = walk_input(target, prompt_ids, reply, longest=h, layer_ids=settings.layer_ids, stop_token_ids=stops)
    proposer = BlockDrafter(target, drafter, settings)
    return walk_features(proposer, inp, h), proposer.calls


@pytest.mark.parametrize(("block_size", "wrong"), [(4, {10, 11, 17}), (8, {9, 13, 14, 20, 28}), (8, set())])
def test_horizons_walked_together_equal_each_walked_alone_with_fewer_drafter_calls(target, block_size, wrong):
    # The longest horizon is walked once; every shorter one forks from it where its first step differs
    # (its block shortened or its count capped near its end). Horizons at and around block boundaries,
    # one below the block size, one past the reply's end, a stop token inside the reply.
    ids = prompt(9)
    n_in = ids.shape[1]
    free = greedy_generate(target, ids, 40).output_ids[0].tolist()
    stop = free[n_in + 33]
    reply = _greedy_reply(target, ids, 40, [stop])
    horizons = [45, 33, 17, 16, 15, block_size + 1, block_size, block_size - 1, 2, 1]
    drafter = ScriptedDrafter(make_drafter(block_size, seed=3), free, wrong)
    report = evaluate_walk(target, drafter, [(ids[0].tolist(), reply)], horizons=horizons, stop_token_ids=[stop])
    together, calls = {}, 0
    for h in horizons:
        walk, n = _alone(target, drafter, ids[0].tolist(), reply, h, [stop])
        together[h] = walk
        calls += n
        m = report.by_horizon[h]
        assert m["verify_steps"] == len(walk.accept_lengths) and m["tokens_walked"] == walk.tokens, h
        assert m["tau"] == pytest.approx(walk.mean_accept_length or 1.0), h  # no block at horizon 1: 1.0
    walks = teacher_forced_walk(target, drafter, ids[0].tolist(), reply, horizons=horizons, stop_token_ids=[stop])
    for h in horizons:
        assert walks[h] == together[h], h
    # Every horizon alone drafts its shared blocks again; together they are drafted once.
    assert report.metrics["drafter_forwards"] < calls
    assert report.metrics["drafter_forwards"] >= _alone(target, drafter, ids[0].tolist(), reply, 45, [stop])[1]


def test_horizons_walked_together_equal_each_alone_for_a_dflash2_drafter(target):
    from dflash_flow.model.dflash2 import drafter_from_config, make_variant_config

    torch = pytest.importorskip("torch")
    config = make_variant_config(target.config, num_layers=2, block_size=8, mask_token_id=MASK,
                                 target_layer_ids=list(LAYER_IDS), variant="dflash2", selector_rank=8)
    torch.manual_seed(0)
    drafter = drafter_from_config(config).eval()
    with torch.no_grad():  # a selector and convolutions away from their start, so drafts vary
        for p in drafter.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = prompt(3)
    reply = _greedy_reply(target, ids, 40)
    horizons = [40, 24, 9, 8, 3]
    walks = teacher_forced_walk(target, drafter, ids[0].tolist(), reply, horizons=horizons)
    for h in horizons:
        assert walks[h] == _alone(target, drafter, ids[0].tolist(), reply, h)[0], h
