"""Batched evaluation (``model.batched``) against one prompt at a time: the same outputs, acceptance lengths,
forward counts, traces and walks, per prompt, for a drafter trained until it accepts several tokens a step.

The drafter is trained here for a few seconds on a tiny random target's own greedy continuations (as
``test_drafter_convergence``), so steps commit different numbers of tokens per row and the rows' caches and
contexts become ragged; a DFlash 2 drafter with the same weights and a perturbed selector exercises the
selector's walk. Prompts have different lengths, and a stop token ends some of them early.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from model_testlib import MASK_ID, VOCAB, build_drafter, build_target, target_features

from dflash_flow.model import batched
from dflash_flow.model.block_drafter import BlockDrafter, draft_settings
from dflash_flow.model.dflash2 import drafter_from_config, make_variant_config
from dflash_flow.model.evaluation import evaluate_drafter
from dflash_flow.model.generation import Sampling, greedy_generate, spec_generate
from dflash_flow.model.objective import dflash_loss
from dflash_flow.model.optim import build_optimizer
from dflash_flow.model.walk import WalkResult, _walk_horizons, evaluate_walk, walk_batch, walk_input

# The trained drafter takes ~10 s to train (one thread, quiet box): the tests that use it are slow; the fast set
# keeps one check with an untrained drafter (acceptance about 1: every row's context one token a step).
pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT, NEW, BLOCK = 6, 40, 8


def _continuations(target, n: int, seed: int, prompt: int = PROMPT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 1, (n, prompt), generator=g)
    with torch.no_grad():
        return target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)


@pytest.fixture(scope="module")
def models():
    """The target, a DFlash drafter trained on its continuations, and a DFlash 2 drafter of the same
    weights with a selector that re-ranks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = build_target(seed=0, initializer_range=0.05)
        with torch.no_grad():
            target.lm_head.weight.mul_(8.0)  # a confident target (test_drafter_convergence's reason)
        data = _continuations(target, 256, seed=1)
        mask = torch.zeros_like(data)
        mask[:, PROMPT:] = 1
        drafter = build_drafter(target, seed=3, num_layers=2, block_size=BLOCK)
        feats = target_features(target, data, drafter.target_layer_ids)
        common = dict(embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head, block_size=BLOCK,
                      mask_token_id=MASK_ID, gamma=4.0)
        steps = 160
        opt, sched = build_optimizer(drafter, total_steps=steps, lr=3e-3)
        gen = torch.Generator().manual_seed(4)
        for _ in range(steps):
            rows = torch.randint(0, data.shape[0], (8,), generator=gen)
            out = dflash_loss(drafter, input_ids=data[rows], loss_mask=mask[rows], hidden_states=feats[rows],
                              num_anchors=16, generator=gen, chunk_blocks=8, **common)
            out.loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
        drafter.eval()
        config = make_variant_config(target.config, variant="dflash2", num_layers=2, block_size=BLOCK,
                                     mask_token_id=MASK_ID, selector_rank=8)
        two = drafter_from_config(config)
        two.load_state_dict(drafter.state_dict(), strict=False)
        with torch.no_grad():  # a selector that changes some picks, convolutions that mix the slots
            g = torch.Generator().manual_seed(5)
            two.candidate_selector.successor_codebook.copy_(torch.randn(two.candidate_selector.successor_codebook.shape, generator=g))
            for layer in two.layers:
                for conv in (layer.attention_conv, layer.mlp_conv):
                    conv.kernel_projection.weight.copy_(0.02 * torch.randn(conv.kernel_projection.weight.shape, generator=g))
        return target, {"dflash": drafter, "dflash2": two.eval()}
    finally:
        torch.set_num_threads(threads)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(1, VOCAB - 1, (n,), generator=g).tolist() for n in (6, 2, 17, 9, 30, 5, 12)]


def _stop_for(target, prompts) -> int:
    """A token some prompts' greedy continuations reach early (those stop), others not within NEW."""
    conts = [greedy_generate(target, p, NEW).new_ids for p in prompts]
    counts: dict[int, int] = {}
    for c in conts:
        for t in set(c[3:12]):
            counts[t] = counts.get(t, 0) + 1
    return min(counts, key=lambda t: abs(counts[t] - len(prompts) / 2))


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_speculative_decoding_equals_one_prompt_at_a_time(models, variant, temperature):
    target, drafters = models
    drafter = drafters[variant]
    assert batched.batchable(target, drafter)
    prompts = _prompts()
    stop = _stop_for(target, prompts)
    sampling = Sampling(temperature)
    single, traces1, acc1 = [], [], []
    for i, p in enumerate(prompts):
        trace, acc = [], []
        gen = None if sampling.greedy else torch.Generator().manual_seed(100 + i)
        single.append(spec_generate(target, drafter, p, max_new_tokens=NEW, stop_token_ids=[stop], sampling=sampling,
                                    generator=gen, trace=trace, accepted_drafts=acc))
        traces1.append(trace)
        acc1.append(acc)
    traces2, acc2 = [[] for _ in prompts], [[] for _ in prompts]
    gens = None if sampling.greedy else [torch.Generator().manual_seed(100 + i) for i in range(len(prompts))]
    both = batched.spec_generate_batch(target, drafter, prompts, max_new_tokens=NEW, stop_token_ids=[stop],
                                       sampling=sampling, generators=gens, traces=traces2, accepted_drafts=acc2,
                                       batch_size=4)  # two batches, the second smaller
    # The drafter accepts several tokens a step (ragged rows); some prompts stop early, others run to NEW.
    steps = sum(len(r.accept_lengths) for r in single)
    assert sum(sum(r.accept_lengths) for r in single) / steps > (1.8 if sampling.greedy else 1.2)
    ends = [r.num_new_tokens for r in single]
    assert min(ends) < NEW and max(ends) == NEW
    for i, (a, b) in enumerate(zip(single, both, strict=True)):
        assert b.output_ids.tolist() == a.output_ids.tolist(), i
        assert b.accept_lengths == a.accept_lengths, i
        assert (b.target_forwards, b.drafter_forwards, b.num_input_tokens) == (
            a.target_forwards, a.drafter_forwards, a.num_input_tokens), i
    assert traces2 == traces1 and acc2 == acc1
    if sampling.greedy:  # lossless, as the one-prompt loop
        for p, r in zip(prompts, both, strict=True):
            assert r.new_ids == greedy_generate(target, p, NEW, [stop]).new_ids


@pytest.mark.slow
def test_batched_greedy_reference_equals_greedy_generate(models):
    target, _ = models
    prompts = _prompts()
    stop = _stop_for(target, prompts)
    got = batched.greedy_generate_batch(target, prompts, NEW, [stop], batch_size=5)
    for p, r in zip(prompts, got, strict=True):
        ref = greedy_generate(target, p, NEW, [stop])
        assert r.output_ids.tolist() == ref.output_ids.tolist()
        assert (r.accept_lengths, r.target_forwards) == (ref.accept_lengths, ref.target_forwards)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_batched_walk_equals_each_conversation_walked_alone(models, variant):
    target, drafters = models
    drafter = drafters[variant]
    settings = draft_settings(drafter)
    data = _continuations(target, 6, seed=9, prompt=7)
    stop = int(data[2, 7 + 10])  # conversation 2's reply stops at its 11th token (others may too)
    horizons = [12, 40, 25]
    inputs = [walk_input(target, row[:7].tolist(), row[7:].tolist(), longest=max(horizons),
                         layer_ids=settings.layer_ids, stop_token_ids=[stop]) for row in data]
    with torch.inference_mode():
        alone = [_walk_horizons(BlockDrafter(target, drafter, settings), inp, horizons) for inp in inputs]
    together = walk_batch(target, drafter, inputs, horizons, settings)
    assert [({h: WalkResult(*r) for h, r in res.items()}, calls) for res, calls in together] == alone
    taus = [r.mean_accept_length for res, _ in alone for r in res.values()]
    assert max(taus) > 2.0  # several tokens per block: ragged rows


@pytest.mark.slow
def test_evaluation_figures_do_not_depend_on_the_batch(models):
    target, drafters = models
    prompts = _prompts()
    stop = _stop_for(target, prompts)
    wall = ("greedy_s", "spec_s", "speedup_wall")
    for sampling in (Sampling(), Sampling(1.0, 0.9, 20)):
        one = evaluate_drafter(target, drafters["dflash2"], prompts, max_new_tokens=NEW, stop_token_ids=[stop],
                               sampling=sampling, seed=3, batch_size=1)
        many = evaluate_drafter(target, drafters["dflash2"], prompts, max_new_tokens=NEW, stop_token_ids=[stop],
                                sampling=sampling, seed=3, batch_size=3)
        assert {k: v for k, v in many.items() if k not in wall} == {k: v for k, v in one.items() if k not in wall}
        if sampling.greedy:
            assert many["lossless"] == 1.0
    data = _continuations(target, 5, seed=12)
    convs = [(row[:PROMPT].tolist(), row[PROMPT:].tolist()) for row in data]
    a = evaluate_walk(target, drafters["dflash"], convs, horizons=[20, 40], stop_token_ids=[stop], batch_size=1)
    b = evaluate_walk(target, drafters["dflash"], convs, horizons=[20, 40], stop_token_ids=[stop], batch_size=4)
    assert attrs.asdict(a) == attrs.asdict(b)  # EvalReport compares by identity


@pytest.mark.slow
def test_models_that_do_not_batch_are_decoded_one_at_a_time(models):
    target, drafters = models
    eager = build_target(seed=0, initializer_range=0.05)
    eager.config._attn_implementation = "eager"
    assert not batched.batchable(eager, drafters["dflash"])
    prompts = _prompts()[:3]
    one = evaluate_drafter(eager, drafters["dflash"], prompts, max_new_tokens=10, batch_size=1)
    many = evaluate_drafter(eager, drafters["dflash"], prompts, max_new_tokens=10, batch_size=8)
    assert many["tau"] == one["tau"] and many["lossless"] == 1.0


def test_an_untrained_drafter_decodes_the_same_batched():
    """Fast: an untrained DFlash 2 drafter (random, scaled) on the tiny target, greedy and sampled, prompts of
    different lengths; batched output, acceptance and counts equal the one-prompt loop's."""
    from model_testlib import randomize

    target = build_target(seed=0)
    config = make_variant_config(target.config, variant="dflash2", num_layers=1, block_size=4, mask_token_id=MASK_ID,
                                 selector_rank=8)
    drafter = randomize(drafter_from_config(config), seed=2, scale=0.3).eval()
    prompts = _prompts()[:4]
    for sampling in (Sampling(), Sampling(1.0)):
        gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
        alone = [spec_generate(target, drafter, p, max_new_tokens=12, sampling=sampling,
                               generator=None if sampling.greedy else torch.Generator().manual_seed(i))
                 for i, p in enumerate(prompts)]
        together = batched.spec_generate_batch(target, drafter, prompts, max_new_tokens=12, sampling=sampling,
                                               generators=None if sampling.greedy else gens)
        assert [r.output_ids.tolist() for r in together] == [r.output_ids.tolist() for r in alone]
        assert [r.accept_lengths for r in together] == [r.accept_lengths for r in alone]
    refs = batched.greedy_generate_batch(target, prompts, 12)
    assert [r.new_ids for r in refs] == [greedy_generate(target, p, 12).new_ids for p in prompts]
