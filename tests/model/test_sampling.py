"""Sampled speculative decoding: the transform, losslessness in distribution, and z-lab's own loop.

* ``sampling_probs`` equals transformers' temperature / top-k / top-p warpers followed by softmax.
* Losslessness in distribution: on a real tiny Qwen3 target with a 4-token vocabulary and a real z-lab
  drafter (weights scaled up so its proposals are confident and often wrong), the first 3 new tokens of
  seeded speculative samples are compared with their exact distribution under the target's own
  sampling (enumerated: one batched forward over every 2-token prefix). The test is Pearson's
  chi-square goodness of fit (cells with expected count < 5 pooled into one), rejected at
  alpha = 1e-3: with a correct rule and fresh seeds it fails once in a thousand draws (asymptotically);
  the seeds here are fixed, so the outcome is deterministic. The same test with two deliberately wrong
  rules -- accepting every draft, and resampling from p instead of norm(max(0, p - q)) after a
  rejection -- must reject (p-values far below alpha with these samples), which shows it has the
  power to catch a wrong acceptance rule.
* z-lab's sampled ``dflash_generate`` draws from the global generator in a fixed order (prefill sample;
  per block: one multinomial over the drafts, the uniforms of the acceptance test, one multinomial for
  the bonus). Ours makes the same draws in the same order from a ``torch.Generator``, so seeding both
  identically must give identical outputs and acceptance lengths.
"""

from __future__ import annotations

import time

import dflash.model as zlab
import pytest
import torch
from test_speculative import make_drafter, prompt
from transformers import Qwen3Config

from dflash_flow.model import generation
from dflash_flow.model.evaluation import evaluate_drafter
from dflash_flow.model.generation import Sampling, sample_from, sampling_probs, spec_generate, verify_sampled
from dflash_flow.model.target import load_target

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]

ALPHA = 1e-3
SMALL_VOCAB = 4
NEW = 3  # tokens per sample: the prefill's, then one block of two drafts (and a second block if needed)
SAMPLES = 1500



# ----------------------------------------------------------------------------------------- transform


@pytest.mark.parametrize(("temperature", "top_p", "top_k"), [(1.0, 1.0, 0), (0.7, 1.0, 5), (1.3, 0.8, 0), (0.5, 0.6, 7)])
def test_sampling_probs_match_transformers_warpers(temperature, top_p, top_k):
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1)) * 3
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    want = scores.softmax(-1)
    got = sampling_probs(logits, Sampling(temperature, top_p, top_k))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert torch.equal(got > 0, want > 0)  # the same support, exactly


def test_sampling_settings_are_checked():
    assert Sampling().greedy and not Sampling(0.5).greedy
    for bad in ({"temperature": -1.0}, {"temperature": float("nan")}, {"temperature": 1.0, "top_p": 0.0},
                {"temperature": 1.0, "top_p": 1.5}, {"temperature": 1.0, "top_k": -1}):
        with pytest.raises(ValueError):
            Sampling(**bad)
    with pytest.raises(ValueError, match="temperature > 0"):
        sampling_probs(torch.zeros(3), Sampling())


def test_verify_sampled_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    # A draft the target gives at least the drafter's mass is always accepted; after all, p's next row.
    q = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0]])
    assert verify_sampled(torch.tensor([1, 0]), q, p, g) == (2, 2)
    # A draft the target never chooses is always rejected; the residual then excludes it.
    q = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    assert verify_sampled(torch.tensor([0, 0]), q, p, g) == (0, 1)
    # No drafts (a block of one): the next token comes from p's first row.
    assert verify_sampled(torch.tensor([], dtype=torch.long), p[:0], p, g) == (0, 1)


# ------------------------------------------------------------------------- losslessness in distribution


def _small_model_pair():
    target = load_target({"preset": "tiny-qwen3-8l", "vocab_size": SMALL_VOCAB, "num_hidden_layers": 2})
    config = Qwen3Config(vocab_size=SMALL_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    config.block_size = 4
    config.num_target_layers = 2
    config.dflash_config = {"mask_token_id": SMALL_VOCAB - 1, "target_layer_ids": [0, 1]}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        drafter = zlab.DFlashDraftModel(config).eval()
    with torch.no_grad():  # a peaked target and a confident, often wrong drafter
        for p in target.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return target, drafter


@pytest.fixture(scope="module")
def small():
    target, drafter = _small_model_pair()
    ids = torch.tensor([[1, 2, 3, 0, 1]])
    return target, drafter, ids


def _exact_distribution(target, ids, sampling) -> torch.Tensor:
    """P(first NEW=3 tokens) under the target's own sampling: one forward over every 2-token prefix."""
    v, n = SMALL_VOCAB, ids.shape[1]
    grid = torch.cartesian_prod(torch.arange(v), torch.arange(v))
    with torch.inference_mode():
        probs = sampling_probs(target(input_ids=torch.cat([ids.expand(v * v, -1), grid], 1)).logits, sampling).double()
    rows = torch.arange(v * v)
    joint = (probs[0, n - 1][grid[:, 0]] * probs[rows, n, grid[:, 1]])[:, None] * probs[:, n + 1]
    return joint.reshape(-1)


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = torch.tensor((obs.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))  # P(chi2_dof >= stat)


def _speculative_counts(target, drafter, ids, sampling) -> tuple[torch.Tensor, float]:
    counts = torch.zeros(SMALL_VOCAB**NEW, dtype=torch.float64)
    lengths = []
    for seed in range(SAMPLES):
        res = spec_generate(target, drafter, ids, max_new_tokens=NEW, sampling=sampling,
                            generator=torch.Generator().manual_seed(seed))
        a, b, c = res.new_ids
        counts[(a * SMALL_VOCAB + b) * SMALL_VOCAB + c] += 1
        lengths += res.accept_lengths
    return counts, sum(lengths) / len(lengths)


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.8, top_p=0.95, top_k=3)], ids=["T1", "T0.8-p0.95-k3"])
@pytest.mark.slow
def test_speculative_samples_follow_the_targets_own_distribution(small, sampling):
    target, drafter, ids = small
    counts, tau = _speculative_counts(target, drafter, ids, sampling)
    assert 1.2 < tau < 2.0  # drafts are both accepted and rejected: the rule is exercised
    assert _chi_square_p(counts, _exact_distribution(target, ids, sampling)) > ALPHA


def _accept_every_draft(drafts, draft_probs, target_probs, generator):
    g = drafts.numel()
    return g, int(sample_from(target_probs[g : g + 1], generator)[0])


def _resample_from_p(drafts, draft_probs, target_probs, generator):
    accepted, nxt = verify_sampled(drafts, draft_probs, target_probs, generator)
    if accepted < drafts.numel():
        nxt = int(sample_from(target_probs[accepted : accepted + 1], generator)[0])
    return accepted, nxt


@pytest.mark.slow
@pytest.mark.parametrize("wrong_rule", [_accept_every_draft, _resample_from_p])
def test_the_distribution_test_catches_a_wrong_acceptance_rule(small, monkeypatch, wrong_rule):
    target, drafter, ids = small
    sampling = Sampling(1.0)
    monkeypatch.setattr(generation, "verify_sampled", wrong_rule)
    counts, _ = _speculative_counts(target, drafter, ids, sampling)
    assert _chi_square_p(counts, _exact_distribution(target, ids, sampling)) < ALPHA


# ------------------------------------------------------------------------------------ against z-lab


@pytest.fixture(scope="module")
def target():
    return load_target("tiny-qwen3-8l")


def _zlab(drafter, target, ids, new, sampling, seed, stop_token_ids=None):
    original = zlab._cuda_time
    zlab._cuda_time = time.perf_counter  # return_stats times with cuda.synchronize; the loop is untouched
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return zlab.dflash_generate(drafter, target, ids, new, stop_token_ids, temperature=sampling.temperature,
                                        top_p=sampling.top_p, top_k=sampling.top_k, return_stats=True)
    finally:
        zlab._cuda_time = original


@pytest.mark.parametrize("sampling", [Sampling(1.0), Sampling(0.7, top_p=0.9, top_k=20), Sampling(1.5, top_k=40)])
@pytest.mark.parametrize("block_size", [4, 8])
def test_same_seed_same_output_as_zlab_sampled_dflash_generate(target, sampling, block_size):
    drafter = make_drafter(block_size, seed=1)
    multi_token_steps = 0
    for seed in range(6):
        ids = prompt(seed)
        ref = _zlab(drafter, target, ids, 24, sampling, seed)
        ours = spec_generate(target, drafter, ids, max_new_tokens=24, sampling=sampling,
                             generator=torch.Generator().manual_seed(seed))
        assert ours.output_ids.tolist() == ref.output_ids.tolist(), seed
        assert ours.accept_lengths == ref.acceptance_lengths, seed
        multi_token_steps += sum(a > 1 for a in ours.accept_lengths)
    assert multi_token_steps > 0  # accepted drafts were part of what matched


def test_same_seed_as_zlab_with_a_stop_token(target):
    drafter = make_drafter(4, seed=2)
    ids = prompt(3)
    free = spec_generate(target, drafter, ids, max_new_tokens=30, sampling=Sampling(1.0),
                         generator=torch.Generator().manual_seed(9)).new_ids
    stop = free[7]
    ours = spec_generate(target, drafter, ids, max_new_tokens=30, sampling=Sampling(1.0), stop_token_ids=[stop],
                         generator=torch.Generator().manual_seed(9))
    ref = _zlab(drafter, target, ids, 30, Sampling(1.0), 9, [stop])
    assert ours.output_ids.tolist() == ref.output_ids.tolist()
    assert ours.new_ids[-1] == stop and ours.new_ids == free[: free.index(stop) + 1]


# --------------------------------------------------------------------------------------- evaluation


def test_sampled_evaluation_is_seeded_and_reports_its_settings(target):
    drafter = make_drafter(4, seed=3)
    prompts = [prompt(s)[0].tolist() for s in range(3)]
    s = Sampling(1.0, top_p=0.9)
    a = evaluate_drafter(target, drafter, prompts, max_new_tokens=12, sampling=s, seed=5)
    b = evaluate_drafter(target, drafter, prompts, max_new_tokens=12, sampling=s, seed=5)
    c = evaluate_drafter(target, drafter, prompts, max_new_tokens=12, sampling=s, seed=6)
    timing = {"spec_s"}
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert (a["tau"], a["verify_steps"]) != (c["tau"], c["verify_steps"])
    assert a["temperature"] == 1.0 and a["top_p"] == 0.9 and a["top_k"] == 0.0
    assert "lossless" not in a  # a sampled output has no single reference to compare with
    assert a["tokens_generated"] == 36 and a["speedup_forwards"] == pytest.approx(36 / a["target_forwards_spec"])
    greedy = evaluate_drafter(target, drafter, prompts, max_new_tokens=12)
    assert greedy["lossless"] == 1.0 and "temperature" not in greedy
