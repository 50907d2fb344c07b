"""The DFlash objective: anchors, block plan, masks, labels, weights, chunking, padding.

Tests named ``test_pitfall_N_*`` each target item N of the reference pitfall checklist
(docs: shared/reference/dflash-training.md); each would fail on the bug that item describes.
"""

from __future__ import annotations

import math

import pytest
import torch
from model_testlib import MASK_ID, VOCAB, build_drafter, randomize, target_features

from dflash_flow.model.blockplan import decay_weights, sample_anchors, valid_anchor_mask
from dflash_flow.model.drafter_config import FULL_ATTENTION, SLIDING_ATTENTION
from dflash_flow.model.layout import activation_bytes_per_block, block_attention_mask
from dflash_flow.model.objective import (
    ColumnBounds,
    auto_chunk_blocks,
    auto_group_blocks,
    dflash_loss,
    draft_block_hidden,
    plan_blocks,
)


def reference_mask(anchors, keep, context_valid, s, block, layer_type, window):
    """Dense mask written from the reference rules, one element at a time."""
    b, n = anchors.shape
    m = torch.zeros(b, n * block, s + n * block, dtype=torch.bool)
    for r in range(b):
        for i in range(n):
            a = int(anchors[r, i])
            for j in range(block):
                q = i * block + j
                for k in range(block):
                    if layer_type == FULL_ATTENTION or (k <= j and j - k < window):
                        m[r, q, s + i * block + k] = True
                if not keep[r, i]:
                    continue  # padding block: its own block only, no context
                for c in range(s):
                    if c < a and context_valid[r, c]:
                        if layer_type == FULL_ATTENTION or (a + j) - c < window:
                            m[r, q, c] = True
    return m[:, None]


def make_batch(target, b=2, s=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB - 1, (b, s), generator=g)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    loss_mask[:, :5] = 0  # a "prompt"
    return ids, loss_mask


def loss_modules(target):
    return dict(embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head)


# ------------------------------------------------------------------------------------------ anchors


def test_sample_anchors_valid_sorted_unique_and_padded():
    lm = torch.tensor(
        [
            [0, 1, 1, 1, 0, 1, 1, 1, 1, 0],  # valid: 1, 2, 5, 6, 7
            [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],  # valid: 3
        ]
    )
    g = torch.Generator().manual_seed(0)
    anchors, keep = sample_anchors(lm, 512, generator=g)
    assert anchors.shape == (2, 5)  # W = min(512, max #valid) = 5
    assert anchors[0].tolist() == [1, 2, 5, 6, 7] and keep[0].all()
    assert anchors[1].tolist() == [3, 0, 0, 0, 0] and keep[1].tolist() == [True] + [False] * 4
    anchors, keep = sample_anchors(lm, 3, generator=torch.Generator().manual_seed(1))
    assert anchors.shape == (2, 3)
    row = anchors[0].tolist()
    assert row == sorted(row) and len(set(row)) == 3 and set(row) <= {1, 2, 5, 6, 7}
    assert keep[0].all() and keep[1].tolist() == [True, False, False]


def test_sample_anchors_seeded_and_uniform():
    lm = torch.ones(1, 41, dtype=torch.long)  # 40 valid positions
    a1, _ = sample_anchors(lm, 8, generator=torch.Generator().manual_seed(7))
    a2, _ = sample_anchors(lm, 8, generator=torch.Generator().manual_seed(7))
    a3, _ = sample_anchors(lm, 8, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(41)
    draws = 2000
    for _ in range(draws):
        a, _ = sample_anchors(lm, 8, generator=g)
        counts[a[0]] += 1
    assert counts[40] == 0  # the last position has no successor
    expected = draws * 8 / 40
    chi2 = float(((counts[:40] - expected) ** 2 / expected).sum())
    assert chi2 < 80  # 39 degrees of freedom; p(chi2 > 80) ~ 1e-4


def test_valid_anchor_mask_respects_attention_mask():
    lm = torch.tensor([[1, 1, 1, 1]])
    am = torch.tensor([[1, 1, 1, 0]])
    assert valid_anchor_mask(lm, am).tolist() == [[True, True, False, False]]


# ------------------------------------------------------------------------------------------ pitfalls


@pytest.mark.parametrize("layer_type,window", [(FULL_ATTENTION, None), (SLIDING_ATTENTION, 4)])
def test_pitfalls_2_4_5_6_mask_equals_dense_reference(layer_type, window):
    # Overlapping anchors out of index order, a padding block (at a nonzero position, so a mask that
    # ignored keep would let it see context), and a padded context position.
    anchors = torch.tensor([[2, 3, 9, 6], [7, 4, 5, 1]])
    keep = torch.tensor([[True, True, True, False], [True, True, True, True]])
    s, block = 14, 5
    context_valid = torch.ones(2, s, dtype=torch.bool)
    context_valid[1, 12:] = False
    got = block_attention_mask(
        anchors, keep, context_valid, block_size=block, layer_type=layer_type, sliding_window=window
    )
    want = reference_mask(anchors, keep, context_valid, s, block, layer_type, window or 10**9)
    assert got.shape == want.shape
    assert torch.equal(got, want)
    assert got.any(dim=-1).all()  # no fully masked row: sdpa would return NaN


def test_pitfall_1_same_position_labels_and_weights():
    ids = torch.arange(10, 22)[None]  # token at position p is 10 + p
    lm = torch.ones(1, 12, dtype=torch.long)
    lm[0, 6] = 0
    anchors = torch.tensor([[3, 9]])
    keep = torch.tensor([[True, True]])
    plan = plan_blocks(ids, lm, anchors, keep, block_size=4, mask_token_id=MASK_ID, gamma=7.0)
    # Slot k is labelled with the token at a+k (not a+k+1).
    assert plan.labels[0, 0].tolist() == [13, 14, 15, 16]
    assert plan.labels[0, 1, :3].tolist() == [19, 20, 21]
    w = plan.weights[0]
    # Slot 0 never supervised; slot 3 of block 0 is position 6 (loss_mask 0); block 1 runs past S.
    assert w[0, 0] == 0 and w[1, 0] == 0
    assert w[0, 1] == pytest.approx(1.0) and w[0, 2] == pytest.approx(math.exp(-1 / 7))
    assert w[0, 3] == 0
    assert w[1, 1] == pytest.approx(1.0) and w[1, 2] == pytest.approx(math.exp(-1 / 7)) and w[1, 3] == 0
    assert decay_weights(4, 7.0).tolist() == pytest.approx([0.0, 1.0, math.exp(-1 / 7), math.exp(-2 / 7)])
    assert decay_weights(3, None).tolist() == [0.0, 1.0, 1.0]
    torch.testing.assert_close(plan.weights[0, 0, :3], decay_weights(4, 7.0)[:3])


def test_pitfall_3_block_inputs_not_shifted():
    ids = torch.arange(10, 22)[None]
    lm = torch.ones(1, 12, dtype=torch.long)
    plan = plan_blocks(
        ids, lm, torch.tensor([[3, 0]]), torch.tensor([[True, False]]), block_size=4, mask_token_id=MASK_ID
    )
    assert plan.block_ids[0, 0].tolist() == [13, MASK_ID, MASK_ID, MASK_ID]  # input_ids[a], no shift
    assert plan.block_ids[0, 1].tolist() == [MASK_ID] * 4  # padding block: all MASK
    assert plan.block_positions[0, 0].tolist() == [3, 4, 5, 6]
    assert not plan.supervised[0, 1].any()


def test_pitfalls_2_3_context_is_features_strictly_before_anchor(target):
    drafter = randomize(build_drafter(target, num_layers=2), 2).eval()
    ids, lm = make_batch(target, b=1)
    feats = target_features(target, ids, drafter.target_layer_ids)
    a = 11
    plan = plan_blocks(
        ids, lm, torch.tensor([[a]]), torch.tensor([[True]]), block_size=8, mask_token_id=MASK_ID
    )
    mods = loss_modules(target)

    def out(hidden):
        with torch.no_grad():
            return draft_block_hidden(drafter, plan, embed_tokens=mods["embed_tokens"], hidden_states=hidden)

    base = out(feats)
    later = feats.clone()
    later[:, a:] += 5.0  # the anchor's own feature and everything after it
    torch.testing.assert_close(out(later), base, atol=0, rtol=0)
    before = feats.clone()
    before[:, a - 1] += 5.0  # the last feature before the anchor must matter
    assert (out(before) - base).abs().max() > 1e-3


def test_pitfall_4_visibility_by_position_not_block_index(target):
    drafter = randomize(build_drafter(target, num_layers=2), 4).eval()
    ids, lm = make_batch(target, b=1)
    feats = target_features(target, ids, drafter.target_layer_ids)
    emb = target.get_input_embeddings()
    anchors = torch.tensor([[5, 6, 12, 18]])
    keep = torch.ones_like(anchors, dtype=torch.bool)
    perm = torch.tensor([3, 0, 2, 1])
    outs = []
    for a in (anchors, anchors[:, perm]):
        plan = plan_blocks(ids, lm, a, keep, block_size=8, mask_token_id=MASK_ID)
        with torch.no_grad():
            outs.append(
                draft_block_hidden(drafter, plan, embed_tokens=emb, hidden_states=feats).view(1, 4, 8, -1)
            )
    torch.testing.assert_close(outs[1], outs[0][:, perm], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("layer_type,bidirectional", [("full_attention", True), ("sliding_attention", False)])
def test_pitfall_5_full_layers_bidirectional_in_block(target, layer_type, bidirectional):
    drafter = randomize(
        build_drafter(target, num_layers=2, layer_types=[layer_type] * 2, sliding_window=64), 6
    ).eval()
    ids, lm = make_batch(target, b=1)
    feats = target_features(target, ids, drafter.target_layer_ids)
    emb = target.get_input_embeddings()
    plan = plan_blocks(
        ids, lm, torch.tensor([[8]]), torch.tensor([[True]]), block_size=8, mask_token_id=MASK_ID
    )
    with torch.no_grad():
        base = draft_block_hidden(drafter, plan, embed_tokens=emb, hidden_states=feats)
        plan.block_ids[0, 0, 5] = 3  # change a later slot
        changed = draft_block_hidden(drafter, plan, embed_tokens=emb, hidden_states=feats)
    earlier_moved = (changed[0, :5] - base[0, :5]).abs().max().item()
    assert (earlier_moved > 1e-4) == bidirectional


def test_pitfall_6_padding_blocks_excluded_from_attention_and_loss(target):
    drafter = randomize(build_drafter(target, num_layers=2), 8)
    ids, lm = make_batch(target, b=2)
    lm[1, :18] = 0  # row 1 has few valid anchors -> padding blocks in the batch
    feats = target_features(target, ids, drafter.target_layer_ids)
    mods = loss_modules(target)
    kw = dict(mods, block_size=8, mask_token_id=MASK_ID, chunk_blocks=None)
    anchors, keep = sample_anchors(lm, 12, generator=torch.Generator().manual_seed(0))
    assert (~keep).any()
    out = dflash_loss(
        drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=(anchors, keep), **kw
    )
    assert torch.isfinite(out.loss)
    drafter.zero_grad()
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    # Padding blocks pointing anywhere, with any tokens, change nothing.
    garbage = torch.where(keep, anchors, torch.full_like(anchors, 20))
    out2 = dflash_loss(
        drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=(garbage, keep), **kw
    )
    torch.testing.assert_close(out2.loss, out.loss, atol=1e-6, rtol=1e-6)
    # Same as each row alone without padding (token-weighted over the batch).
    sums = []
    for r in range(2):
        k = keep[r]
        o = dflash_loss(
            drafter,
            input_ids=ids[r : r + 1],
            loss_mask=lm[r : r + 1],
            hidden_states=feats[r : r + 1],
            anchors=(anchors[r : r + 1, k], keep[r : r + 1, k]),
            **kw,
        )
        sums.append((o.loss * o.weight_sum, o.weight_sum))
    total = (sums[0][0] + sums[1][0]) / (sums[0][1] + sums[1][1])
    torch.testing.assert_close(out.loss, total, atol=1e-6, rtol=1e-5)
    assert out.kept_blocks.item() == keep.sum().item()


def test_pitfall_7_mask_broadcasts_over_heads():
    # Our analogue of "BlockMask with H=None": the dense mask has a head dimension of 1, so its memory
    # does not grow with the number of heads.
    m = block_attention_mask(
        torch.tensor([[3, 7]]),
        torch.tensor([[True, True]]),
        torch.ones(1, 16, dtype=torch.bool),
        block_size=4,
    )
    assert m.shape == (1, 1, 8, 16 + 8) and m.dtype == torch.bool


def test_batch_padding_positions_are_not_context(target):
    drafter = randomize(build_drafter(target, num_layers=1), 9)
    ids, lm = make_batch(target, b=2, s=24)
    am = torch.ones_like(ids)
    am[1, 16:] = 0
    ids[1, 16:] = 0
    lm[1, 16:] = 0
    feats = target_features(target, ids, drafter.target_layer_ids, attention_mask=am)
    feats[1, 16:] = 1e3  # pad features must never be read
    mods = loss_modules(target)
    kw = dict(mods, block_size=8, mask_token_id=MASK_ID, chunk_blocks=None)
    full = dflash_loss(
        drafter,
        input_ids=ids,
        loss_mask=lm,
        hidden_states=feats,
        attention_mask=am,
        generator=torch.Generator().manual_seed(0),
        num_anchors=64,
        **kw,
    )
    assert torch.isfinite(full.loss)
    anchors, keep = sample_anchors(lm, 64, attention_mask=am, generator=torch.Generator().manual_seed(0))
    assert (anchors[1][keep[1]] < 15).all()
    # Row 1 alone, truncated to its real length, gives the same blocks' losses.
    k = keep[1]
    alone = dflash_loss(
        drafter,
        input_ids=ids[1:, :16],
        loss_mask=lm[1:, :16],
        hidden_states=feats[1:, :16],
        anchors=(anchors[1:, k], keep[1:, k]),
        **kw,
    )
    with_pad = dflash_loss(
        drafter,
        input_ids=ids[1:],
        loss_mask=lm[1:],
        hidden_states=feats[1:],
        attention_mask=am[1:],
        anchors=(anchors[1:, k], keep[1:, k]),
        **kw,
    )
    torch.testing.assert_close(with_pad.loss, alone.loss, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ loss


def test_chunked_loss_equals_unchunked(target):
    ids, lm = make_batch(target, b=2, s=32)
    results = []
    for chunk in (None, 3):
        drafter = randomize(
            build_drafter(
                target, num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6
            ),
            11,
        )
        feats = target_features(target, ids, drafter.target_layer_ids).requires_grad_(False)
        out = dflash_loss(
            drafter,
            input_ids=ids,
            loss_mask=lm,
            hidden_states=feats,
            block_size=8,
            mask_token_id=MASK_ID,
            num_anchors=10,
            generator=torch.Generator().manual_seed(3),
            chunk_blocks=chunk,
            **loss_modules(target),
        )
        out.loss.backward()
        results.append((out, {k: p.grad.clone() for k, p in drafter.named_parameters()}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a.loss, b.loss, atol=1e-6, rtol=1e-6)
    ma, mb = a.metrics(), b.metrics()
    assert ma["accuracy"] == mb["accuracy"] and ma["acceptance_length"] == mb["acceptance_length"]
    for k in ga:
        torch.testing.assert_close(ga[k], gb[k], atol=1e-6, rtol=1e-5)


def test_loss_value_and_metrics_match_manual_computation(target):
    drafter = randomize(build_drafter(target, num_layers=1, block_size=4), 12)
    ids, lm = make_batch(target, b=2, s=20)
    feats = target_features(target, ids, drafter.target_layer_ids)
    anchors, keep = sample_anchors(lm, 6, generator=torch.Generator().manual_seed(4))
    out = dflash_loss(
        drafter,
        input_ids=ids,
        loss_mask=lm,
        hidden_states=feats,
        block_size=4,
        mask_token_id=MASK_ID,
        anchors=(anchors, keep),
        gamma=7.0,
        **loss_modules(target),
    )
    plan = plan_blocks(ids, lm, anchors, keep, block_size=4, mask_token_id=MASK_ID, gamma=7.0)
    with torch.no_grad():
        h = draft_block_hidden(drafter, plan, embed_tokens=target.get_input_embeddings(), hidden_states=feats)
        logits = target.lm_head(h).view(2, -1, 4, VOCAB)
    manual_loss = 0.0
    wsum = 0.0
    correct = total = 0
    accept = []
    for r in range(2):
        for n in range(anchors.shape[1]):
            if not keep[r, n]:
                continue
            a = int(anchors[r, n])
            run, alive = 0, True
            for k in range(1, 4):
                p = a + k
                sup = p < ids.shape[1] and lm[r, p] == 1
                if not sup:
                    alive = False
                    continue
                w = math.exp(-(k - 1) / 7.0)
                ce = torch.nn.functional.cross_entropy(logits[r, n, k][None], ids[r, p][None]).item()
                manual_loss += w * ce
                wsum += w
                hit = int(logits[r, n, k].argmax()) == int(ids[r, p])
                correct += hit
                total += 1
                alive = alive and hit
                run += alive
            accept.append(1 + run)
    assert out.loss.item() == pytest.approx(manual_loss / wsum, rel=1e-5)
    m = out.metrics("train/")
    assert m["train/loss"] == pytest.approx(out.loss.item())
    assert m["train/accuracy"] == pytest.approx(correct / total)
    assert m["train/acceptance_length"] == pytest.approx(sum(accept) / len(accept))
    assert m["train/num_tokens"] == total and m["train/num_blocks"] == len(accept)
    assert not any("accuracy_pos" in k for k in m)  # the slots are a sequence of their own, not keys
    assert len(out.values()[1]) == 3


def test_no_valid_anchor_gives_zero_loss_with_graph(target):
    drafter = build_drafter(target, num_layers=1)
    ids, _ = make_batch(target, b=1)
    lm = torch.zeros_like(ids)
    lm[0, 4] = 1  # a single supervised token: no valid pair
    feats = target_features(target, ids, drafter.target_layer_ids)
    out = dflash_loss(
        drafter,
        input_ids=ids,
        loss_mask=lm,
        hidden_states=feats,
        mask_token_id=MASK_ID,
        block_size=8,
        **loss_modules(target),
    )
    m = out.metrics()
    assert out.loss.item() == 0.0 and m["num_tokens"] == 0 and m["acceptance_length"] == 0.0
    out.loss.backward()
    assert drafter.fc.weight.grad is not None


def test_pitfall_8_training_settings_must_match_the_drafter_config(target):
    drafter = build_drafter(target, num_layers=1, block_size=8)
    ids, lm = make_batch(target, b=1)
    feats = target_features(target, ids, drafter.target_layer_ids)
    kw = dict(input_ids=ids, loss_mask=lm, hidden_states=feats, **loss_modules(target))
    with pytest.raises(ValueError, match="mask_token_id"):
        dflash_loss(drafter, mask_token_id=MASK_ID - 1, **kw)
    with pytest.raises(ValueError, match="block_size"):
        dflash_loss(drafter, block_size=16, **kw)
    out = dflash_loss(drafter, **kw)  # both taken from the config
    assert len(out.values()[1]) == 7
    with pytest.raises(ValueError, match="target layers"):
        dflash_loss(drafter, **dict(kw, hidden_states=torch.cat([feats, feats], dim=-1)))


# ------------------------------------------------------------------------------------------ reference


def reference_sample_anchors(loss_mask, num_anchors, *, attention_mask=None, generator=None):
    """The sampler as first written (W read before drawing), kept to pin the anchors of every seed."""
    valid = valid_anchor_mask(loss_mask, attention_mask)
    b, s = valid.shape
    w = min(int(num_anchors), int(valid.sum(dim=1).max()))
    keys = torch.rand(b, s, generator=generator)
    keys = torch.where(valid, keys, torch.full_like(keys, 2.0))
    picked = torch.topk(keys, w, dim=1, largest=False).indices
    keep = valid.gather(1, picked)
    order = torch.where(keep, picked, picked + s).argsort(dim=1)
    anchors, keep = picked.gather(1, order), keep.gather(1, order)
    return torch.where(keep, anchors, torch.zeros_like(anchors)), keep


def reference_loss(
    drafter,
    *,
    embed_tokens,
    lm_head,
    input_ids,
    loss_mask,
    hidden_states,
    anchors,
    gamma,
    attention_mask=None,
):
    """The dense-mask path (every block over all context and all blocks, the element-wise mask of
    ``reference_mask``), the way the loss was computed before the grouped layout: loss and per-slot hits."""
    keep = anchors[1]
    bsz = drafter.block_size
    plan = plan_blocks(
        input_ids,
        loss_mask,
        anchors[0],
        keep,
        block_size=bsz,
        mask_token_id=MASK_ID,
        gamma=gamma,
        attention_mask=attention_mask,
    )
    b, s = input_ids.shape
    window = drafter.config.sliding_window or 10**9
    masks = {
        t: reference_mask(plan.anchors, keep, plan.context_valid, s, bsz, t, window)
        for t in set(drafter.layer_types)
    }
    context = drafter.fuse_context(hidden_states)
    positions = torch.cat([torch.arange(s).expand(b, s), plan.block_positions.reshape(b, -1)], dim=1)
    h = drafter.decode(embed_tokens(plan.block_ids.reshape(b, -1)), context, positions, masks)
    logits = drafter.compute_logits(h, lm_head).float()
    ce = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), plan.labels.reshape(-1), reduction="none"
    )
    loss = (ce * plan.weights.reshape(-1)).sum() / plan.weights.sum()
    hits = (logits.argmax(-1).view_as(plan.labels) == plan.labels) & plan.supervised
    return loss, hits


FAST_PATH_CASES = {
    "full": dict(layer_types=None, window=None, chunk=None, group=None),
    "full_groups_of_1_chunks_of_3": dict(layer_types=None, window=None, chunk=3, group=1),
    "sliding_full": dict(layer_types=["sliding_attention", "full_attention"], window=5, chunk=None, group=2),
    "sliding_only_chunked": dict(layer_types=["sliding_attention"] * 2, window=3, chunk=4, group=None),
}


@pytest.mark.parametrize("case", list(FAST_PATH_CASES))
def test_fast_path_equals_dense_reference(target, case):
    # Loss, every gradient and the metrics of the grouped layout equal the dense-mask path, with GQA
    # (4 heads, 2 KV heads), ragged rows (attention mask), padding blocks, anchors at 0 and past S.
    c = FAST_PATH_CASES[case]
    drafter = randomize(
        build_drafter(target, num_layers=2, layer_types=c["layer_types"], sliding_window=c["window"]), 17
    )
    ids, lm = make_batch(target, b=3, s=28, seed=2)
    am = torch.ones_like(ids)
    am[1, 21:] = 0
    lm[1, 21:] = 0
    lm[2, 1:20] = 0  # few valid anchors in row 2: padding blocks
    feats = target_features(target, ids, drafter.target_layer_ids, attention_mask=am)
    anchors = sample_anchors(lm, 14, attention_mask=am, generator=torch.Generator().manual_seed(6))
    anchors[0][0, 0] = 0  # an anchor at position 0: no context at all
    assert (~anchors[1]).any() and (anchors[0][anchors[1]] == 0).any()
    mods = loss_modules(target)
    ref_loss, ref_hits = reference_loss(
        drafter,
        input_ids=ids,
        loss_mask=lm,
        hidden_states=feats,
        anchors=anchors,
        gamma=4.0,
        attention_mask=am,
        **mods,
    )
    ref_grads = torch.autograd.grad(ref_loss, list(drafter.parameters()))
    out = dflash_loss(
        drafter,
        input_ids=ids,
        loss_mask=lm,
        hidden_states=feats,
        attention_mask=am,
        anchors=anchors,
        gamma=4.0,
        chunk_blocks=c["chunk"],
        group_blocks=c["group"],
        **mods,
    )
    grads = torch.autograd.grad(out.loss, list(drafter.parameters()))
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    for (name, _), g, r in zip(drafter.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, msg=name)
    torch.testing.assert_close(out.correct_per_position, ref_hits.sum(dim=(0, 1)).float())
    run = ref_hits[:, :, 1:].long().cumprod(-1).sum(-1)
    assert out.acceptance_sum.item() == ((1 + run) * anchors[1]).sum().item()


def test_anchors_of_a_seed_are_unchanged():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        b, s = 1 + trial % 4, 8 + 7 * trial
        lm = (torch.rand(b, s, generator=g) > 0.3).long()
        am = (torch.arange(s)[None] < torch.randint(s // 2, s + 1, (b, 1), generator=g)).long()
        for num in (1, 5, 64, 10**4):
            got = sample_anchors(lm, num, attention_mask=am, generator=torch.Generator().manual_seed(trial))
            want = reference_sample_anchors(
                lm, num, attention_mask=am, generator=torch.Generator().manual_seed(trial)
            )
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_loss_draws_the_same_anchors_as_sample_anchors(target):
    drafter = randomize(build_drafter(target, num_layers=1), 19)
    ids, lm = make_batch(target, b=2, s=30)
    feats = target_features(target, ids, drafter.target_layer_ids)
    kw = dict(input_ids=ids, loss_mask=lm, hidden_states=feats, gamma=4.0, **loss_modules(target))
    with torch.no_grad():
        drawn = dflash_loss(drafter, num_anchors=9, generator=torch.Generator().manual_seed(3), **kw)
        given = dflash_loss(
            drafter, anchors=sample_anchors(lm, 9, generator=torch.Generator().manual_seed(3)), **kw
        )
        other = dflash_loss(drafter, num_anchors=9, generator=torch.Generator().manual_seed(4), **kw)
    assert drawn.loss.item() == given.loss.item() and drawn.loss.item() != other.loss.item()
    assert drawn.kept_blocks.item() == 18


def test_activation_budget_chooses_chunks_without_changing_the_result(target):
    drafter = randomize(build_drafter(target, num_layers=2), 23)
    ids, lm = make_batch(target, b=2, s=32)
    feats = target_features(target, ids, drafter.target_layer_ids)
    per_block = activation_bytes_per_block(drafter, vocab_size=VOCAB, context_len=32)
    assert per_block > 0
    assert (
        auto_chunk_blocks(drafter, batch=2, num_blocks=20, context_len=32, vocab_size=VOCAB, budget_mb=1e6)
        is None
    )
    tight = 2 * per_block * 3 / 2**20  # room for three blocks of two rows
    assert (
        auto_chunk_blocks(drafter, batch=2, num_blocks=20, context_len=32, vocab_size=VOCAB, budget_mb=tight)
        == 3
    )
    anchors = sample_anchors(lm, 20, generator=torch.Generator().manual_seed(1))
    kw = dict(
        input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=anchors, gamma=4.0, **loss_modules(target)
    )
    results = []
    for budget in (None, tight):
        drafter.zero_grad()
        out = dflash_loss(drafter, chunk_blocks=None, activation_budget_mb=budget, **kw)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=1e-6, rtol=1e-6)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_bf16_step_is_close_to_fp32(target):
    drafter = randomize(
        build_drafter(
            target, num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=6
        ),
        29,
    )
    ids, lm = make_batch(target, b=2, s=32)
    feats = target_features(target, ids, drafter.target_layer_ids)
    anchors = sample_anchors(lm, 12, generator=torch.Generator().manual_seed(2))
    mods = loss_modules(target)
    kw = dict(input_ids=ids, loss_mask=lm, anchors=anchors, gamma=4.0)
    ref = dflash_loss(drafter, hidden_states=feats, **kw, **mods).loss
    low = drafter.to(torch.bfloat16)
    head = torch.nn.Linear(mods["lm_head"].in_features, VOCAB, bias=False).to(torch.bfloat16)
    head.weight.data.copy_(mods["lm_head"].weight)
    emb = torch.nn.Embedding(VOCAB, mods["embed_tokens"].embedding_dim).to(torch.bfloat16)
    emb.weight.data.copy_(mods["embed_tokens"].weight)
    out = dflash_loss(low, hidden_states=feats.to(torch.bfloat16), embed_tokens=emb, lm_head=head, **kw)
    out.loss.backward()
    assert abs(out.loss.item() - ref.item()) < 0.05 * ref.item()
    assert all(torch.isfinite(p.grad.float()).all() for p in low.parameters())


def test_auto_group_blocks_trades_hidden_keys_against_calls():
    bounds = ColumnBounds(hi=[10 * i for i in range(1, 21)], lo=[10 * i for i in range(1, 21)], seq_len=400)
    assert auto_group_blocks(bounds, 0, 20, block_size=8, pair_cost=10**9) == 1  # keys dominate
    assert auto_group_blocks(bounds, 0, 20, block_size=8, pair_cost=0) == 20  # calls dominate
    g = auto_group_blocks(bounds, 4, 20, block_size=8, pair_cost=64)
    assert 1 <= g <= 16 and g & (g - 1) == 0


def test_split_grouping_scores_no_own_keys_and_pays_per_group_key():
    # The split attention's groups score only their context slices (no own keys of the group's other
    # blocks): with the same costs it groups at least as coarsely as the block form, and a cost per
    # context key of every group's slice (its keys' gradients) merges groups further.
    bounds = ColumnBounds(hi=[300 + 3 * i for i in range(64)], lo=[290 + 3 * i for i in range(64)], seq_len=512)
    block = auto_group_blocks(bounds, 0, 64, block_size=8, pair_cost=512)
    split = auto_group_blocks(bounds, 0, 64, block_size=8, pair_cost=512, key_cost=0)
    costly_keys = auto_group_blocks(bounds, 0, 64, block_size=8, pair_cost=512, key_cost=10**6)
    assert block <= split < costly_keys == 64
    assert auto_group_blocks(bounds, 0, 64, block_size=8, pair_cost=10**9, key_cost=0) == 1


def test_long_contexts_take_the_split_attention_in_larger_groups_with_the_same_result(target):
    # Rows of 512 tokens, anchors in the last three quarters: contexts of 128-510 keys against 8 own keys per block,
    # so the CPU path takes the split attention, regrouped by its own cost into fewer groups than the block
    # form's; loss and gradients equal the dense reference.
    from dflash_flow.model.objective import _layer_spans, read_bounds

    drafter = randomize(build_drafter(target, num_layers=2), 23)
    ids, lm = make_batch(target, b=2, s=512, seed=4)
    lm[:, :128] = 0
    feats = target_features(target, ids, drafter.target_layer_ids)
    anchors = sample_anchors(lm, 24, generator=torch.Generator().manual_seed(9))
    bounds, _ = read_bounds(*anchors, 512)
    grouping = _layer_spans(drafter, bounds, 0, anchors[0].shape[1], None, 2)
    assert grouping.split == {FULL_ATTENTION}
    attn = drafter.layers[0].self_attn
    block_form = auto_group_blocks(bounds, 0, anchors[0].shape[1], block_size=drafter.block_size,
                                   pair_cost=2 * attn.num_heads * attn.head_dim)
    assert len(grouping.spans[FULL_ATTENTION]) < -(-anchors[0].shape[1] // block_form)  # fewer, larger groups
    mods = loss_modules(target)
    ref_loss, _hits = reference_loss(drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=anchors,
                                     gamma=4.0, **mods)
    ref_grads = torch.autograd.grad(ref_loss, list(drafter.parameters()))
    out = dflash_loss(drafter, input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=anchors, gamma=4.0, **mods)
    grads = torch.autograd.grad(out.loss, list(drafter.parameters()))
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-6, rtol=1e-6)
    for (name, _), g, r in zip(drafter.named_parameters(), grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-6, rtol=1e-5, msg=name)


def test_layer_checkpointing_gives_the_same_loss_and_gradients(target):
    drafter = randomize(build_drafter(target, num_layers=2), 31)
    ids, lm = make_batch(target, b=2, s=24)
    feats = target_features(target, ids, drafter.target_layer_ids)
    anchors = sample_anchors(lm, 10, generator=torch.Generator().manual_seed(5))
    kw = dict(
        input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=anchors, gamma=4.0, **loss_modules(target)
    )
    results = []
    for flag in (False, True):
        drafter.gradient_checkpointing = flag
        drafter.zero_grad()
        out = dflash_loss(drafter, **kw)
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad.clone() for p in drafter.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], atol=0, rtol=0)
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-7, rtol=1e-6)
