"""The interop check's bookkeeping (``interop/accounting.py``): an engine's verify steps rebuilt from its
output and its drafts, counted as our decoding counts them; vLLM's own count; drafts compared step by
step. The equivalence with our decoding's own steps is in tests/model/test_speculative.py."""

from __future__ import annotations

import pytest
from interoptools import load_interop

acc = load_interop("accounting")
PROMPT = [7, 8]


def test_replay_counts_accepted_drafts_and_bonus_and_drops_a_proposal_after_the_end():
    # output 3 4 5 6 7; step 0 opens at 3 (position 2): drafts 4 5 X -> 2 accepted + bonus 6;
    # step 1 opens at 6 (position 5): draft 7 accepted, capped at the output's end; then one more proposal
    # for the finished request, which is no step.
    tokens = PROMPT + [3, 4, 5, 6, 7]
    steps = acc.replay(tokens, 2, [[4, 5, 9], [7, 1, 1], [0, 0, 0]])
    assert steps == [acc.Step(2, (4, 5, 9), 3), acc.Step(5, (7, 1, 1), 1)]
    assert acc.tau(steps) == 2.0


def test_drafts_accepted_past_the_output_end_count_for_vllm_not_our_way():
    # max_tokens 3: vLLM accepted 4 and 5 and would count 2 accepted of 3 drafted (1 + 2/1 = 3.0); our way
    # the step commits only the 2 tokens the output has after position 2.
    steps = acc.replay(PROMPT + [3, 4, 5], 2, [[4, 5, 6]])
    assert steps == [acc.Step(2, (4, 5, 6), 2)]
    assert acc.tau(steps) == 2.0
    assert acc.engine_tau({"num_drafts": 1, "num_accepted_tokens": 2}) == 3.0
    assert acc.engine_tau({}) == 1.0 and acc.tau([]) == 1.0


def test_a_reply_of_one_token_has_no_steps():
    assert acc.replay(PROMPT + [3], 2, [[4, 4]]) == []
    with pytest.raises(ValueError, match="does not fit"):
        acc.replay(PROMPT, 3, [])


def test_compare_drafts_names_the_first_difference():
    theirs = acc.replay(PROMPT + [3, 4, 5, 6, 7, 8, 9, 10], 2, [[4, 9], [6, 7], [9, 0]])
    assert [(s.start, s.committed) for s in theirs] == [(2, 2), (4, 3), (7, 2)]
    same = [(2, [4, 9]), (4, [6, 7]), (7, [9, 0])]
    assert acc.compare_drafts(same, theirs) == {"steps": 3, "equal": 3, "first_difference": None}
    other = [(2, [4, 9]), (4, [6, 1]), (7, [9, 0])]
    got = acc.compare_drafts(other, theirs)
    assert got["equal"] == 2
    assert got["first_difference"] == {"step": 1, "start": 4, "engine": [6, 7], "ours": {"start": 4, "drafts": [6, 1]}}
    short = acc.compare_drafts(same[:1], theirs)
    assert short["equal"] == 1 and short["first_difference"]["ours"] is None


def test_compare_outputs():
    assert acc.compare_outputs([[1, 2], [3]], [[1, 2], [4]]) == [1]
    assert acc.compare_outputs([[1]], [[1], [2]]) == [0, 1]
