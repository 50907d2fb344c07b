"""GPU benchmark and first-GPU check: the real pipeline with a Qwen3-8B-shaped target and a 5-layer B = 16
drafter on one GPU, and every check of the CUDA paths that a CPU cannot make (docs/gpu.md, issue 41).

    python bench/gpu.py                      # on a CUDA machine (a few minutes on one H100 / H200)
    python bench/gpu.py --tiny --device cpu  # the same code path, tiny models, on a CPU (smoke test)

No network, no MLflow: the target has random weights drawn on the GPU (a config preset with
``init_device: cuda``), the data are synthetic token ids with a chat-like length distribution, and the
pipeline (TokenizedSource -> Bucketer -> Interleaver -> Padder x2 -> TargetForward -> DrafterStep) runs
in this process for a fixed number of optimizer steps, rows padded to multiples of 64 as the recipes do.

What it reports, each figure over a steady-state window (after ``--warmup`` optimizer steps, up to the last
step; setup, model builds and the final export left out): target tokens/s, the drafter's seconds per step,
the fraction of the window the drafter waited for data, the GPU's busy fraction (NVML), the peak allocated
and reserved GPU memory (peaks reset at the window's start), each stage's setup seconds; then the checks
(``checks``: each with its review finding, its value, ok / failed / n/a) and what the first GPU run must
look at by eye (``must_check``): the CUDA-path correctness of loss and gradients (CPU fp32 against the device
in bf16), the SDPA kernel the drafter's attention gets, the pipeline's step against the target and the
drafter each alone (streams), ... The exit status is 1 when a check failed. Results: ``bench/results/gpu.json``.

It needs only the machine's own torch and transformers plus this package's pure-Python dependencies
(attrs, cattrs, pyyaml, numpy, safetensors): ``pip install --no-deps -e .`` and, where they are missing,
their wheels (``pip download attrs cattrs -d wheels``, then ``pip install --no-index --no-deps wheels/*``).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN3_8B = {  # the Qwen3-8B architecture (random weights)
    "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "tie_word_embeddings": False, "seed": 0,
}
TINY = {
    "model_type": "qwen3", "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "tie_word_embeddings": False, "seed": 0,
}
PAD = 64  # the recipes' pad_to_multiple


class Shape:
    """The workload: the recipe's (Qwen3-8B target, 5-layer drafter, 4 x 3,072 tokens, 512 anchors) or a tiny one."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.arch = TINY if tiny else QWEN3_8B
        self.vocab = self.arch["vocab_size"]
        self.max_len = 512 if tiny else 3072
        self.rows = 4
        self.layer_ids = [1, 2, 4, 5] if tiny else [1, 9, 17, 25, 33]
        self.draft_layers = 2 if tiny else 5
        self.anchors = 64 if tiny else 512
        self.block_size = 16

    def target(self, device: str) -> dict:
        return {**self.arch, "init_device": device if device.startswith("cuda") else "cpu"}

    def dtype(self, device: str) -> str:
        return "float32" if device == "cpu" else "bfloat16"


class Checks:
    """What this run checked (``ok``: True, False, or None where it does not apply here) and what a person must
    look at on the first GPU run."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.must: list[str] = []

    def add(self, finding: str, name: str, ok: bool | None, value, expect: str) -> None:
        self.items.append({"finding": finding, "check": name, "ok": ok, "value": value, "expect": expect})

    def look(self, finding: str, text: str) -> None:
        self.must.append(f"[{finding}] {text}")

    @property
    def failed(self) -> list[dict]:
        return [c for c in self.items if c["ok"] is False]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(torch.device(device))


def synthetic_data(path: Path, n: int, vocab: int, max_len: int, seed: int = 0) -> Path:
    """Token ids below the mask id with chat-like lengths (log-normal, median ~600 at max_len 3072) and
    the second part of each sample supervised (the assistant reply)."""
    rng = np.random.default_rng(seed)
    scale = max_len / 3072
    lengths = np.clip(rng.lognormal(mean=6.4, sigma=0.6, size=n) * scale, 32, max_len).astype(int)
    with open(path, "w") as f:
        for length in lengths:
            ids = rng.integers(0, vocab - 1, size=int(length)).tolist()
            prompt = int(rng.integers(8, max(9, length // 3)))
            f.write(json.dumps({"input_ids": ids, "loss_mask": [0] * prompt + [1] * (int(length) - prompt)}) + "\n")
    return path


# ---------------------------------------------------------------------------------------------- correctness


def correctness(device: str, checks: Checks) -> dict:
    """DFlash loss and its gradients for one batch on ``device`` in bf16 (fp32 on a CPU) against the CPU in
    fp32, same weights and anchors: the loss within 2%, the gradient of the fusion layer (``fc``, the first
    parameter the loss reaches through every layer's backward) at a cosine of at least 0.99."""
    import torch

    from dflash_flow.model.blockplan import sample_anchors
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.objective import dflash_loss
    from dflash_flow.model.target import TargetFeatureExtractor, load_target, load_target_config
    from dflash_flow.model.trainer import DrafterShape, build_drafter

    spec = {**TINY, "seed": 3}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"] - 1, (2, 96), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 40:] = 1
    attn = torch.ones_like(ids)
    runs = []
    for dev, dtype in (("cpu", torch.float32), (device, torch.bfloat16 if device.startswith("cuda") else torch.float32)):
        target = load_target(spec, device=dev, dtype=dtype)
        drafter = build_drafter(load_target_config(spec), DrafterShape(num_layers=2, block_size=8,
                                mask_token_id=TINY["vocab_size"] - 1), seed=1, device=dev, dtype=dtype)
        head = load_shared_head(spec, dev, dtype)
        feats = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids.to(dev), attn.to(dev))
        anchors = sample_anchors(mask, 24, attention_mask=attn, generator=torch.Generator().manual_seed(5))
        out = dflash_loss(drafter, embed_tokens=head.embed_tokens, lm_head=head.lm_head, input_ids=ids.to(dev),
                          loss_mask=mask.to(dev), hidden_states=feats, attention_mask=attn.to(dev),
                          gamma=4.0, anchors=(anchors[0].to(dev), anchors[1].to(dev)))
        out.loss.backward()
        runs.append((f"{dev}/{str(dtype).removeprefix('torch.')}", float(out.loss),
                     drafter.fc.weight.grad.detach().float().cpu().flatten()))
    (_, ref, ref_grad), (_, got, got_grad) = runs
    rel = abs(got - ref) / abs(ref)
    cosine = float(torch.nn.functional.cosine_similarity(ref_grad, got_grad, dim=0))
    ok = rel <= 2e-2 and cosine >= 0.99
    checks.add("3", "loss and fc.weight.grad on the device (bf16) against the CPU (fp32)", ok,
               {"loss_rel_diff": rel, "grad_cosine": cosine}, "loss within 2%, gradient cosine >= 0.99")
    return {"reference": runs[0][:2], "measured": runs[1][:2], "rel_diff": rel, "grad_cosine": cosine,
            "tolerance": 2e-2, "min_cosine": 0.99, "ok": ok}


# ---------------------------------------------------------------------------------------------- attention


def attention_check(device: str, shape: Shape, checks: Checks) -> dict:
    """The drafter's training attention on ``device`` at the workload's shape (finding 1): the path it takes, the
    SDPA kernel CUDA gives a group (the memory-efficient or cuDNN one, KV heads shared; the math fallback
    materializes every score), the groups per chunk, and one layer's attention forward + backward timed per
    group size against the grouped SDPA path's cost model (``layout.SDPA_GROUP_FIXED_COST``)."""
    import torch

    from dflash_flow.model.blockplan import anchor_candidates, plan_blocks
    from dflash_flow.model.layout import auto_chunk_blocks, block_layouts, group_spans, read_bounds, uses_sdpa
    from dflash_flow.model.objective import _layer_spans
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, build_drafter

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    drafter = build_drafter(load_target_config(shape.arch), DrafterShape(
        num_layers=shape.draft_layers, block_size=shape.block_size, mask_token_id=shape.vocab - 1,
        target_layer_ids=shape.layer_ids), seed=0, device=device, dtype=dtype)
    b, s, n = shape.rows, shape.max_len, shape.anchors
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, : s // 5] = 0
    ids = torch.randint(0, shape.vocab - 1, (b, s), generator=g)
    anchors, keep, _ = anchor_candidates(mask, n, attention_mask=None, generator=g)
    bounds, _ = read_bounds(anchors, keep, s)
    chunk = auto_chunk_blocks(drafter, batch=b, num_blocks=n, context_len=s, vocab_size=shape.vocab,
                              budget_mb=4096.0) or n
    start = max(0, n - chunk)  # the last chunk: the longest contexts
    grouping = _layer_spans(drafter, bounds, start, n, None, b)
    groups = len(grouping.spans["full_attention"])
    result = {"path": "grouped SDPA" if uses_sdpa(drafter) else "CPU kernels", "chunk_blocks": chunk,
              "groups_in_last_chunk": groups}
    checks.add("1", "attention groups in a chunk (grouped SDPA path)", groups <= 16 if uses_sdpa(drafter) else None,
               groups, "<= 16")
    attn = drafter.layers[0].self_attn
    plan = plan_blocks(ids.to(device), mask.to(device), anchors.to(device), keep.to(device), block_size=shape.block_size,
                       mask_token_id=shape.vocab - 1)
    h, kv, d = attn.num_heads, attn.num_kv_heads, attn.head_dim
    q = torch.randn(b, h, chunk * shape.block_size, d, device=device, dtype=dtype, requires_grad=True)
    ck, cv = (torch.randn(b, kv, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    ok_, ov = (torch.randn(b, kv, chunk * shape.block_size, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(2))
    if device.startswith("cuda"):
        from torch.backends import cuda as backends

        layout = block_layouts(plan, grouping.spans, start, n, layer_types=["full_attention"], sliding_window=None,
                               dtype=dtype, sdpa=True)[0]
        q0, q1, lo, hi = layout.groups[-1]
        k0, k1 = layout.own_keys(q0, q1)
        kg = torch.cat([ok_[:, :, k0:k1], ck[:, :, lo:hi]], dim=2).detach()
        params = backends.SDPAParams(q[:, :, q0:q1].detach(), kg, kg, layout.group_masks[-1], 0.0, False, True)
        efficient = bool(backends.can_use_efficient_attention(params, True))  # debug: says why not
        cudnn_check = getattr(backends, "can_use_cudnn_attention", None)
        cudnn = bool(cudnn_check(params, False)) if cudnn_check is not None else False
        result.update(efficient_attention=efficient, cudnn_attention=cudnn)
        checks.add("1", "SDPA kernel for a masked GQA group", efficient or cudnn, {"efficient": efficient, "cudnn": cudnn},
                   "memory-efficient or cuDNN (not the math fallback)")
    timings = {}
    sizes = sorted({1, 4, 16, 64, max(1, -(-chunk // groups))} if not shape.tiny else {4, 16})
    for size in sizes:
        spans = {"full_attention": group_spans(bounds, start, n, group_blocks=size, layer_type="full_attention",
                                               sliding_window=None)}
        layout = block_layouts(plan, spans, start, n, layer_types=["full_attention"], sliding_window=None,
                               dtype=dtype, sdpa=True)[0]
        best = math.inf
        for _ in range(1 if shape.tiny else 3):
            _sync(device)
            t0 = time.perf_counter()
            out = attn.grouped_attention(q, ck, cv, ok_, ov, layout)
            torch.autograd.grad(out.float().square().mean(), (q, ck, cv, ok_, ov), allow_unused=True)
            _sync(device)
            best = min(best, time.perf_counter() - t0)
        timings[size] = best
    chosen = max(1, -(-chunk // groups))
    fastest = min(timings, key=timings.get)
    result.update(seconds_per_group_size=timings, chosen_group_blocks=chosen, fastest_group_blocks=fastest)
    if device.startswith("cuda") and chosen in timings:
        ok = timings[chosen] <= 1.25 * timings[fastest]
        checks.add("1", "the cost model's group size against the fastest measured", ok,
                   {"chosen": chosen, "fastest": fastest, "ratio": timings[chosen] / timings[fastest]},
                   "within 1.25x of the fastest (else refit layout.SDPA_GROUP_FIXED_COST)")
    return result


# ---------------------------------------------------------------------------------------------- alone


def alone(device: str, shape: Shape, checks: Checks) -> dict:
    """The target's forward and the drafter's micro-batch each alone on ``device``, at the workload's shape (one
    full batch of 4 x max_len tokens): the yardsticks the pipeline's step is compared with (streams)."""
    import torch

    from dflash_flow.items import BatchMeta, TargetFeatures
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.strategies import TrainerConfig
    from dflash_flow.model.target import (
        TargetFeatureExtractor,
        load_target,
        load_target_config,
        resolve_dtype,
    )
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, build_drafter

    dtype = resolve_dtype(shape.dtype(device), device)
    spec = shape.target(device)
    b, s = shape.rows, shape.max_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, shape.vocab - 1, (b, s), generator=g)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, : s // 5] = 0
    attn = torch.ones(b, s, dtype=torch.long)
    if device.startswith("cuda"):
        ids, mask, attn = ids.pin_memory(), mask.pin_memory(), attn.pin_memory()
    target = load_target(spec, device=device, dtype=dtype, num_layers=max(shape.layer_ids) + 1)
    extractor = TargetFeatureExtractor(target, shape.layer_ids)
    feats = extractor(ids, attn)
    reps = 1 if shape.tiny else 3
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        feats = extractor(ids, attn)
    _sync(device)
    forward_s = (time.perf_counter() - t0) / reps
    del target, extractor
    drafter = build_drafter(load_target_config(spec), DrafterShape(
        num_layers=shape.draft_layers, block_size=shape.block_size, mask_token_id=shape.vocab - 1,
        target_layer_ids=shape.layer_ids), seed=0, device=device, dtype=dtype)
    head = load_shared_head(spec, device, dtype)
    trainer = DrafterTrainer(drafter, head, TrainerConfig(num_anchors=shape.anchors, grad_accum=4, gamma=7.0),
                             device=device, dtype=dtype)

    def batch(i: int) -> TargetFeatures:
        meta = BatchMeta(epoch=0, index=i, bucket=0, lengths=[s] * b, real_tokens=b * s, padded_tokens=b * s,
                         num_samples=b, sample_ids=list(range(b)), total_batches=1000)
        return TargetFeatures(meta=meta, input_ids=ids, loss_mask=mask, attention_mask=attn, hidden_states=feats,
                              target_layer_ids=shape.layer_ids)

    trainer.train_batch(batch(0), anchor_seed=0)  # the first micro-batch builds the optimizer
    micro = 2 if shape.tiny else 8
    _sync(device)
    t0 = time.perf_counter()
    for i in range(1, micro + 1):
        trainer.train_batch(batch(i), anchor_seed=i)
    _sync(device)
    step_s = (time.perf_counter() - t0) / micro
    result = {"target_forward_s": forward_s, "drafter_micro_batch_s": step_s}
    if device.startswith("cuda"):  # finding 6: the drafter's device->host syncs, every one torch sees
        import warnings

        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for i in range(micro + 1, 2 * micro + 1):  # grad_accum 4: two optimizer steps
                    trainer.train_batch(batch(i), anchor_seed=i)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        syncs = [str(w.message).splitlines()[0] for w in seen if "synchroniz" in str(w.message)]
        per_step = len(syncs) / (micro // 4)
        result.update(syncs_per_optimizer_step=per_step, sync_warnings=syncs[:6])
        checks.add("6", "device->host syncs per optimizer step of the drafter (set_sync_debug_mode)", per_step <= 1,
                   per_step, "<= 1 (the step's one read of the norm and the statistics)")
    else:
        checks.add("6", "device->host syncs per optimizer step of the drafter", None, None,
                   "<= 1 on a GPU (tests/model/test_gpu_readiness.py counts our reads on the CPU)")
    if device.startswith("cuda"):  # finding 11: a checkpoint's optimizer state adds no GPU copy of the masters
        dev = torch.device(device)
        torch.cuda.synchronize(dev)
        base = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        state = trainer.optimizer_state()
        result["checkpoint_state_s"] = time.perf_counter() - t0
        rise = (torch.cuda.max_memory_allocated(dev) - base) / 2**30
        result["checkpoint_peak_rise_gib"] = rise
        on_host = all(not t.is_cuda for t in _tensors(state))
        checks.add("11", "GPU memory a checkpoint's optimizer state adds; its tensors on the host", rise < 1.0 and on_host,
                   {"rise_gib": rise, "all_on_host": on_host}, "< 1 GiB, all on the host")
        del state
    result["trainer"] = trainer  # the later checks reuse it (dropped before the JSON)
    return result


def _tensors(tree):
    import torch

    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, dict):
        for v in tree.values():
            yield from _tensors(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _tensors(v)


# ---------------------------------------------------------------------------------------------- pipeline


class _Window:
    """The steady-state window, from the sampler's snapshots: it opens at the first snapshot with ``warmup``
    optimizer steps done (GPU memory peaks reset there) and ends at the last one that saw a new step."""

    def __init__(self, device: str, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.start = self.end = None
        self.steps = -1
        self.peak_allocated = self.peak_reserved = None

    def __call__(self, snap) -> None:
        import torch

        dr = snap.stages.get("drafter")
        if dr is None:
            return
        steps = int(dr.metric("steps") or 0)
        cuda = self.device.startswith("cuda")
        if self.start is None:
            if steps >= self.warmup:
                self.start, self.steps = snap, steps
                if cuda:
                    torch.cuda.reset_peak_memory_stats(torch.device(self.device))
            return
        if steps > self.steps:
            self.end, self.steps = snap, steps
            if cuda:
                self.peak_allocated = torch.cuda.max_memory_allocated(torch.device(self.device)) / 2**30
                self.peak_reserved = torch.cuda.max_memory_reserved(torch.device(self.device)) / 2**30


class _GpuSampler:
    """GPU utilisation sampled every 0.2 s through NVML when it is available (empty otherwise), with times."""

    def __init__(self, device: str) -> None:
        self.values: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml  # noqa: F401 - optional
            import torch

            self._util = lambda: float(torch.cuda.utilization(torch.device(device)))
            self._util()
        except Exception:  # no NVML: no busy fraction
            self._util = None

    def __enter__(self):
        if self._util is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.values.append((time.monotonic(), self._util()))

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def mean(self, start: float, end: float) -> float | None:
        inside = [v for t, v in self.values if start <= t <= end]
        return sum(inside) / len(inside) / 100 if inside else None


def _window_mean(start, end, stage: str, metric: str) -> float | None:
    """Mean of a summary metric over the observations made inside the window."""
    a = start.stages[stage].metric(metric) or {}
    b = end.stages[stage].metric(metric) or {}
    count = (b.get("count") or 0) - (a.get("count") or 0)
    return ((b.get("total") or 0.0) - (a.get("total") or 0.0)) / count if count else None


def run_pipeline(device: str, steps: int, warmup: int, shape: Shape, workdir: Path) -> dict:
    import torch

    from dflash_flow.app import model_services
    from dflash_flow.core import Graph, Pipeline

    data = synthetic_data(workdir / "data.jsonl", 64 if shape.tiny else 1200, shape.vocab, shape.max_len)
    g = Graph(name="gpu-bench", seed=42, output_dir=str(workdir / "out"))
    g.runtime.stall_timeout_s = 900
    g.sections["model"] = {"target": shape.target(device), "target_layer_ids": shape.layer_ids,
                           "num_draft_layers": shape.draft_layers, "block_size": shape.block_size,
                           "mask_token_id": shape.vocab - 1}
    g.add("source", "TokenizedSource", config={"paths": [str(data)], "max_length": shape.max_len, "cache_dir": None,
                                              "vocab_size": shape.vocab})
    g.add("bucketer", "Bucketer", inputs="source", config={
        "max_tokens": shape.rows * shape.max_len, "max_batch_size": shape.rows, "num_buckets": 4, "epochs": 50,
        "pad_to_multiple": PAD})
    g.add("interleaver", "Interleaver", inputs="bucketer", config={"max_batches": steps + warmup})
    g.add("padder", "Padder", inputs="interleaver", replicas=2, config={"pad_to_multiple": PAD})
    threads = {"torch_threads": 1} if device == "cpu" else {}  # two model threads on a small CPU: one core each
    g.add("target", "TargetForward", inputs="padder", devices=device, config={"dtype": shape.dtype(device), **threads})
    g.add("drafter", "DrafterStep", inputs="target", devices=device, ordered=True, config={
        "num_anchors": shape.anchors, "lr": 6e-4, "gamma": 7.0, "dtype": shape.dtype(device), **threads})
    g.add("sink", "Discard", inputs="drafter")
    pipeline = Pipeline(g, services=model_services(g), check_devices=device.startswith("cuda"))
    window = _Window(device, warmup)
    sub = pipeline.sampler.subscribe(window, 0.05, owner="gpu-bench")
    t0 = time.perf_counter()
    with _GpuSampler(device) as nvml:
        pipeline.run()
    wall = time.perf_counter() - t0
    pipeline.sampler.unsubscribe(sub)
    snap = pipeline.snapshot()
    setup = {name: max(r.setup_s for r in st.replicas) for name, st in snap.stages.items()}
    result = {"steps": int(snap.stages["drafter"].metric("steps") or 0), "wall_s": wall, "setup_s": setup}
    start, end = window.start, window.end
    if start is None or end is None:
        result["window"] = None
        return result
    span = max(end.time - start.time, 1e-9)
    dr0, dr1 = start.stages["drafter"].replicas[0], end.stages["drafter"].replicas[0]
    tg0, tg1 = start.stages["target"], end.stages["target"]
    steps_in = window.steps - int(start.stages["drafter"].metric("steps") or 0)
    # micro-batches finished in the window (step_s is observed when one's compute ends, as steps counts steps)
    micro = int(((end.stages["drafter"].metric("step_s") or {}).get("count") or 0)
                - ((start.stages["drafter"].metric("step_s") or {}).get("count") or 0))
    tokens = float(tg1.metric("tokens") or 0) - float(tg0.metric("tokens") or 0)
    target_busy = sum(r1.busy_s - r0.busy_s for r0, r1 in zip(tg0.replicas, tg1.replicas, strict=True))
    trained = float(end.stages["drafter"].metric("tokens") or 0) - float(start.stages["drafter"].metric("tokens") or 0)
    result["window"] = {
        "seconds": span,
        "optimizer_steps": steps_in,
        "micro_batches": micro,
        "drafter_step_s": span / steps_in if steps_in else None,
        "drafter_micro_batch_s": span / micro if micro else None,
        "pipeline_tokens_per_s": trained / span,  # real tokens the drafter trained on
        # the target's own rate while it worked in the window (None: it had finished every batch before)
        "target_tokens_per_busy_s": tokens / target_busy if tokens and target_busy > 0 else None,
        "target_forward_s_mean": _window_mean(start, end, "target", "forward_s"),
        "target_busy_fraction": target_busy / span,
        "data_wait_fraction": (dr1.blocked_in_s - dr0.blocked_in_s) / span,
        "gpu_busy_fraction_nvml": nvml.mean(start.time, end.time),
        "peak_allocated_gib": window.peak_allocated,
        "peak_reserved_gib": window.peak_reserved,
    }
    if device.startswith("cuda"):
        result["window"]["setup_peak_allocated_gib"] = torch.cuda.max_memory_allocated(torch.device(device)) / 2**30
    return result


def pipeline_checks(device: str, pipe: dict, alone_: dict, checks: Checks) -> None:
    w = pipe.get("window")
    checks.add("3", "a steady-state window after the warm-up", w is not None and w["optimizer_steps"] > 0,
               None if w is None else w["optimizer_steps"], "> 0 optimizer steps inside it")
    checks.add("3", "setup time measured (the target's build)", pipe["setup_s"].get("target", 0.0) > 0,
               pipe["setup_s"].get("target"), "> 0 s")
    if w is None or not w["drafter_micro_batch_s"]:
        return
    both = alone_["target_forward_s"] + alone_["drafter_micro_batch_s"]
    ratio = w["drafter_micro_batch_s"] / both
    # One GPU: the target and the drafter share it, so a micro-batch of the pipeline takes at most about their sum
    # (less where they overlap); more means one waits for the other's queue (streams, finding 2).
    checks.add("2", "pipeline micro-batch against target forward + drafter micro-batch alone",
               ratio <= 1.15 if device.startswith("cuda") else None, ratio, "<= 1.15 on one GPU")
    if w["peak_allocated_gib"]:
        ratio = w["peak_reserved_gib"] / w["peak_allocated_gib"]
        checks.add("7", "reserved against allocated memory at the window's peak (expandable segments)", ratio <= 1.25,
                   ratio, "<= 1.25 (fragmentation: reserved far above allocated ends in an OOM while memory is free)")
    if w["target_forward_s_mean"]:
        checks.add("2", "target forward in the pipeline against alone", None,
                   w["target_forward_s_mean"] / alone_["target_forward_s"],
                   "near 1 on a GPU of its own; on a shared GPU up to ~2 (it shares the SMs)")


def must_check(checks: Checks) -> None:
    """What no figure here decides: the first GPU run's reader looks at these."""
    checks.look("4", "a 2-rank run on one GPU (dflash-flow run ... --nproc 2 with runtime.share_gpus: true) starts on "
                     "gloo (distributed.backend auto); an explicit nccl there stops before any model loads")
    checks.look("9", "a multi-GPU DDP run: train/allreduce_wait_s against the NCCL kernels' time in a trace (CUDA "
                     "events now; the host clock read ~0 under NCCL)")
    checks.look("10", "a multi-GPU FSDP run with grad_accum > 1: one reduce-scatter per optimizer step in a trace")
    checks.look("12", "with accelerate installed, a TargetForward replica's setup reads the target straight onto its "
                      "GPU (no host RAM peak of the model's size); setup_s above")
    checks.look("13", "determinism on CUDA is not bit for bit: two identical runs' losses agree to bf16 noise, not "
                      "exactly (docs/gpu.md)")
    checks.look("8", "nvidia-smi during the run: one CUDA context per GPU of this process, none of ~0.5 GB on a GPU "
                     "the process has no stage on (threads bound before setup, dflash_flow.app)")
    checks.look("6", "sync_warnings in alone: where any sync above one per step comes from; and in the pipeline "
                     "a loss mask that reaches DrafterStep on the GPU costs one more per micro-batch (read back)")
    checks.look("2", "nsys / torch.profiler trace of a few steps: target replicas' kernels on their own streams, "
                     "no cudaStreamSynchronize of the drafter's stream from a TargetForward thread")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps measured after the warm-up")
    p.add_argument("--warmup", type=int, default=5, help="optimizer steps before the window opens")
    p.add_argument("--tiny", action="store_true", help="tiny models (a smoke run of the same code path)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    from dflash_flow.model.device import ALLOC_CONF, use_expandable_segments

    use_expandable_segments()  # as every run's stage threads set it (dflash_flow.app), before CUDA starts here
    if args.device == "cpu":
        torch.set_num_threads(1)  # the smoke run on a small shared CPU: contended intra-op threads crawl
    t0 = time.perf_counter()
    shape = Shape(args.tiny)
    checks = Checks()
    cuda = args.device.startswith("cuda")
    import os

    result = {
        "allocator": os.environ.get(ALLOC_CONF),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(torch.device(args.device)) if cuda else platform.processor() or "cpu"},
        "workload": "tiny" if args.tiny else "Qwen3-8B-shaped target (random bf16), 5-layer drafter, B=16, 512 anchors, 4 x 3072 tokens per batch",
        "correctness": correctness(args.device, checks),
        "attention": attention_check(args.device, shape, checks),
    }
    from dflash_flow.model.device import default_attn_implementation

    attn_impl = default_attn_implementation(args.device, torch.bfloat16 if cuda else torch.float32)
    result["target_attention"] = attn_impl
    if cuda:  # finding 13: flash-attn only where it runs (sm80+, 16-bit)
        major, minor = torch.cuda.get_device_capability(torch.device(args.device))
        checks.add("13", "the target's attention kernel for this GPU", attn_impl == "sdpa" or major >= 8,
                   {"implementation": attn_impl, "capability": f"{major}.{minor}"},
                   "flash_attention_2 only on sm80+ (else sdpa)")
    alone_ = alone(args.device, shape, checks)
    alone_.pop("trainer", None)
    result["alone"] = alone_
    if cuda:
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="dflash-gpu-bench-") as tmp:
        result["pipeline"] = run_pipeline(args.device, args.steps, args.warmup, shape, Path(tmp))
    pipeline_checks(args.device, result["pipeline"], alone_, checks)
    must_check(checks)
    result["checks"] = checks.items
    result["must_check"] = checks.must
    result["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)) + "\n")
    print(json.dumps(result, indent=2, default=str))
    print("\nchecks:")
    for c in checks.items:
        mark = {True: "ok    ", False: "FAILED", None: "n/a   "}[c["ok"]]
        print(f"  {mark} [{c['finding']}] {c['check']}: {c['value']} (expect {c['expect']})")
    print("the first GPU run must also look at:")
    for line in checks.must:
        print(f"  {line}")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
