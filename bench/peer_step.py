"""Drafter training step against SpecForge 0.2's ``OnlineDFlashModel``: speed, peak memory, same loss.

Optional peer benchmark: SpecForge pins torch 2.11 and sglang, so it is not installed; its unpacked wheel
is put on ``sys.path`` and only the DFlash model and loss modules are imported (``specforge.algorithms.
common.dflash_family_model`` and ``specforge.modeling.draft.dflash``; their import chains need torch and
transformers only). Nothing of its math is replaced: the one override is the anchor draw, which returns the
anchors both implementations get in that round (so both do the same work on identical inputs).

    python bench/peer_step.py                       # fetches SpecForge first when it is not there (bench/peers.py)
    python bench/peer_step.py --baseline 2a747d7    # also our implementation at a git revision ("before")
    python bench/peer_step.py --no-specforge --baseline 2a747d7   # ours against a revision only
    python bench/peer_step.py --threads 1           # one intra-op thread (steadier when the box is shared)
    python bench/peer_step.py --compile             # ours with the ``compile`` recipe field on

(``--baseline`` imports the whole package at that revision beside this tree's, with its own chunking
defaults.)

SpecForge's wheel is downloaded by the hash pinned in ``requirements/bench.txt`` and unpacked into the cache
(or taken from ``$DFLASH_SPECFORGE_DIR`` / ``--specforge``); when that fails, the benchmark exits 2 naming
the one command that would fetch it (never a silent skip).

Workloads (fp32, 2 intra-op threads unless ``--threads``, sdpa, 2-layer drafter, block 8, 64 anchors, gamma 4):

* ``peer``: tiny Qwen3 target shape (vocab 384, hidden 128, 2 heads, head_dim 64, intermediate 384),
  batch 4 x 512, loss mask on the second half of every row;
* ``embedded``: the shipped CPU default's target shape (vocab 768, hidden 128, 4 heads / 2 KV heads,
  head_dim 32, intermediate 384) on batches of 2,048 padded tokens (4 x 512 and 8 x 256), rows of
  ragged length (55-100% of the batch length, the rest padding), a prompt of the first 20% of each row.

Each round draws fresh anchors (our sampler, seeded by the round) and runs every implementation once, in
rotating order; the figures are medians of wall and process-CPU milliseconds per forward+backward step
(no optimizer), and ``ours / theirs`` is the ratio of the medians measured in this one command. Peak memory:
one fresh subprocess per implementation with ``MALLOC_MMAP_THRESHOLD_`` set low (so freed tensors leave
the RSS), peak RSS during two steps over the RSS before them (after one warm-up step). The losses of all
implementations on the same anchors are printed and stored; ``tests/model/test_peer_specforge.py`` asserts
they agree to 1e-5. Results go to ``bench/results/peer_step.json``.

The roofline: ``step_flops`` counts the step's model FLOPs from the shapes (projections, attention over each
block's visible keys, MLP, LM head; backward 2x forward, 1x where only one gradient is needed), ``matmul_peak``
measures ``torch.mm`` on 2048 x 2048 fp32 squares with the same threads in the same process, and each
implementation's ``mfu`` is the model FLOPs over its median step over that peak (``counted_flops`` beside it:
what FlopCounterMode counts it executing). ``tests/bench/test_peer_roofline.py`` checks the count by hand and
against FlopCounterMode on a real drafter step.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "peer_step.json"
THREADS = 2

PEER_TARGET = dict(vocab=384, hidden=128, layers=8, heads=2, kv_heads=2, head_dim=64, intermediate=384)
EMBEDDED_TARGET = dict(vocab=768, hidden=128, layers=8, heads=4, kv_heads=2, head_dim=32, intermediate=384)
DRAFT = dict(num_layers=2, block_size=8, num_anchors=64, gamma=4.0)
CASES = {
    "peer": dict(target=PEER_TARGET, batch=4, seq_len=512, ragged=False),
    "embedded_4x512": dict(target=EMBEDDED_TARGET, batch=4, seq_len=512, ragged=True),
    "embedded_8x256": dict(target=EMBEDDED_TARGET, batch=8, seq_len=256, ragged=True),
}


# ------------------------------------------------------------------------------------------ SpecForge


def _peers():
    """``bench/peers.py`` (this script may be loaded from a file path, without bench/ on sys.path)."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    import peers

    return peers


def specforge_dir(path: str | os.PathLike | None = None) -> Path:
    peers = _peers()

    return peers.specforge_dir(path)


def import_specforge(path: str | os.PathLike | None = None, *, fetch: bool = False):
    """``(OnlineDFlashModel, DFlashDraftModel)`` from an unpacked SpecForge wheel, or ``(None, reason)``;
    ``fetch``: download and unpack the pinned wheel first when it is not there (``peers.ensure_specforge``)."""
    peers = _peers()

    if fetch:
        try:
            peers.ensure_specforge(path)
        except peers.Missing as exc:
            return None, str(exc)
    root = specforge_dir(path)
    if not (root / "specforge" / "algorithms" / "common" / "dflash_family_model.py").is_file():
        return None, f"no unpacked SpecForge wheel at {root} (set DFLASH_SPECFORGE_DIR or --specforge)"
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "flash_attn is not found" from an unrelated draft module
            loss_mod = importlib.import_module("specforge.algorithms.common.dflash_family_model")
            draft_mod = importlib.import_module("specforge.modeling.draft.dflash")
    except Exception as exc:  # any failure of an optional peer is a reason to skip, not to crash
        return None, f"SpecForge at {root} does not import here: {type(exc).__name__}: {exc}"
    return (loss_mod.OnlineDFlashModel, draft_mod.DFlashDraftModel), None


def load_baseline(rev: str, into: Path):
    """Our package as of git revision ``rev``, all of it (layers, attention, fused passes, trainer defaults),
    importable beside this tree's (``common.load_package``): its ``(drafter, objective, trainer)`` modules."""
    if str(ROOT / "bench") not in sys.path:
        sys.path.insert(0, str(ROOT / "bench"))
    from common import load_package

    name = load_package(rev, into)
    return tuple(importlib.import_module(f"{name}.model.{m}") for m in ("drafter", "objective", "trainer"))


# ------------------------------------------------------------------------------------------ workload


def target_config(t: dict):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=t["vocab"],
        hidden_size=t["hidden"],
        intermediate_size=t["intermediate"],
        num_hidden_layers=t["layers"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        head_dim=t["head_dim"],
        max_position_embeddings=4096,
    )


def build_case(case: dict, seed: int = 0) -> dict[str, Any]:
    """Drafter config and weights, frozen embedding / LM head, a batch and target-shaped features."""
    import torch

    from dflash_flow.model.drafter import DFlashDrafter
    from dflash_flow.model.drafter_config import make_drafter_config

    t = case["target"]
    tcfg = target_config(t)
    mask_id = t["vocab"] - 1
    dcfg = make_drafter_config(
        tcfg, num_layers=DRAFT["num_layers"], block_size=DRAFT["block_size"], mask_token_id=mask_id
    )
    dcfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    state = DFlashDrafter(dcfg).state_dict()
    embed = torch.nn.Embedding(t["vocab"], t["hidden"])
    head = torch.nn.Linear(t["hidden"], t["vocab"], bias=False)
    for p in (*embed.parameters(), *head.parameters()):
        p.requires_grad_(False)
    b, s = case["batch"], case["seq_len"]
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, mask_id, (b, s), generator=g)
    if case["ragged"]:
        lengths = torch.randint(int(0.55 * s), s + 1, (b,), generator=g)
        lengths[0] = s  # the bucket's longest row sets the padded length
        pos = torch.arange(s)[None]
        attention_mask = (pos < lengths[:, None]).long()
        loss_mask = ((pos >= (lengths[:, None] // 5)) & attention_mask.bool()).long()
        ids = ids * attention_mask
    else:
        attention_mask = None
        loss_mask = torch.zeros(b, s, dtype=torch.long)
        loss_mask[:, s // 2 :] = 1
    n_feat = len(dcfg.dflash_config["target_layer_ids"]) * t["hidden"]
    feats = torch.randn(b, s, n_feat, generator=g)
    if attention_mask is not None:
        feats = feats * attention_mask[..., None]
    return dict(
        config=dcfg,
        state=state,
        embed=embed,
        head=head,
        input_ids=ids,
        loss_mask=loss_mask,
        attention_mask=attention_mask,
        hidden_states=feats,
        mask_id=mask_id,
    )


def draw_anchors(c: dict, seed: int):
    import torch

    from dflash_flow.model.blockplan import sample_anchors

    return sample_anchors(
        c["loss_mask"],
        DRAFT["num_anchors"],
        attention_mask=c["attention_mask"],
        generator=torch.Generator().manual_seed(seed),
    )


def make_ours(c: dict, drafter_mod=None, objective_mod=None, trainer_mod=None, *, compiled: bool = False, **loss_kw):
    """``step(anchors) -> loss`` (forward + backward) for our implementation (or a baseline's modules,
    ``load_baseline``); ``compiled``: the ``compile`` recipe field (``DFlashDrafter.compiled``)."""
    if drafter_mod is None:
        from dflash_flow.model import drafter as drafter_mod
        from dflash_flow.model import objective as objective_mod
    if trainer_mod is None:
        from dflash_flow.model import trainer as trainer_mod
    # Our defaults, as the trainer passes them: chunking chosen from the activation budget.
    defaults = trainer_mod.TrainerConfig()
    loss_kw = dict(
        dict(chunk_blocks=defaults.chunk_blocks, activation_budget_mb=defaults.activation_budget_mb), **loss_kw
    )
    model = drafter_mod.DFlashDrafter(c["config"])
    model.load_state_dict(c["state"])
    model.train()
    if compiled:
        model.compiled = True

    def step(anchors, backward=True):
        out = objective_mod.dflash_loss(
            model,
            embed_tokens=c["embed"],
            lm_head=c["head"],
            input_ids=c["input_ids"],
            loss_mask=c["loss_mask"],
            hidden_states=c["hidden_states"],
            attention_mask=c["attention_mask"],
            num_anchors=DRAFT["num_anchors"],
            gamma=DRAFT["gamma"],
            anchors=anchors,
            **loss_kw,
        )
        if backward:
            out.loss.backward()
        return out.loss

    return model, step


def make_specforge(c: dict, classes):
    """The same step through SpecForge's ``OnlineDFlashModel`` (sdpa backend, default 128-block chunks)."""
    online_cls, draft_cls = classes
    model = draft_cls(c["config"])
    model.load_state_dict(c["state"])
    model.train()
    online = online_cls(
        model,
        c["head"],
        c["embed"],
        c["mask_id"],
        block_size=DRAFT["block_size"],
        attention_backend="sdpa",
        num_anchors=DRAFT["num_anchors"],
        loss_decay_gamma=DRAFT["gamma"],
    )
    current = {}
    # The one override: SpecForge draws anchors from the global RNG; here it gets the round's anchors.
    online._sample_anchor_positions = lambda seq_len, loss_mask, device: current["anchors"]
    loss_mask = c["loss_mask"]
    if c["attention_mask"] is not None:  # SpecForge takes no attention mask: padding is unsupervised
        loss_mask = loss_mask * c["attention_mask"]

    def step(anchors, backward=True):
        current["anchors"] = anchors
        loss, _acc, _metrics = online(c["input_ids"], c["hidden_states"], loss_mask.float())
        if backward:
            loss.backward()
        return loss

    return model, step


def implementations(c: dict, *, sf_classes=None, baseline=None, compiled=False) -> dict[str, tuple]:
    impls = {"ours": make_ours(c, compiled=compiled)}
    if sf_classes is not None:
        impls["specforge"] = make_specforge(c, sf_classes)
    if baseline is not None:
        impls["before"] = make_ours(c, *baseline, compiled=compiled)
    return impls


# ------------------------------------------------------------------------------------------ roofline


def step_flops(shape: dict, anchors: list[int], context_tokens: int) -> dict[str, int]:
    """The model FLOPs of one DFlash training step (forward + backward), counted from the shapes.

    ``shape``: ``hidden``, ``heads``, ``kv_heads``, ``head_dim``, ``intermediate``, ``vocab``, ``features`` (the
    concatenated target features' width), ``layers`` (drafter layers), ``block_size``; ``anchors``: the anchor
    position of every kept block (its block sees the ``anchor`` context positions before it, then its own
    ``block_size`` keys, bidirectionally); ``context_tokens``: the real (unpadded) positions whose features are
    fused and projected to keys and values. A multiply-add is 2 FLOPs. Counted, each as the straightforward
    step computes it (work an implementation skips is credited to it, work it recomputes is not counted):

    * ``fc``: the context features to the hidden size; per layer ``context_kv``: its keys and values;
    * per layer on every block token: ``qkv``, ``o`` projections, the gated ``mlp`` (3 matrices);
    * ``attention``: scores and the weighted values (``4 * head_dim`` per query-key pair and query head);
    * ``head``: the (frozen) LM head on the supervised slots 1..B-1 (slot 0 has no label).

    Backward: 2x forward for the trainable projections and the attention (input and weight gradients), 1x for
    ``fc`` (its input, the target's features, needs no gradient) and the frozen ``head`` (no weight gradient).
    Elementwise work (norms, RoPE, SiLU, softmax, cross-entropy) is not counted, as in any MFU figure.
    """
    h, nh, nkv, d = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    layers, bsz = shape["layers"], shape["block_size"]
    tokens = len(anchors) * bsz  # block tokens
    pairs = sum(bsz * (int(a) + bsz) for a in anchors)  # query-key pairs per head
    fwd = dict(
        fc=2 * context_tokens * shape["features"] * h,
        context_kv=layers * 2 * context_tokens * h * 2 * nkv * d,
        qkv=layers * 2 * tokens * h * (nh + 2 * nkv) * d,
        o=layers * 2 * tokens * nh * d * h,
        mlp=layers * 2 * tokens * h * shape["intermediate"] * 3,
        attention=layers * 4 * d * nh * pairs,
        head=2 * len(anchors) * (bsz - 1) * h * shape["vocab"],
    )
    bwd_factor = dict(fc=1, head=1)
    bwd = {k: v * bwd_factor.get(k, 2) for k, v in fwd.items()}
    forward, backward = sum(fwd.values()), sum(bwd.values())
    return dict(forward=forward, backward=backward, total=forward + backward, **{f"forward_{k}": v for k, v in fwd.items()})


def case_shape(c: dict) -> dict:
    cfg = c["config"]
    return dict(
        hidden=cfg.hidden_size,
        heads=cfg.num_attention_heads,
        kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate=cfg.intermediate_size,
        vocab=c["head"].out_features,
        features=c["hidden_states"].shape[-1],
        layers=cfg.num_hidden_layers,
        block_size=DRAFT["block_size"],
    )


def case_flops(c: dict, anchors) -> dict[str, int]:
    """``step_flops`` of the case on one round's ``(anchors, keep)``."""
    positions, keep = anchors
    kept = positions[keep].tolist()
    mask = c["attention_mask"]
    context = int(mask.sum()) if mask is not None else c["input_ids"].numel()
    return step_flops(case_shape(c), kept, context)


def matmul_peak(n: int = 2048, reps: int = 5, *, cpu: bool = False) -> float:
    """FLOP/s of ``torch.mm`` on ``n x n`` fp32 squares with this process's intra-op threads (best of ``reps``):
    the roofline's ceiling for this thread count on this machine. ``cpu``: per second of process CPU time (what
    a core gives while this process holds it; steadier than wall time when other work shares the cores)."""
    import torch

    clock = time.process_time if cpu else time.perf_counter
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    out = torch.empty(n, n)
    torch.mm(a, b, out=out)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        torch.mm(a, b, out=out)
        best = min(best, clock() - t0)
    return 2 * n**3 / max(best, 1e-9)


def counted_flops(step, anchors) -> int:
    """FLOPs of one forward + backward as ``torch.utils.flop_counter.FlopCounterMode`` counts the ops it knows
    (matmuls, and here the CPU flash-attention kernel with sdpa's formula): what the implementation computes,
    wasted work included, against ``step_flops``' model count. Elementwise ops count 0 there too."""
    import torch
    from torch.utils import flop_counter as fc

    aten = torch.ops.aten
    mapping = {
        aten._scaled_dot_product_flash_attention_for_cpu: _flash_cpu_flop,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _flash_cpu_backward_flop,
    }
    with fc.FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        step(anchors)
    return int(counter.get_total_flops())


def _flash_cpu_flop(query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU flash kernel (grouped-query keys allowed): scores and weighted values, 2 FLOPs per multiply-add."""
    b, h, q, d = query_shape
    return 4 * b * h * q * key_shape[-2] * d


def _flash_cpu_backward_flop(grad_out_shape, query_shape, key_shape, *args, out_shape=None, **kwargs) -> int:
    """Its backward as torch counts sdpa's: the value, score, query and key gradients (2x the forward)."""
    return 2 * _flash_cpu_flop(query_shape, key_shape)


# ------------------------------------------------------------------------------------------ measuring


def time_rounds(impls: dict, c: dict, rounds: int) -> dict[str, dict[str, float]]:
    names = list(impls)
    wall = {n: [] for n in names}
    cpu = {n: [] for n in names}
    first = {}
    for r in range(rounds + 1):
        anchors = draw_anchors(c, seed=1000 + r)
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            model, step = impls[name]
            model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            step(anchors)
            t1, c1 = time.perf_counter(), time.process_time()
            if r:  # round 0 warms up every implementation (and compiles, with --compile)
                wall[name].append(1000 * (t1 - t0))
                cpu[name].append(1000 * (c1 - c0))
            else:
                first[name] = round(t1 - t0, 2)
    return {
        n: dict(
            ms=round(statistics.median(wall[n]), 2),
            cpu_ms=round(statistics.median(cpu[n]), 2),
            min_ms=round(min(wall[n]), 2),
            first_step_s=first[n],
        )
        for n in names
    }


def losses_on_same_anchors(impls: dict, c: dict) -> dict[str, float]:
    import torch

    anchors = draw_anchors(c, seed=0)
    with torch.no_grad():
        return {name: float(step(anchors, backward=False)) for name, (_m, step) in impls.items()}


def _status_kib(field: str) -> int:
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def memory_worker(case_name: str, impl: str, sf_path: str | None, baseline_dir: str | None, rev: str | None,
                  compiled: bool = False):
    """Peak RSS (MiB) over the pre-step RSS for two steps of one implementation (run in a subprocess)."""
    import torch

    torch.set_num_threads(int(os.environ.get("DFLASH_PEER_THREADS", THREADS)))
    c = build_case(CASES[case_name])
    classes = import_specforge(sf_path)[0] if impl == "specforge" else None
    baseline = load_baseline(rev, Path(baseline_dir)) if impl == "before" else None
    model, step = implementations(c, sf_classes=classes, baseline=baseline, compiled=compiled)[impl]
    anchors = draw_anchors(c, seed=7)
    step(anchors)  # warm-up: one-time allocations (thread pools, kernels' scratch) are not the step's
    model.zero_grad(set_to_none=True)
    gc.collect()
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark to the current RSS
    before = _status_kib("VmRSS")
    for _ in range(2):
        step(anchors)
        model.zero_grad(set_to_none=True)
    return dict(peak_over_baseline_mib=round((_status_kib("VmHWM") - before) / 1024, 2))


def measure_memory(case_name: str, impl: str, args, baseline_dir: str | None) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, __file__, "--memory-worker", case_name, impl]
    if args.specforge:
        cmd += ["--specforge", str(args.specforge)]
    if baseline_dir:
        cmd += ["--baseline", args.baseline, "--baseline-dir", baseline_dir]
    if args.compile:
        cmd += ["--compile"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        return dict(error=proc.stderr[-1500:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_case(name: str, args, sf_classes, baseline, baseline_dir) -> dict:
    c = build_case(CASES[name])
    impls = implementations(c, sf_classes=sf_classes, baseline=baseline, compiled=args.compile)
    times = time_rounds(impls, c, args.rounds)  # first: round 0's time is the start-up (compiling) cost
    losses = losses_on_same_anchors(impls, c)
    result: dict[str, Any] = dict(
        case=name,
        batch=CASES[name]["batch"],
        seq_len=CASES[name]["seq_len"],
        ragged=CASES[name]["ragged"],
        losses_same_anchors=losses,
        implementations={n: dict(times[n]) for n in impls},
    )
    # The roofline: the model FLOPs of the timed rounds' anchors (round r draws seed 1000 + r), their mean over
    # each implementation's median step, against the matmul peak this process measured (``args.peak``).
    flops = [case_flops(c, draw_anchors(c, seed=1000 + r)) for r in range(1, args.rounds + 1)]
    mean_flops = {k: round(statistics.fmean(f[k] for f in flops)) for k in flops[0]}
    result["model_flops"] = mean_flops
    anchors0 = draw_anchors(c, seed=1000)
    for n, (model, step) in impls.items():
        model.zero_grad(set_to_none=True)
        entry = result["implementations"][n]
        entry["counted_flops"] = counted_flops(step, anchors0)
        entry["achieved_gflops"] = round(mean_flops["total"] / entry["ms"] / 1e6, 2)
        entry["mfu"] = round(mean_flops["total"] / (entry["ms"] / 1000) / args.peak, 3)
        entry["mfu_min"] = round(mean_flops["total"] / (entry["min_ms"] / 1000) / args.peak, 3)
        entry["mfu_cpu"] = round(mean_flops["total"] / (entry["cpu_ms"] / 1000) / args.peak_cpu, 3)
    if not args.no_memory:
        for n in impls:
            result["implementations"][n].update(measure_memory(name, n, args, baseline_dir))
    ours = times["ours"]
    for other in ("specforge", "before"):
        if other in times:
            result[f"ours_over_{other}"] = round(ours["ms"] / times[other]["ms"], 3)
            result[f"ours_over_{other}_cpu"] = round(ours["cpu_ms"] / times[other]["cpu_ms"], 3)
            result[f"ours_over_{other}_min"] = round(ours["min_ms"] / times[other]["min_ms"], 3)
            result[f"loss_diff_vs_{other}"] = abs(losses["ours"] - losses[other])
    if c["attention_mask"] is not None and "specforge" in losses:
        result["note"] = (
            "SpecForge takes no attention mask; right padding lies after every anchor, so no block sees it "
            "and the losses agree"
        )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--specforge", help="unpacked SpecForge 0.2.0 wheel (default $DFLASH_SPECFORGE_DIR or ~/.cache)"
    )
    parser.add_argument("--baseline", help="also time our implementation at this git revision")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {list(CASES)}")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    parser.add_argument("--no-specforge", action="store_true", help="do not compare against SpecForge (with --baseline)")
    parser.add_argument("--threads", type=int, default=THREADS, help="intra-op threads (1: steadier on a busy box)")
    parser.add_argument("--compile", action="store_true", help="ours with the compile recipe field on")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--memory-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--baseline-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_worker:
        case_name, impl = args.memory_worker
        print(json.dumps(memory_worker(case_name, impl, args.specforge, args.baseline_dir, args.baseline, args.compile)))
        return 0

    import torch

    os.environ["DFLASH_PEER_THREADS"] = str(args.threads)  # the memory subprocesses use the same
    torch.set_num_threads(args.threads)
    classes = None
    if not args.no_specforge:
        classes, reason = import_specforge(args.specforge, fetch=True)
        if classes is None:
            print(f"peer_step: SpecForge is not available: {reason}", file=sys.stderr)
            return 2
    elif not args.baseline:
        print("peer_step: --no-specforge leaves nothing to compare: give --baseline REV", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    peaks = [matmul_peak()]  # the roofline's ceiling: this thread count's torch.mm, before and after the cases
    args.peak = peaks[0]
    args.peak_cpu = matmul_peak(cpu=True)
    with tempfile.TemporaryDirectory() as tmp:
        baseline = load_baseline(args.baseline, Path(tmp)) if args.baseline else None
        cases = [
            run_case(n, args, classes, baseline, tmp if baseline else None) for n in args.cases.split(",")
        ]
    peaks.append(matmul_peak())
    report = dict(
        bench="peer_step",
        created_unix=int(time.time()),
        machine=dict(python=platform.python_version(), cpus=os.cpu_count(), platform=platform.platform()),
        torch=torch.__version__,
        threads=args.threads,
        draft=DRAFT,
        specforge=str(specforge_dir(args.specforge)) if classes else None,
        baseline=args.baseline,
        compile=args.compile,
        rounds=args.rounds,
        load_average=dict(before=[round(x, 2) for x in load_before], after=[round(x, 2) for x in os.getloadavg()]),
        matmul_peak_gflops=dict(
            used=round(peaks[0] / 1e9, 2), after=round(peaks[1] / 1e9, 2), cpu=round(args.peak_cpu / 1e9, 2),
            n=2048, dtype="float32",
            note="torch.mm on 2048 x 2048 fp32 squares, best of 5, this process's intra-op threads; measured "
            "before the cases (used for mfu) and after them; cpu: per second of process CPU time (for mfu_cpu)",
        ),
        roofline_note=(
            "model_flops: step_flops (analytic, from the shapes and each timed round's kept anchors; mean over "
            "the rounds): projections, attention over each block's visible keys, MLP, the LM head on slots "
            "1..B-1; backward 2x forward (1x for fc and the frozen head). mfu: model_flops.total / median step "
            "(mfu_min: / fastest step) / matmul_peak_gflops.used; mfu_cpu: over the median step's process CPU time / the "
            "peak per CPU second (steadier on a shared box: a step that waits for a core costs no CPU time). counted_flops: FlopCounterMode on one step "
            "of that implementation (matmuls and the CPU flash kernel as executed, wasted work included)."
        ),
        note=(
            "ms / cpu_ms / min_ms: median wall, median process-CPU and fastest wall milliseconds per "
            "forward+backward step over the rounds (min_ms is the figure least disturbed by other load), all "
            "implementations alternated in one process on identical inputs and anchors (shared 2-core box: "
            "compare the ratios, not the absolute figures). peak_over_baseline_mib: fresh subprocess per "
            "implementation, peak RSS over two steps above the RSS before them."
        ),
        cases=cases,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for c in cases:
        impl = c["implementations"]
        line = ", ".join(
            f"{n} {v['ms']:.1f} ms (cpu {v['cpu_ms']:.1f})"
            + (f" peak +{v['peak_over_baseline_mib']:.1f} MiB" if "peak_over_baseline_mib" in v else "")
            for n, v in impl.items()
        )
        print(f"{c['case']} [{c['batch']}x{c['seq_len']}]: {line}")
        ratios = [
            f"ours/{o} {c[f'ours_over_{o}']:.3f} (cpu {c[f'ours_over_{o}_cpu']:.3f}, min {c[f'ours_over_{o}_min']:.3f})"
            for o in ("specforge", "before")
            if f"ours_over_{o}" in c
        ]
        if ratios:
            print("  " + ", ".join(ratios))
        print(
            f"  roofline: {c['model_flops']['total'] / 1e9:.2f} GFLOP per step (model count), "
            + ", ".join(
                f"{n} {v['achieved_gflops']:.1f} GFLOP/s = mfu {v['mfu']:.3f} (cpu {v['mfu_cpu']:.3f}; counted "
                f"{v['counted_flops'] / 1e9:.2f} GFLOP)"
                for n, v in impl.items()
            )
            + f" of the {report['matmul_peak_gflops']['used']:.1f} GFLOP/s matmul peak"
        )
        print(
            "  losses on identical anchors: "
            + ", ".join(f"{n} {v:.6f}" for n, v in c["losses_same_anchors"].items())
        )
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
