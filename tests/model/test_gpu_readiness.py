"""GPU readiness without a GPU (issue 41, docs/gpu.md): the CUDA paths found by reading the code, each
exercised here on the CPU where a faithful check exists. Real tiny models; no mocks of the code under test
(where a CUDA call is patched, it is torch's, to see what our code asks of it)."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from model_testlib import MASK_ID, build_drafter, build_target
from transformers import Qwen3Config

from dflash_flow.model.drafter_config import FULL_ATTENTION
from dflash_flow.model.drafter_layers import DrafterAttention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models on a shared 2-core box: one intra-op thread

# --------------------------------------------------------------------------------- 1. the GPU attention path


def _gqa_drafter(hidden=64, heads=8, kv=2, head_dim=16, layers=2, vocab=128, block=16, device="cpu"):
    from dflash_flow.model.trainer import DrafterShape, build_drafter

    target = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=8,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         max_position_embeddings=8192, tie_word_embeddings=False)
    shape = DrafterShape(num_layers=layers, block_size=block, mask_token_id=vocab - 1)
    return target, build_drafter(target, shape, seed=0, device=device, dtype=torch.float32)


def _saved_bytes(fn, *, known: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages ``fn``'s autograd graph saves for the backward, other than ``known``'s
    (parameters, inputs made before it)."""
    old = {t.untyped_storage().data_ptr() for t in known}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in old and t.device.type != "meta":
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def test_the_gpu_attention_path_saves_what_the_activation_budget_counts(monkeypatch):
    """The path CUDA takes (``grouped_attention``: SDPA per group), forced on the CPU: the chunk of the longest
    contexts, sized under an activation budget, saves at most 1.5x that budget for its backward. It saved 2.4x
    (4.4x at head_dim 64, 2,048 tokens) when groups were sized by the CPU's cost, each copying its context with
    the KV heads repeated 4x (SDPA shares them: ``enable_gqa``), and the budget did not count the copies
    (review finding 1)."""
    from dflash_flow.model.blockplan import anchor_candidates, plan_blocks
    from dflash_flow.model.layout import auto_chunk_blocks, read_bounds
    from dflash_flow.model.objective import _chunk_terms, _layer_spans

    monkeypatch.setattr(DrafterAttention, "splits_on", lambda self, device: False)
    torch.manual_seed(0)
    target, drafter = _gqa_drafter(head_dim=32)
    b, s, anchors_per_row = 4, 1024, 128
    ids = torch.randint(0, 120, (b, s))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :128] = 0
    hidden = torch.randn(b, s, len(drafter.target_layer_ids) * 64)
    anchors, keep, _ = anchor_candidates(mask, anchors_per_row, attention_mask=None,
                                         generator=torch.Generator().manual_seed(1))
    bounds, _ = read_bounds(anchors, keep, s)
    plan = plan_blocks(ids, mask, anchors, keep, block_size=16, mask_token_id=127, gamma=7.0)
    embed = torch.nn.Embedding(128, 64)
    head = torch.nn.Linear(64, 128, bias=False)
    for m in (embed, head):
        m.requires_grad_(False)
    budget_mb = 32.0
    step = auto_chunk_blocks(drafter, batch=b, num_blocks=anchors_per_row, context_len=s, vocab_size=128,
                             budget_mb=budget_mb)
    assert step is not None and 4 <= step < anchors_per_row, step
    context_kv = drafter.training_context(hidden)
    start = anchors_per_row - step  # the last chunk: the longest contexts
    grouping = _layer_spans(drafter, bounds, start, anchors_per_row, None, b)
    known = [*drafter.parameters(), *embed.parameters(), *head.parameters(), hidden, *context_kv,
             *(getattr(plan, f.name) for f in plan.__attrs_attrs__ if getattr(plan, f.name) is not None)]
    saved = _saved_bytes(lambda: _chunk_terms(drafter, head, embed, plan, start, anchors_per_row, grouping, *context_kv), known=known)
    budget = budget_mb * 2**20
    assert saved <= 1.5 * budget, f"a chunk chosen under {budget_mb} MB saves {saved / 2**20:.1f} MB"
    assert saved >= 0.3 * budget, f"the estimate is far above what is saved ({saved / 2**20:.1f} MB): chunks too small"


def test_the_gpu_grouping_at_the_recipe_shape_makes_few_groups_per_chunk():
    """At the Qwen3-8B recipe shape (5-layer drafter, 4 rows x 3,072 tokens, 512 anchors, B = 16) the path CUDA
    takes groups a chunk into at most 16 attention groups, under the default activation budget and under
    pipelines/qwen3-8b.yaml's 24,000 MB (it made one group per block: 512 SDPA calls per layer)."""
    from dflash_flow.model.dflash2 import drafter_from_config
    from dflash_flow.model.layout import ColumnBounds, auto_chunk_blocks
    from dflash_flow.model.objective import _layer_spans
    from dflash_flow.model.trainer import DrafterShape, drafter_config

    target = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)
    config = drafter_config(target, DrafterShape(num_layers=5, block_size=16, mask_token_id=151669),
                            mask_token_id=151669)
    with torch.device("meta"):
        drafter = drafter_from_config(config).to(torch.bfloat16)
    drafter.train()
    n, s, rows = 512, 3072, 4
    # Anchors spread over the replies (a prompt of ~600 tokens): column n's largest and smallest anchor.
    hi = [min(s - 2, 600 + (n_ + 1) * (s - 600) // n + 4) for n_ in range(n)]
    lo = [max(600, h - 40) for h in hi]
    bounds = ColumnBounds(hi=hi, lo=lo, seq_len=s)
    for budget in (4096.0, 24000.0):
        chunk = auto_chunk_blocks(drafter, batch=rows, num_blocks=n, context_len=s, vocab_size=151936,
                                  budget_mb=budget) or n
        for start in range(0, n, chunk):
            grouping = _layer_spans(drafter, bounds, start, min(start + chunk, n), None, rows)
            groups = len(grouping.spans[FULL_ATTENTION])
            assert groups <= 16, f"budget {budget:.0f} MB: {groups} groups in the chunk of blocks {start}.."


@pytest.mark.parametrize("layer_type,window", [(FULL_ATTENTION, None), ("sliding_attention", 5)])
@pytest.mark.parametrize("group_blocks,drop", [(1, False), (3, False), (7, True)])
def test_the_gpu_path_masks_are_aligned_and_give_the_dense_attention(layer_type, window, group_blocks, drop):
    """The grouped SDPA path's layouts (``block_layouts(sdpa=True)``): one mask per group whose pointer and row
    stride are 16-element aligned (CUDA's memory-efficient kernel refuses a misaligned mask; views into one
    ``[scratch | context]`` mask were misaligned for block sizes and window starts off 16), with the values
    and gradients of plain SDPA over the dense mask, in float64, KV heads shared."""
    from dflash_flow.model.layout import ColumnBounds, block_attention_mask, block_layouts, group_spans
    from dflash_flow.model.objective import plan_blocks

    g = torch.Generator().manual_seed(0)
    b, h, kv, s, n, bsz, d = 2, 4, 2, 30, 7, 4, 16
    anchors = torch.tensor([[0, 3, 9, 12, 20, 26, 29], [2, 5, 7, 18, 25, 0, 0]])
    keep = torch.tensor([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    am = torch.ones(b, s, dtype=torch.long)
    am[1, 27:] = 0
    plan = plan_blocks(torch.randint(0, 50, (b, s), generator=g), am, anchors, keep, block_size=bsz,
                       mask_token_id=MASK_ID, attention_mask=am)
    bounds = ColumnBounds(hi=torch.where(keep, anchors, -1).amax(0).tolist(),
                          lo=torch.where(keep, anchors, s).amin(0).tolist(), seq_len=s)
    spans = {layer_type: group_spans(bounds, 0, n, group_blocks=group_blocks, layer_type=layer_type,
                                     sliding_window=window)}
    layout = block_layouts(plan, spans, 0, n, layer_types=[layer_type], sliding_window=window, dtype=torch.float64,
                           last_drops_first_slot=drop, sdpa=True)[0]
    assert layout.mask is None and len(layout.group_masks) == len(layout.groups)
    for m in layout.group_masks:
        assert m.stride(2) % 16 == 0 and m.storage_offset() == 0  # at the start of an allocation
    q = torch.randn(b, h, n * bsz, d, generator=g, dtype=torch.float64)
    ck, cv, ok, ov = (torch.randn(b, kv, size, d, generator=g, dtype=torch.float64) for size in (s, s, n * bsz, n * bsz))
    dense = block_attention_mask(anchors, keep, plan.context_valid, block_size=bsz, layer_type=layer_type,
                                 sliding_window=window)
    if drop:
        q = q.view(b, h, n, bsz, d)[:, :, :, 1:].reshape(b, h, n * (bsz - 1), d)
        dense = dense.view(b, 1, n, bsz, -1)[:, :, :, 1:].reshape(b, 1, n * (bsz - 1), -1)
    inputs = [t.requires_grad_() for t in (q, ck, cv, ok, ov)]
    k = torch.cat([ck, ok], dim=2).repeat_interleave(h // kv, 1)
    v = torch.cat([cv, ov], dim=2).repeat_interleave(h // kv, 1)
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=d**-0.5)
    attn = build_drafter(build_target(), num_layers=1).layers[0].self_attn.double()
    got = attn.attend_blocks(*inputs, layout)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    weights = torch.randn(want.shape, generator=g, dtype=torch.float64)
    for i, (gg, w) in enumerate(zip(torch.autograd.grad((got * weights).sum(), inputs),
                                    torch.autograd.grad((want * weights).sum(), inputs), strict=True)):
        torch.testing.assert_close(gg, w, atol=1e-12, rtol=1e-10, msg=f"grad {i}")


def test_the_gpu_path_trains_with_the_cpu_paths_loss_and_gradients(monkeypatch):
    """A whole DFlash loss through the grouped SDPA path (forced on the CPU, sliding and full layers, block size
    8, chunks under a budget) equals the CPU kernels' loss and gradients."""
    from dflash_flow.model.blockplan import sample_anchors
    from dflash_flow.model.objective import dflash_loss

    target = build_target()
    drafter = build_drafter(target, num_layers=2, layer_types=["sliding_attention", FULL_ATTENTION], sliding_window=6)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 95, (2, 96), generator=g)
    lm = torch.ones_like(ids)
    lm[:, :20] = 0
    with torch.no_grad():
        out = target(input_ids=ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)
    anchors = sample_anchors(lm, 24, generator=torch.Generator().manual_seed(5))
    kw = dict(input_ids=ids, loss_mask=lm, hidden_states=feats, anchors=anchors, gamma=4.0,
              embed_tokens=target.get_input_embeddings(), lm_head=target.lm_head)
    results = []
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(DrafterAttention, "splits_on", lambda self, device: False)
        loss = dflash_loss(drafter, chunk_blocks=7, **kw).loss
        results.append((loss.detach(), torch.autograd.grad(loss, list(drafter.parameters()))))
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-6, rtol=1e-6)
    for a, b_ in zip(results[1][1], results[0][1], strict=True):
        torch.testing.assert_close(a, b_, atol=1e-6, rtol=1e-5)


# --------------------------------------------------------------------------------- 5. gradients in fp32


def _bf16_trainer(grad_accum: int):
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter

    drafter = build_drafter(load_target_config("tiny-qwen3-8l"), DrafterShape(num_layers=1, block_size=4,
                            mask_token_id=511), seed=0, device="cpu", dtype=torch.bfloat16)
    head = load_shared_head("tiny-qwen3-8l", "cpu", torch.bfloat16)
    config = TrainerConfig(num_anchors=8, lr=1e-3, warmup_ratio=0.0, grad_accum=grad_accum)
    return DrafterTrainer(drafter, head, config, device="cpu", dtype=torch.bfloat16)


def _features(trainer, index: int):
    from dflash_flow.items import BatchMeta, TargetFeatures

    b, s = 2, 24
    g = torch.Generator().manual_seed(index)
    width = len(trainer.drafter.target_layer_ids) * trainer.drafter.config.hidden_size
    meta = BatchMeta(epoch=0, index=index, bucket=0, lengths=[s] * b, real_tokens=b * s, padded_tokens=b * s,
                     num_samples=b, sample_ids=[index, 100 + index], total_batches=64)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :4] = 0
    return TargetFeatures(input_ids=torch.randint(0, 500, (b, s), generator=g), loss_mask=mask,
                          attention_mask=torch.ones(b, s, dtype=torch.long),
                          hidden_states=torch.randn(b, s, width, generator=g), meta=meta,
                          target_layer_ids=list(trainer.drafter.target_layer_ids))


def _step_gradient(trainer) -> list[torch.Tensor]:
    """The gradient the next update would use, per parameter: the fp32 masters' where they hold it."""
    opt = trainer.optimizer
    return [(m.grad if m.grad is not None else p.grad).double() for p, m in zip(opt.params, opt.masters, strict=True)]


def test_bf16_micro_batch_gradients_are_summed_in_fp32():
    """A bf16 drafter over 8 micro-batches of one step: the step's gradient equals the fp32 sum of the 8
    micro-batch gradients (each computed in bf16, alone) to fp32 rounding. Summed in the bf16 ``.grad`` they
    drifted ~1e-3 relative (review finding 5: the fp32 masters protected the update, not the gradient)."""
    accum = 9  # no update inside the 8 micro-batches
    trainer = _bf16_trainer(accum)
    for i in range(8):
        assert trainer.train_batch(_features(trainer, i), anchor_seed=100 + i) is None
    got = _step_gradient(trainer)
    want = None
    for i in range(8):  # each micro-batch alone, from the same weights
        alone = _bf16_trainer(accum)
        alone.train_batch(_features(alone, i), anchor_seed=100 + i)
        grads = _step_gradient(alone)
        want = grads if want is None else [a + b for a, b in zip(want, grads, strict=True)]
    worst = max(float((g - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want, strict=True))
    assert worst < 1e-5, f"step gradient off the fp32 sum by {worst:.2e} relative"
    assert all(p.grad is None for p in trainer.optimizer.params)  # nothing accumulates in bf16


# --------------------------------------------------------------------------------- 6. host syncs


_READS = ("tolist", "item", "cpu", "__float__", "__int__", "__bool__", "__index__")


@pytest.mark.parametrize("objective", ["dflash", "variable_prefix"])
def test_train_batch_reads_the_device_once_per_optimizer_step(monkeypatch, objective):
    """Our code in ``train_batch`` reads tensors back to Python (a device->host sync on a GPU, where the GPU idles
    while Python plans the next micro-batch) at most once per optimizer step: anchors and their bounds come from
    the batch's host rows, the statistics are summed on the device and read with the gradient norm. It read
    twice per micro-batch and twice more per step (review finding 6). (torch's own reads of host tensors, as
    AdamW's step counters, are not ours: counted are calls made from dflash_flow's modules.)"""
    from dflash_flow.model.strategies import OBJECTIVES

    trainer = _bf16_trainer(4)
    if objective == "variable_prefix":
        from dflash_flow.model.blockplan import PrefixPrior

        trainer.objective.prefix_prior = PrefixPrior(weight_base=0.9, min_length=1, max_length=None)
    assert objective in OBJECTIVES
    batches = [_features(trainer, i) for i in range(8)]
    reads: list[str] = []
    for name in _READS:
        real = getattr(torch.Tensor, name)

        def counted(self, *args, _real=real, _name=name, **kw):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("dflash_flow"):
                reads.append(f"{_name} from {caller}")
            return _real(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    steps = [trainer.train_batch(batch, anchor_seed=100 + i) for i, batch in enumerate(batches)]
    monkeypatch.undo()
    assert [s is not None for s in steps] == [False, False, False, True] * 2
    assert len(reads) <= 2, reads
    assert all(math.isfinite(steps[3][k]) for k in ("loss", "grad_norm", "accuracy", "sim_accept_len"))


# --------------------------------------------------------------------------------- 12. the target's load


def test_a_target_loaded_partway_keeps_no_lm_head_and_gives_the_same_features(tmp_path):
    """``load_target(num_layers=k)`` of a preset and of a model directory: no LM head (1.24 GB at the recipe shape,
    never used for features) and no final norm are left, and the features equal the whole model's (review
    finding 12)."""
    from dflash_flow.model.features import TargetFeatureExtractor, backbone
    from dflash_flow.model.target import load_target

    whole = load_target("tiny-qwen3-8l")
    whole.save_pretrained(tmp_path / "target")
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(0))
    attn = torch.ones_like(ids)
    want = TargetFeatureExtractor(whole, [1, 3])(ids, attn)
    for spec in ("tiny-qwen3-8l", str(tmp_path / "target")):
        part = load_target(spec, num_layers=4)
        assert part.get_output_embeddings() is None, spec
        assert isinstance(backbone(part).norm, torch.nn.Identity), spec
        assert sum(p.numel() for p in part.parameters()) < sum(p.numel() for p in whole.parameters())
        torch.testing.assert_close(TargetFeatureExtractor(part, [1, 3])(ids, attn), want)
    assert load_target("tiny-qwen3-8l", num_layers=8).get_output_embeddings() is not None  # the whole depth: kept


# --------------------------------------------------------------------------------- 13. flash-attn's preconditions


@pytest.mark.parametrize("capability,dtype,want", [
    ((9, 0), torch.bfloat16, "flash_attention_2"),
    ((8, 6), torch.float16, "flash_attention_2"),
    ((8, 0), None, "flash_attention_2"),  # the device's default dtype: bf16
    ((7, 0), torch.bfloat16, "sdpa"),  # a V100: flash-attn 2 needs sm80
    ((7, 5), torch.float16, "sdpa"),  # a T4
    ((9, 0), torch.float32, "sdpa"),  # flash-attn has no fp32 kernel
])
def test_flash_attention_is_chosen_only_where_it_runs(monkeypatch, capability, dtype, want):
    """The target's attention defaults to flash_attention_2 only on sm80+ GPUs in 16-bit dtypes: it was chosen
    whenever the package imported, and failed at the first forward on older GPUs or in float32 (review finding
    13). The installed package and the GPU are torch's / Python's view here, patched: no GPU on this machine."""
    import types

    from dflash_flow.model.device import default_attn_implementation

    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert default_attn_implementation("cuda:0", dtype) == want
    assert default_attn_implementation("cpu", dtype) == "sdpa"
