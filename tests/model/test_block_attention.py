"""The training layout's attention: the split (context + own block) kernel, its log-sum-exp form (context
and own blocks in separate kernel calls) and the grouped fallback, against plain sdpa over the dense mask,
values and gradients, in float64."""

from __future__ import annotations

import pytest
import torch
from model_testlib import MASK_ID, build_drafter, build_target

from dflash_flow.model.block_attention import _BlockAttention, _SplitAttention
from dflash_flow.model.layout import block_attention_mask
from dflash_flow.model.objective import ColumnBounds, block_layouts, group_spans, plan_blocks


def setup_case(layer_type, window, group_blocks, drop=False, seed=0, split=False):
    g = torch.Generator().manual_seed(seed)
    b, h, kv, s, n, bsz, d = 2, 4, 2, 30, 7, 4, 16  # heads and head_dim of the test target
    anchors = torch.tensor([[0, 3, 9, 12, 20, 26, 29], [2, 5, 7, 18, 25, 0, 0]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    ids = torch.randint(0, 50, (b, s), generator=g)
    am = torch.ones(b, s, dtype=torch.long)
    am[1, 27:] = 0  # padded context
    plan = plan_blocks(ids, am, anchors, keep, block_size=bsz, mask_token_id=MASK_ID, attention_mask=am)
    hi = torch.where(keep, anchors, -1).amax(0).tolist()
    lo = torch.where(keep, anchors, s).amin(0).tolist()
    bounds = ColumnBounds(hi=hi, lo=lo, seq_len=s)
    spans = {
        layer_type: group_spans(
            bounds, 0, n, group_blocks=group_blocks, layer_type=layer_type, sliding_window=window
        )
    }
    layout = block_layouts(
        plan,
        spans,
        0,
        n,
        layer_types=[layer_type],
        sliding_window=window,
        dtype=torch.float64,
        last_drops_first_slot=drop,
        split=split,
    )[0]
    q = torch.randn(b, h, n * bsz, d, generator=g, dtype=torch.float64)
    ck, cv = (torch.randn(b, kv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    ok, ov = (torch.randn(b, kv, n * bsz, d, generator=g, dtype=torch.float64) for _ in range(2))
    dense = block_attention_mask(
        anchors, keep, plan.context_valid, block_size=bsz, layer_type=layer_type, sliding_window=window
    )
    if drop:  # the last layer's layout: queries of slots 1..B-1 only
        q = q.view(b, h, n, bsz, d)[:, :, :, 1:].reshape(b, h, n * (bsz - 1), d)
        dense = dense.view(b, 1, n, bsz, -1)[:, :, :, 1:].reshape(b, 1, n * (bsz - 1), -1)
    return layout, [t.requires_grad_() for t in (q, ck, cv, ok, ov)], dense


def dense_attention(q, ck, cv, ok, ov, mask):
    groups = q.shape[1] // ck.shape[1]
    k = torch.cat([ck, ok], dim=2).repeat_interleave(groups, 1)
    v = torch.cat([cv, ov], dim=2).repeat_interleave(groups, 1)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=q.shape[-1] ** -0.5
    )


@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 5)])
@pytest.mark.parametrize("group_blocks,drop", [(1, False), (3, False), (7, False), (3, True)])
def test_split_kernel_and_grouped_fallback_equal_dense_attention(layer_type, window, group_blocks, drop):
    layout, inputs, dense = setup_case(layer_type, window, group_blocks, drop)
    split_layout = setup_case(layer_type, window, group_blocks, drop, split=True)[0]
    assert split_layout.mask is None and split_layout.groups == layout.groups
    # Some queries see no context at all (anchor 0, padding blocks): their own block only.
    s = layout.mask.shape[-1] - layout.scratch
    assert not dense[:, 0, :, :s].any(dim=-1).all()
    weights = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = dense_attention(*inputs, dense)
    want_grads = torch.autograd.grad((want * weights).sum(), inputs)
    attn = build_drafter(build_target(), num_layers=1).layers[0].self_attn.double()
    for name, fn in (
        ("split", lambda *x: _BlockAttention.apply(*x, layout, x[0].shape[-1] ** -0.5)),
        ("log-sum-exp", lambda *x: _SplitAttention.apply(*x, layout, x[0].shape[-1] ** -0.5)),
        ("log-sum-exp, masks made per group", lambda *x: _SplitAttention.apply(*x, split_layout, x[0].shape[-1] ** -0.5)),
        ("grouped", lambda *x: attn.grouped_attention(*x, layout)),
    ):
        got = fn(*inputs)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10, msg=name)
        for i, (g, w) in enumerate(
            zip(torch.autograd.grad((got * weights).sum(), inputs), want_grads, strict=True)
        ):
            torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-10, msg=f"{name} grad {i}")


def test_groups_cover_only_visible_context():
    layout, _inputs, dense = setup_case("sliding_attention", 5, 2)
    s = layout.mask.shape[-1] - layout.scratch
    for q0, q1, lo, hi in layout.groups:
        # Everything the group's queries see lies inside [lo, hi); nothing outside is ever visible.
        seen = dense[:, 0, q0:q1, :s].any(dim=(0, 1)).nonzero().flatten()
        if len(seen):
            assert lo <= int(seen.min()) and int(seen.max()) < hi
    assert sum(hi - lo for *_q, lo, hi in layout.groups) < len(layout.groups) * s
    assert layout.mask.shape[1] == 1  # one mask for all heads


def test_cpu_training_path_takes_the_log_sum_exp_attention(monkeypatch):
    # The layouts carry the context-only masks, so DrafterAttention.attend_blocks (the training path that
    # test_objective's fast-path tests compare with the dense reference) runs _SplitAttention on CPU.
    from dflash_flow.model import block_attention

    layout, inputs, dense = setup_case("full_attention", None, 3, split=True)
    assert layout.has_context is not None and layout.mask is None
    calls = []
    real = block_attention._SplitAttention.apply
    monkeypatch.setattr(block_attention._SplitAttention, "apply", lambda *a: calls.append(1) or real(*a))
    attn = build_drafter(build_target(), num_layers=1).layers[0].self_attn.double()
    got = attn.attend_blocks(*inputs, layout)
    assert calls
    torch.testing.assert_close(got, dense_attention(*inputs, dense), atol=1e-12, rtol=1e-10)


def test_layouts_take_the_split_attention_where_contexts_are_long():
    from dflash_flow.model.layout import SPLIT_CONTEXT_RATIO, split_pays

    bsz = 8
    own = 4 * bsz  # groups of 4 blocks
    long_ctx = [(4 * i, 4 * i + 4, 0, int(SPLIT_CONTEXT_RATIO * own) + i) for i in range(4)]
    short_ctx = [(4 * i, 4 * i + 4, 0, own + i) for i in range(4)]
    assert split_pays(long_ctx, bsz) and not split_pays(short_ctx, bsz)
    # The test case's contexts are short: auto gives the mask layout for _BlockAttention.
    auto = setup_case("full_attention", None, 3, split=None)[0]
    assert not auto.split and auto.mask is not None


@pytest.mark.parametrize("layer_type,window", [("full_attention", None), ("sliding_attention", 5)])
def test_split_attention_joins_large_scores_without_overflow(layer_type, window):
    # Scores in the thousands (exp overflows float64 past 709): the own blocks' softmax is joined with the
    # context's log-sum-exp around their common maximum, so values and gradients stay those of dense sdpa.
    layout, inputs, dense = setup_case(layer_type, window, 3, split=True)
    with torch.no_grad():
        inputs[0].mul_(600.0)
        inputs[3].mul_(3.0)  # own keys: the own part holds the largest scores of some queries
    want = dense_attention(*inputs, dense)
    got = _SplitAttention.apply(*inputs, layout, inputs[0].shape[-1] ** -0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-8)
    weights = torch.randn(got.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    for g, w in zip(torch.autograd.grad((got * weights).sum(), inputs),
                    torch.autograd.grad((want * weights).sum(), inputs), strict=True):
        torch.testing.assert_close(g, w, atol=1e-8, rtol=1e-7)
