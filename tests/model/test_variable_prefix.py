"""The variable-prefix objective (D2SD VP-Drafter, NeMo AutoModel's ``loss_type: variable_prefix``).

Each block draws a visible prefix length l from a truncated geometric prior, real tokens fill slots
0..l-1, only slots k >= l are supervised, weighted exp(-(k-l)/gamma). Checked here: l = 1 is the DFlash
objective; the fast path equals a per-block reference through the inference entry point; chunking and the
activation budget change nothing; the prior; determinism; validation; and a pipeline run whose export
z-lab decodes losslessly.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from model_testlib import MASK_ID, VOCAB, build_drafter, drafter_stage_problems, randomize, target_features

from dflash_flow.model.blockplan import prefix_decay_weights, sample_anchors
from dflash_flow.model.layout import activation_bytes_per_block
from dflash_flow.model.objective import PrefixPrior, dflash_loss, plan_blocks, sample_prefix_lengths
from dflash_flow.model.strategies import VariablePrefix
from dflash_flow.model.trainer import DFlashObjective, TrainerConfig

REPO = Path(__file__).resolve().parents[2]
GAMMA = 4.0


def make_batch(b=3, s=28, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 1, (b, s), generator=g)
    lm = torch.ones(b, s, dtype=torch.long)
    lm[:, :4] = 0  # a "prompt"
    am = torch.ones(b, s, dtype=torch.long)
    if b > 1:
        am[1, s - 7 :] = 0  # a ragged row: right padding
        lm[1, s - 7 :] = 0
    if b > 2:
        lm[2, 10:14] = 0  # a turn boundary inside row 2
    return ids, lm, am


def modules(target):
    return dict(embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head)


def sliding_drafter(target, seed=17, block_size=8):
    return randomize(
        build_drafter(
            target,
            num_layers=2,
            block_size=block_size,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=6,
        ),
        seed,
    )


# ------------------------------------------------------------------------------------------ l = 1


def test_prefix_length_one_is_the_dflash_objective(target):
    drafter = sliding_drafter(target)
    ids, lm, am = make_batch()
    feats = target_features(target, ids, drafter.target_layer_ids, attention_mask=am)
    kw = dict(input_ids=ids, loss_mask=lm, hidden_states=feats, attention_mask=am, gamma=GAMMA, num_anchors=12)
    results = []
    for prior in (None, PrefixPrior(min_length=1, max_length=1)):
        drafter.zero_grad()
        out = dflash_loss(drafter, generator=torch.Generator().manual_seed(5), prefix_prior=prior, **kw, **modules(target))
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in drafter.parameters()]))
    (d, gd), (v, gv) = results
    # The same anchors (prefix lengths are drawn after them), the same plan, the same loss bit for bit.
    # The fast path factors the first layer's mask-token rows under dflash only (SlotRows), so the
    # gradients of the first layer sum the shared row in another order: equal to float rounding.
    anchors = sample_anchors(lm, 12, attention_mask=am, generator=torch.Generator().manual_seed(5))
    pd = plan_blocks(ids, lm, *anchors, block_size=8, mask_token_id=MASK_ID, gamma=GAMMA, attention_mask=am)
    pv = plan_blocks(
        ids, lm, *anchors, block_size=8, mask_token_id=MASK_ID, gamma=GAMMA, attention_mask=am,
        prefix_lengths=torch.ones_like(anchors[0]),
    )
    for name in ("block_ids", "labels", "supervised", "weights", "block_positions"):
        assert torch.equal(getattr(pd, name), getattr(pv, name)), name
    assert v.loss.item() == d.loss.item()
    for a, b in zip(gv, gd, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert torch.equal(v.correct_per_position, d.correct_per_position)
    assert torch.equal(v.supervised_per_position, d.supervised_per_position)
    assert v.acceptance_sum.item() == d.acceptance_sum.item() and v.kept_blocks.item() == d.kept_blocks.item()
    assert set(v.extra) == set(VariablePrefix.metric_names)  # what the loss reports is what the objective declares
    m = v.metrics()
    assert m["prefix_length"] == 1.0
    assert m["sim_accept_len_prefix1"] == pytest.approx(d.metrics()["acceptance_length"])  # every block has l = 1
    assert "prefix_length" not in d.metrics()


# ------------------------------------------------------------------------------------------ reference


def naive_reference(drafter, target, ids, lm, am, feats, anchors, keep, lengths, gamma):
    """Per block, dense: the block ``[x_a..x_{a+l-1}, MASK...]`` through the drafter's inference entry point
    (z-lab's layout: context = features of positions < a, no mask) and the loss written from the definition."""
    emb, head = target.get_input_embeddings(), target.lm_head
    b, s = ids.shape
    bsz = drafter.block_size
    num = torch.zeros(())
    den = 0.0
    correct = torch.zeros(bsz)
    supervised = torch.zeros(bsz)
    accept, accept1, n1, prefix_sum, kept = 0.0, 0.0, 0, 0, 0
    for r in range(b):
        for n in range(anchors.shape[1]):
            if not keep[r, n]:
                continue
            a, pl = int(anchors[r, n]), int(lengths[r, n])
            kept += 1
            prefix_sum += pl
            block = []
            for k in range(bsz):
                real = k < pl and a + k < s and bool(am[r, a + k])
                block.append(int(ids[r, a + k]) if real else MASK_ID)
            h = drafter(
                position_ids=torch.arange(a + bsz)[None],
                noise_embedding=emb(torch.tensor([block])),
                target_hidden=feats[r : r + 1, :a],
            )
            logits = head(h)[0].float()
            run, alive = 0, True
            for k in range(pl, bsz):
                p = a + k
                if not (p < s and lm[r, p] and am[r, p]):
                    alive = False
                    continue
                w = math.exp(-(k - pl) / gamma)
                num = num + w * F.cross_entropy(logits[k][None], ids[r, p][None])
                den += w
                hit = int(logits[k].argmax()) == int(ids[r, p])
                supervised[k] += 1
                correct[k] += hit
                alive = alive and hit
                run += alive
            accept += 1 + run
            if pl == 1:
                accept1 += 1 + run
                n1 += 1
    return num / den, dict(
        correct=correct, supervised=supervised, accept=accept / kept, accept1=accept1 / n1 if n1 else 0.0,
        prefix=prefix_sum / kept,
    )


@pytest.mark.parametrize("chunk,group", [(None, None), (3, 1)])
def test_loss_equals_naive_per_block_reference(target, chunk, group):
    drafter = sliding_drafter(target, seed=23)
    ids, lm, am = make_batch(seed=1)
    feats = target_features(target, ids, drafter.target_layer_ids, attention_mask=am)
    anchors, keep = sample_anchors(lm, 20, attention_mask=am, generator=torch.Generator().manual_seed(2))
    assert (~keep).any()  # padding blocks in the short rows
    # Uniform prior over 1..B-1: every length, prefixes running into the padding and past the turn boundary.
    lengths = sample_prefix_lengths(
        keep.shape, PrefixPrior(weight_base=1.0), block_size=8, generator=torch.Generator().manual_seed(3)
    )
    assert set(lengths[keep].tolist()) >= {1, 7}
    ref, stats = naive_reference(drafter, target, ids, lm, am, feats, anchors, keep, lengths, GAMMA)
    ref_grads = torch.autograd.grad(ref, list(drafter.parameters()))
    out = dflash_loss(
        drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, attention_mask=am, gamma=GAMMA,
        anchors=(anchors, keep), prefix_lengths=lengths, chunk_blocks=chunk, group_blocks=group, **modules(target),
    )
    grads = torch.autograd.grad(out.loss, list(drafter.parameters()))
    torch.testing.assert_close(out.loss, ref, atol=1e-5, rtol=1e-5)
    for (name, _), g, r in zip(drafter.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4, msg=name)
    assert torch.equal(out.supervised_per_position, stats["supervised"])
    assert torch.equal(out.correct_per_position, stats["correct"])
    m = out.metrics()
    assert m["acceptance_length"] == pytest.approx(stats["accept"])
    assert m["sim_accept_len_prefix1"] == pytest.approx(stats["accept1"])
    assert m["prefix_length"] == pytest.approx(stats["prefix"])


def test_only_the_masked_suffix_is_supervised():
    ids = torch.arange(1, 13)[None]  # tokens 1..12
    lm = torch.ones_like(ids)
    lm[0, 9] = 0  # one unsupervised position inside a block's suffix
    am = torch.ones_like(ids)
    am[0, 11] = 0  # padding at the end
    anchors = torch.tensor([[2, 6, 0]])
    keep = torch.tensor([[True, True, False]])
    lengths = torch.tensor([[3, 5, 2]])
    plan = plan_blocks(
        ids, lm, anchors, keep, block_size=6, mask_token_id=MASK_ID, gamma=GAMMA, attention_mask=am,
        prefix_lengths=lengths,
    )
    m = MASK_ID
    # Block at 2, l = 3: tokens 3, 4, 5 shown; block at 6, l = 5: positions 6..10 shown; padding: all MASK.
    assert plan.block_ids[0].tolist() == [[3, 4, 5, m, m, m], [7, 8, 9, 10, 11, m], [m] * 6]
    assert plan.supervised[0].tolist() == [
        [False, False, False, True, True, True],
        [False] * 5 + [False],  # slot 5 is position 11: padding
        [False] * 6,
    ]
    want = [0, 0, 0, 1, math.exp(-1 / GAMMA), math.exp(-2 / GAMMA)]
    torch.testing.assert_close(plan.weights[0, 0], torch.tensor(want))
    assert plan.weights[0, 1:].sum() == 0
    # A position of the suffix outside the loss mask stays masked and unsupervised, the decay keeps its origin.
    plan = plan_blocks(ids, lm, torch.tensor([[5]]), torch.tensor([[True]]), block_size=6, mask_token_id=m,
                       gamma=GAMMA, prefix_lengths=torch.tensor([[2]]))
    assert plan.block_ids[0, 0].tolist() == [6, 7, m, m, m, m]
    assert plan.supervised[0, 0].tolist() == [False, False, True, True, False, True]
    torch.testing.assert_close(plan.weights[0, 0, 5], torch.tensor(math.exp(-3 / GAMMA)))
    # l = 1 weights are DFlash's decay weights bit for bit; no decay without gamma.
    w1 = prefix_decay_weights(torch.ones(1, 1, dtype=torch.long), 8, 7.0)[0, 0]
    from dflash_flow.model.blockplan import decay_weights

    assert torch.equal(w1, decay_weights(8, 7.0))
    assert prefix_decay_weights(torch.tensor([[3]]), 5, None)[0, 0].tolist() == [0, 0, 0, 1, 1]


# ------------------------------------------------------------------------------------------ chunking


def test_chunked_equals_unchunked_and_activation_budget(target):
    drafter = sliding_drafter(target, seed=29)
    ids, lm, am = make_batch(b=2, s=32, seed=4)
    feats = target_features(target, ids, drafter.target_layer_ids, attention_mask=am)
    per_block = activation_bytes_per_block(drafter, vocab_size=VOCAB, context_len=32)
    tight = 2 * per_block * 3 / 2**20  # three blocks of two rows per chunk
    kw = dict(input_ids=ids, loss_mask=lm, hidden_states=feats, attention_mask=am, gamma=GAMMA, num_anchors=16,
              prefix_prior=PrefixPrior(weight_base=0.8), **modules(target))
    results = []
    for chunk, budget in ((None, None), (3, None), (5, None), (None, tight)):
        drafter.zero_grad()
        out = dflash_loss(drafter, generator=torch.Generator().manual_seed(9), chunk_blocks=chunk,
                          activation_budget_mb=budget, **kw)
        out.loss.backward()
        results.append((out, [p.grad.clone() for p in drafter.parameters()]))
    base, grads = results[0]
    assert base.metrics()["num_tokens"] > 0
    for out, g in results[1:]:
        torch.testing.assert_close(out.loss, base.loss, atol=1e-6, rtol=1e-6)
        for a, b in zip(g, grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
        assert out.metrics() == pytest.approx(base.metrics())


# ------------------------------------------------------------------------------------------ the prior


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    stat = ((counts - expected) ** 2 / expected).sum()
    dof = torch.tensor((counts.numel() - 1) / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(dof, stat / 2))  # P(chi2 >= stat)


@pytest.mark.parametrize(
    "prior,block",
    [
        (PrefixPrior(), 8),  # the default: base 0.9 on 1..B-1
        (PrefixPrior(weight_base=0.6, min_length=2, max_length=6), 8),  # NeMo's lower end, truncated above
        (PrefixPrior(weight_base=1.3), 16),  # a base above 1 favours long prefixes
    ],
)
def test_prefix_lengths_follow_the_truncated_geometric_prior(prior, block):
    lo, hi = prior.bounds(block)
    support = torch.arange(lo, hi + 1, dtype=torch.float64)
    probs = prior.weight_base**support
    probs = probs / probs.sum()
    torch.testing.assert_close(prior.probabilities(block), probs)
    draws = sample_prefix_lengths((40, 500), prior, block_size=block, generator=torch.Generator().manual_seed(0))
    assert draws.dtype == torch.long and draws.shape == (40, 500)
    assert int(draws.min()) >= lo and int(draws.max()) <= hi
    counts = torch.bincount(draws.flatten() - lo, minlength=hi - lo + 1).double()
    assert counts.numel() == hi - lo + 1 and (counts > 0).all()  # every length of the support occurs
    # Chi-square goodness of fit, 20,000 draws, false-alarm rate 1e-3 (the seed is fixed, so the outcome
    # is deterministic). The test has power: a base 10% off is rejected.
    assert _chi_square_p(counts, probs) > 1e-3
    other = (prior.weight_base * 0.9) ** support
    assert _chi_square_p(counts, other / other.sum()) < 1e-3


def test_prefix_draws_are_deterministic_for_a_seed(target):
    prior = PrefixPrior(weight_base=0.7)

    def draw(seed):
        return sample_prefix_lengths((4, 64), prior, block_size=8, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(3), draw(3)) and not torch.equal(draw(3), draw(4))
    # Inside the loss: the same seed gives the same anchors, lengths and loss; another seed does not.
    drafter = randomize(build_drafter(target, num_layers=1), 31)
    ids, lm, am = make_batch(seed=5)
    feats = target_features(target, ids, drafter.target_layer_ids, attention_mask=am)
    kw = dict(input_ids=ids, loss_mask=lm, hidden_states=feats, attention_mask=am, num_anchors=9,
              prefix_prior=prior, **modules(target))
    with torch.no_grad():
        a = dflash_loss(drafter, generator=torch.Generator().manual_seed(7), **kw).metrics()
        b = dflash_loss(drafter, generator=torch.Generator().manual_seed(7), **kw).metrics()
        c = dflash_loss(drafter, generator=torch.Generator().manual_seed(8), **kw).metrics()
    assert a == b and a != c
    # The lengths the loss used are the ones drawn right after the anchors from the same generator.
    g = torch.Generator().manual_seed(7)
    anchors, keep = sample_anchors(lm, 9, attention_mask=am, generator=g)
    lengths = sample_prefix_lengths(keep.shape, prior, block_size=8, generator=g)
    with torch.no_grad():
        given = dflash_loss(drafter, anchors=(anchors, keep), prefix_lengths=lengths,
                            **{k: v for k, v in kw.items() if k != "prefix_prior"}).metrics()
    assert given == a
    assert a["prefix_length"] == pytest.approx(float(lengths[keep].double().mean()))


# ------------------------------------------------------------------------------------------ validation


def test_bad_prior_settings_name_the_field(target):
    base = {"objective": "variable_prefix"}
    for bad, field in (
        ({"prefix_weight_base": 0.0}, "prefix_weight_base"),
        ({"prefix_weight_base": float("nan")}, "prefix_weight_base"),
        ({"prefix_min_length": 0}, "prefix_min_length"),
        ({"prefix_min_length": 8}, "prefix_min_length"),
        ({"prefix_max_length": 8}, "prefix_max_length"),
        ({"prefix_min_length": 4, "prefix_max_length": 3}, "prefix_max_length"),
        ({"objective": "vp"}, "objective"),
    ):
        _, problems = drafter_stage_problems({**base, **bad}, block_size=8)
        assert len(problems) == 1, (bad, problems)
        got_field, message = problems[0]
        assert got_field == field or field in message, (bad, problems)
    obj, problems = drafter_stage_problems({**base, "prefix_min_length": 2, "prefix_max_length": 7}, block_size=8)
    assert problems == [] and obj.objective == "variable_prefix"
    # The trainer's own config (Python API) fails when the objective is built, naming the field.
    drafter = build_drafter(target, num_layers=1, block_size=8)
    head = type("Head", (), modules(target))()
    for kw, field in (({"prefix_weight_base": -1.0}, "prefix_weight_base"), ({"prefix_max_length": 9}, "prefix_max_length")):
        with pytest.raises(ValueError, match=field):
            DFlashObjective(drafter, head, gamma=4.0, config=TrainerConfig(objective=VariablePrefix(**kw)))
    DFlashObjective(drafter, head, gamma=4.0, config=TrainerConfig(objective="dflash"))  # dflash: no prefix knobs
    with pytest.raises(ValueError, match="objective"):
        TrainerConfig(objective="vp")
    ids, lm, _ = make_batch(b=1)
    feats = target_features(target, ids, drafter.target_layer_ids)
    with pytest.raises(ValueError, match="prefix_min_length"):
        dflash_loss(drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, prefix_prior=PrefixPrior(min_length=0),
                    **modules(target))


def test_no_valid_anchor_reports_the_extras(target):
    drafter = build_drafter(target, num_layers=1)
    ids, _, _ = make_batch(b=1)
    lm = torch.zeros_like(ids)
    feats = target_features(target, ids, drafter.target_layer_ids)
    out = dflash_loss(drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, prefix_prior=PrefixPrior(),
                      **modules(target))
    assert out.loss.item() == 0.0
    assert set(out.extra) == set(VariablePrefix.metric_names)
    m = out.metrics()
    assert m["prefix_length"] == 0.0 and m["sim_accept_len_prefix1"] == 0.0


# ------------------------------------------------------------------------------------------ pipeline


def _greedy(target, ids, new_tokens, stop):
    with torch.no_grad():
        for _ in range(new_tokens):
            nxt = target(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], dim=1)
            if int(nxt) in stop:
                break
    return ids


@pytest.mark.slow
def test_pipeline_trains_and_exports_a_vp_drafter_zlab_decodes_losslessly(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable, "-m", "dflash_flow.cli", "run", str(REPO / "pipelines" / "dflash1.yaml"),
        "--set", f"output_dir={out}",
        "--set", "tracking.enabled=false",
        "--set", "stages.interleaver.max_batches=4",
        "--set", "stages.drafter.objective=variable_prefix",
        "--set", "stages.drafter.prefix_weight_base=0.8",
        "--set", "stages.drafter.num_anchors=32",
        "--set", "stages.drafter.torch_threads=1",  # a shared 2-core machine: no spinning thread pairs
        "--set", "stages.evaluate.limit=2",
        "--set", "stages.evaluate.max_new_tokens=8",
        "--set", "stages.evaluate.horizons=[]",
        "--set", "stages.evaluate.temperatures=[0.0]",
        "--set", "stages.evaluate.walk_data=null",
        "--set", "stages.monitor.interval_s=1",
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr
    assert (out / "drafter" / "model.safetensors").is_file()
    train = json.loads((out / "monitor" / "history.json").read_text())["train"]
    assert len(train["step"]) == 4
    # Mean visible prefix of each step: near the prior's mean (~3.6 for base 0.8 on 1..7), never outside 1..7.
    assert all(1.5 < v < 6 for v in train["prefix_length"])
    assert all(v >= 1 for v in train["sim_accept_len"] + train["sim_accept_len_prefix1"])

    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoTokenizer

    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.embedded import embedded_target_path
    from dflash_flow.model.evaluation import read_prompt_ids
    from dflash_flow.model.target import load_target

    target_dir = embedded_target_path()
    target = load_target(target_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
    # The export is an ordinary DFlash checkpoint: z-lab's class loads it with no missing or unexpected key.
    theirs = DFlashDraftModel.from_pretrained(out / "drafter", dtype=torch.float32).eval()
    stop = stop_token_ids(tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: one thread (two spin against each other on a shared machine)
    try:
        for prompt in read_prompt_ids(out / "eval_prompts.jsonl", tok, 2):
            ids = torch.tensor([prompt])
            got = dflash_generate(theirs, target, ids, max_new_tokens=24, stop_token_ids=stop)
            want = _greedy(target, ids, 24, set(stop))
            n = min(got.shape[1], want.shape[1])
            assert n > ids.shape[1] and torch.equal(got[:, :n], want[:, :n])
    finally:
        torch.set_num_threads(threads)
