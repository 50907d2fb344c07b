"""Greedy speculative decoding against greedy decoding, HF `generate` and z-lab's reference loop.

The drafter is z-lab's own `dflash.model.DFlashDraftModel` built from a tiny Qwen3Config with random
weights. A random drafter is almost never right, so to exercise partial and full acceptance a
`ScriptedDrafter` wraps the real one: it runs the real drafter on every call (so the context features,
positions and draft KV cache of the loop are exercised and recorded) and then proposes tokens from the
known greedy continuation, deliberately wrong at chosen positions. The expected acceptance lengths then
follow from a few lines of arithmetic, independently of either implementation.
"""

from __future__ import annotations

import time

import dflash.model as zlab
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from transformers import Qwen3Config

from dflash_flow.model.evaluation import evaluate_drafter
from dflash_flow.model.generation import SpecResult, greedy_generate, spec_generate
from dflash_flow.model.target import load_target

VOCAB = 512
MASK = VOCAB - 1  # the last embedding row, as real DFlash drafters use a row past the tokenizer
LAYER_IDS = [1, 3, 5]

# z-lab's loop passes the cache as `past_key_values`, which transformers 5.24 renamed to `cache`.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")]



@pytest.fixture(scope="module")
def target():
    return load_target("tiny-qwen3-8l")


def make_drafter(block_size: int, seed: int = 0, layer_ids=LAYER_IDS) -> zlab.DFlashDraftModel:
    # How z-lab configures a drafter: a Qwen3Config with block_size, num_target_layers and
    # dflash_config {mask_token_id, target_layer_ids}; hidden size equal to the target's.
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
    )
    config.block_size = block_size
    config.num_target_layers = 8
    config.dflash_config = {"mask_token_id": MASK, "target_layer_ids": list(layer_ids)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        drafter = zlab.DFlashDraftModel(config)
    # Default init is small (std 0.02); scale up so the random drafter's proposals depend visibly on
    # its inputs, which makes the recorded-hidden-state comparisons below meaningful.
    with torch.no_grad():
        for p in drafter.parameters():
            if p.dim() == 2:
                p.mul_(10.0)
    return drafter.eval()


class ScriptedDrafter(nn.Module):
    """A real DFlash drafter whose proposals are replaced by a known continuation (see module doc)."""

    def __init__(self, real: zlab.DFlashDraftModel, continuation: list[int], wrong_positions=()):
        super().__init__()
        self.real = real
        self.config = real.config
        self.block_size = real.block_size
        self.mask_token_id = real.mask_token_id
        self.target_layer_ids = real.target_layer_ids
        self.continuation = list(continuation)
        self.wrong = set(wrong_positions)
        self.calls: list[dict[str, torch.Tensor]] = []

    def forward(
        self,
        position_ids,
        noise_embedding,
        target_hidden,
        attention_mask=None,
        past_key_values=None,
        use_cache=False,
        **kwargs,
    ):
        cached_before = past_key_values.get_seq_length() if past_key_values is not None else 0
        hidden = self.real(
            position_ids=position_ids,
            noise_embedding=noise_embedding,
            target_hidden=target_hidden,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
        )
        self.calls.append(
            {
                "position_ids": position_ids.clone(),
                "target_hidden": target_hidden.clone(),
                "noise": noise_embedding.clone(),
                "hidden": hidden.clone(),
                "cached_before": torch.tensor(cached_before),
            }
        )
        block_positions = position_ids[0, -noise_embedding.shape[1] :].tolist()
        tokens = [
            self.continuation[p] if p not in self.wrong else (self.continuation[p] + 1) % VOCAB
            for p in block_positions
        ]
        # Carry the proposed id in channel 0; compute_logits turns it into a one-hot.
        out = torch.zeros(1, len(tokens), 1)
        out[0, :, 0] = torch.tensor(tokens, dtype=torch.float32)
        return out

    def compute_logits(self, hidden, output_head):
        return F.one_hot(hidden[..., 0].round().long(), VOCAB).float()


def prompt(seed: int, n: int = 7) -> torch.Tensor:
    return torch.randint(0, MASK, (1, n), generator=torch.Generator().manual_seed(seed))


def zlab_generate(drafter, target, ids, max_new_tokens, stop_token_ids=None, block_size=None):
    """z-lab's loop with its statistics. `return_stats` only times with torch.cuda.synchronize; on CPU
    we substitute a plain clock (timing only, the decoding logic is untouched)."""
    original = zlab._cuda_time
    zlab._cuda_time = time.perf_counter
    try:
        return zlab.dflash_generate(
            drafter, target, ids, max_new_tokens, stop_token_ids, block_size=block_size, return_stats=True
        )
    finally:
        zlab._cuda_time = original


def expected_accept_lengths(n_in: int, max_new_tokens: int, block_size: int, wrong: set[int]) -> list[int]:
    """Acceptance lengths for a drafter that proposes the greedy token except at `wrong` positions."""
    max_length = n_in + max_new_tokens
    start, lengths = n_in, []
    while start + 1 < max_length:
        verify = min(block_size, max_length - start)
        accepted = 0
        for k in range(1, verify):
            if start + k in wrong:
                break
            accepted += 1
        produced = min(accepted + 1, max_length - start - 1)
        lengths.append(produced)
        start += produced
    return lengths


# --------------------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_matches_hf_generate(target, seed):
    ids = prompt(seed)
    res = greedy_generate(target, ids, 24)
    hf = target.generate(ids, max_new_tokens=24, do_sample=False)
    assert res.output_ids.tolist() == hf.tolist()
    assert res.target_forwards == 24 and res.drafter_forwards == 0 and res.num_new_tokens == 24


def test_greedy_stops_after_a_stop_token(target):
    ids = prompt(0)
    full = greedy_generate(target, ids, 24).new_ids
    stop = full[3]
    first = full.index(stop)
    res = greedy_generate(target, ids, 24, stop_token_ids=[stop])
    assert res.new_ids == full[: first + 1]
    assert res.target_forwards == first + 1


# ------------------------------------------------------------------------------------ lossless output


@pytest.mark.parametrize("block_size", [2, 4, 8])
@pytest.mark.parametrize("seed", [0, 3])
def test_random_drafter_is_lossless(target, block_size, seed):
    drafter = make_drafter(block_size, seed=seed)
    ids = prompt(seed + 10, n=5 + seed)
    ref = greedy_generate(target, ids, 20)
    res = spec_generate(target, drafter, ids, max_new_tokens=20)
    assert isinstance(res, SpecResult)
    assert res.output_ids.tolist() == ref.output_ids.tolist()
    assert all(1 <= a <= block_size for a in res.accept_lengths)
    assert sum(res.accept_lengths) == res.num_new_tokens - 1  # the first token comes from the prefill
    assert res.target_forwards == 1 + len(res.accept_lengths)
    assert res.drafter_forwards == len(res.accept_lengths)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_same_tokens_and_drafts_as_zlab(target, seed):
    # A random drafter rejects almost everything; compare what the drafter was fed and produced on
    # every call, which pins positions, context features and cache handling, not just the output.
    ours_d = ScriptedDrafter(make_drafter(4, seed=seed), [0] * 64, wrong_positions=range(64))
    ref_d = ScriptedDrafter(make_drafter(4, seed=seed), [0] * 64, wrong_positions=range(64))
    ids = prompt(seed)
    ours = spec_generate(target, ours_d, ids, max_new_tokens=16)
    ref = zlab_generate(ref_d, target, ids, 16)
    assert (
        ours.output_ids.tolist()
        == ref.output_ids.tolist()
        == greedy_generate(target, ids, 16).output_ids.tolist()
    )
    assert ours.accept_lengths == ref.acceptance_lengths
    _assert_same_calls(ours_d.calls, ref_d.calls)


def _assert_same_calls(ours, ref):
    assert len(ours) == len(ref) > 0
    for a, b in zip(ours, ref, strict=True):
        assert a["position_ids"].tolist() == b["position_ids"].tolist()
        assert int(a["cached_before"]) == int(b["cached_before"])
        torch.testing.assert_close(a["target_hidden"], b["target_hidden"], atol=1e-6, rtol=0)
        torch.testing.assert_close(a["noise"], b["noise"], atol=0, rtol=0)
        torch.testing.assert_close(a["hidden"], b["hidden"], atol=1e-5, rtol=0)


def test_unwrapped_zlab_drafter_same_output_and_lengths_as_zlab(target):
    drafter = make_drafter(4, seed=7)
    ids = prompt(7)
    ours = spec_generate(target, drafter, ids, max_new_tokens=20)
    ref = zlab_generate(drafter, target, ids, 20)
    assert ours.output_ids.tolist() == ref.output_ids.tolist()
    assert ours.accept_lengths == ref.acceptance_lengths


# ------------------------------------------------------------------------ scripted partial acceptance


@pytest.mark.parametrize(
    ("block_size", "max_new_tokens", "wrong"),
    [
        (4, 24, set()),  # everything accepted: B tokens per step
        (4, 24, {10, 11, 17}),  # partial acceptance, two rejections in a row
        (8, 30, {9, 13, 14, 20, 28}),
        (8, 3, set()),  # budget smaller than the block
        (16, 10, {12}),
        (5, 21, set(range(0, 64, 3))),
    ],
)
def test_scripted_acceptance_matches_arithmetic_and_zlab(target, block_size, max_new_tokens, wrong):
    ids = prompt(4)
    n_in = ids.shape[1]
    continuation = greedy_generate(target, ids, max_new_tokens).output_ids[0].tolist()
    ours_d = ScriptedDrafter(make_drafter(block_size, seed=1), continuation, wrong)
    ref_d = ScriptedDrafter(make_drafter(block_size, seed=1), continuation, wrong)

    ours = spec_generate(target, ours_d, ids, max_new_tokens=max_new_tokens)
    ref = zlab_generate(ref_d, target, ids, max_new_tokens)

    want = expected_accept_lengths(n_in, max_new_tokens, block_size, wrong)
    assert ours.accept_lengths == want
    assert ref.acceptance_lengths == want
    assert all(1 <= a <= block_size for a in ours.accept_lengths)
    assert ours.output_ids[0].tolist() == continuation == ref.output_ids[0].tolist()
    assert ours.target_forwards == 1 + len(want)
    _assert_same_calls(ours_d.calls, ref_d.calls)
    # The draft context is exactly the committed tokens: each call's context plus what the cache
    # already held reaches the block's start position.
    for call in ours_d.calls:
        ctx = call["target_hidden"].shape[1]
        block_start = int(call["position_ids"][0, ctx])
        assert int(call["cached_before"]) + ctx == block_start


def test_block_size_override_and_explicit_settings(target):
    # block_size / mask / layer ids passed explicitly win over the drafter config.
    ids = prompt(5)
    continuation = greedy_generate(target, ids, 12).output_ids[0].tolist()
    d = ScriptedDrafter(make_drafter(8, seed=2), continuation)
    res = spec_generate(
        target, d, ids, max_new_tokens=12, block_size=3, mask_token_id=MASK, target_layer_ids=LAYER_IDS
    )
    assert res.accept_lengths == expected_accept_lengths(ids.shape[1], 12, 3, set())
    assert all(c["noise"].shape[1] <= 3 for c in d.calls)


# -------------------------------------------------------------------------------------- edge cases


def test_one_new_token_needs_only_the_prefill(target):
    ids = prompt(0)
    res = spec_generate(target, make_drafter(4), ids, max_new_tokens=1)
    assert res.output_ids.tolist() == greedy_generate(target, ids, 1).output_ids.tolist()
    assert res.accept_lengths == [] and res.target_forwards == 1 and res.drafter_forwards == 0


def test_block_size_one_is_plain_greedy(target):
    ids = prompt(2)
    ref = greedy_generate(target, ids, 10)
    res = spec_generate(target, make_drafter(4), ids, max_new_tokens=10, block_size=1)
    assert res.output_ids.tolist() == ref.output_ids.tolist()
    assert res.accept_lengths == [1] * 9 and res.drafter_forwards == 0
    assert res.target_forwards == ref.target_forwards == 10


@pytest.mark.parametrize("wrong", [set(), {11}])
def test_stop_token_inside_an_accepted_block(target, wrong):
    ids = prompt(6)
    n_in = ids.shape[1]
    continuation = greedy_generate(target, ids, 30).output_ids[0].tolist()
    new = continuation[n_in:]
    stop = new[5]
    first = new.index(stop)
    ours = spec_generate(
        target,
        ScriptedDrafter(make_drafter(8), continuation, wrong),
        ids,
        max_new_tokens=30,
        stop_token_ids=[stop],
    )
    ref = zlab_generate(ScriptedDrafter(make_drafter(8), continuation, wrong), target, ids, 30, [stop])
    greedy = greedy_generate(target, ids, 30, stop_token_ids=[stop])
    assert ours.new_ids == new[: first + 1] == greedy.new_ids
    assert ours.output_ids.tolist() == ref.output_ids.tolist()
    assert ours.accept_lengths == ref.acceptance_lengths
    assert sum(ours.accept_lengths) == first  # tokens after the prefill's, up to and including the stop


def test_stop_token_as_first_token(target):
    ids = prompt(0)
    first = greedy_generate(target, ids, 1).new_ids[0]
    res = spec_generate(target, make_drafter(4), ids, max_new_tokens=20, stop_token_ids=[first])
    assert res.new_ids == [first] and res.accept_lengths == [] and res.target_forwards == 1


def test_batch_of_one_only_and_1d_prompts(target):
    d = make_drafter(4)
    with pytest.raises(ValueError, match="batch size 1"):
        spec_generate(target, d, torch.zeros(2, 5, dtype=torch.long), max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec_generate(target, d, prompt(0), max_new_tokens=0)
    flat = spec_generate(target, d, prompt(0)[0].tolist(), max_new_tokens=6)
    assert (
        flat.output_ids.tolist() == spec_generate(target, d, prompt(0), max_new_tokens=6).output_ids.tolist()
    )


# -------------------------------------------------------------------------------------- evaluation


def test_evaluate_drafter_with_a_perfect_and_a_random_drafter(target):
    prompts = [prompt(s).tolist()[0] for s in range(3)]
    max_new = 17
    # A perfect drafter needs every prompt's continuation; chain them through one ScriptedDrafter per
    # prompt by evaluating prompt by prompt and aggregating like evaluate_drafter does.
    totals = {"steps": 0, "committed": 0, "greedy": 0, "spec": 0}
    for p in prompts:
        cont = greedy_generate(target, p, max_new).output_ids[0].tolist()
        r = evaluate_drafter(target, ScriptedDrafter(make_drafter(4), cont), [p], max_new_tokens=max_new)
        assert r["lossless"] == 1.0 and r["tokens_generated"] == max_new
        lengths = expected_accept_lengths(len(p), max_new, 4, set())
        assert r["tau"] == pytest.approx(sum(lengths) / len(lengths))
        assert r["speedup_forwards"] == pytest.approx(max_new / (1 + len(lengths)))
        totals["steps"] += len(lengths)
        totals["committed"] += sum(lengths)
    # 16 tokens after the prefill in blocks of 4 -> 4 tokens per step, 5 target forwards instead of 17.
    assert totals["committed"] / totals["steps"] == 4.0

    rnd = evaluate_drafter(target, make_drafter(4, seed=3), prompts, max_new_tokens=max_new)
    assert rnd["lossless"] == 1.0 and rnd["num_prompts"] == 3 and rnd["tokens_generated"] == 3 * max_new
    assert 1.0 <= rnd["tau"] <= 4.0
    assert rnd["target_forwards_greedy"] == 3 * max_new
    assert rnd["speedup_forwards"] == pytest.approx(
        rnd["target_forwards_greedy"] / rnd["target_forwards_spec"]
    )
    assert rnd["verify_steps"] == rnd["drafter_forwards"] == rnd["target_forwards_spec"] - 3


# ---------------------------------------------------------------------------------- our own drafter


@pytest.mark.parametrize("wrong", [set(range(64)), {9, 10, 15}])
def test_our_drafter_in_our_loop_equals_zlab_drafter_in_zlab_loop(target, wrong):
    # dflash_flow.model.drafter.DFlashDrafter has z-lab's parameter names and forward interface: with
    # the same weights, our loop driving it must feed and get exactly what z-lab's loop does with its own.
    from dflash_flow.model.drafter import DFlashDrafter

    zl = make_drafter(4, seed=5)
    ours_model = DFlashDrafter(zl.config)
    ours_model.load_state_dict(zl.state_dict(), strict=True)
    ours_model.eval()
    ids = prompt(8)
    continuation = greedy_generate(target, ids, 18).output_ids[0].tolist()
    ours_d = ScriptedDrafter(ours_model, continuation, wrong)
    ref_d = ScriptedDrafter(zl, continuation, wrong)
    ours = spec_generate(target, ours_d, ids, max_new_tokens=18)
    ref = zlab_generate(ref_d, target, ids, 18)
    assert ours.output_ids.tolist() == ref.output_ids.tolist() == [continuation]
    assert (
        ours.accept_lengths == ref.acceptance_lengths == expected_accept_lengths(ids.shape[1], 18, 4, wrong)
    )
    _assert_same_calls(ours_d.calls, ref_d.calls)
    # Unwrapped, our drafter's own proposals drive our loop to the same result as z-lab's.
    plain = spec_generate(target, ours_model, ids, max_new_tokens=18)
    plain_ref = zlab_generate(zl, target, ids, 18)
    assert plain.output_ids.tolist() == plain_ref.output_ids.tolist()
    assert plain.accept_lengths == plain_ref.acceptance_lengths


# ------------------------------------------------------------------- the trace the interop check reads


@pytest.mark.parametrize(
    "block_size, max_new_tokens, wrong, stop_at",
    [(4, 24, {10, 11, 17}, None), (8, 30, {9, 13, 14, 20, 28}, None), (8, 30, {11}, 5), (5, 21, set(range(0, 64, 3)), None)],
)
def test_trace_replayed_from_the_output_gives_our_steps(target, block_size, max_new_tokens, wrong, stop_at):
    """``trace`` records each verify step's block start and drafts; the interop check's ``replay`` rebuilds
    the same steps from the output and the drafts alone (what it knows of vLLM), an extra proposal for the
    finished request (vLLM makes one) dropped."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "interop"))
    from interoptools import load_interop

    acc = load_interop("accounting")
    ids = prompt(4)
    n_in = ids.shape[1]
    continuation = greedy_generate(target, ids, max_new_tokens).output_ids[0].tolist()
    stops = [continuation[n_in + stop_at]] if stop_at is not None else None
    trace: list = []
    res = spec_generate(target, ScriptedDrafter(make_drafter(block_size, seed=1), continuation, wrong), ids,
                        max_new_tokens=max_new_tokens, stop_token_ids=stops, trace=trace)
    starts = [n_in + sum(res.accept_lengths[:i]) for i in range(len(res.accept_lengths))]
    assert [s for s, _ in trace] == starts
    assert all(len(d) == min(block_size, n_in + max_new_tokens - s) - 1 for s, d in trace)
    steps = acc.replay(res.output_ids[0].tolist(), n_in, [d for _, d in trace] + [[MASK] * (block_size - 1)])
    assert [s.committed for s in steps] == res.accept_lengths
    assert acc.compare_drafts(trace, steps) == {"steps": len(trace), "equal": len(trace), "first_difference": None}
    assert acc.tau(steps) == res.mean_accept_length
