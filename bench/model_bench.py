"""Drafter training step and target forward on tiny CPU presets, with and without the chunked loss.

Every configuration runs in a fresh subprocess (mixing sizes in one process skews CPU timings, and
``ru_maxrss`` is a per-process high-water mark), then the parent writes ``bench/results/model.json``
and prints it.

    python bench/model_bench.py            # all presets
    python bench/model_bench.py --quick    # one small preset (smoke test)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "model.json"

TARGET = dict(hidden=128, layers=8, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=8192)
# One intra-op thread: the box is shared, and CPU time per step is then a fair second measure.
COMMON = dict(batch=4, block_size=16, num_anchors=64, steps=3, warmup=1, threads=1)
# (sequence length, drafter layers); each runs with the loss in one pass and in chunks of 16 blocks.
SIZES = [(256, 1), (256, 2), (512, 2)]
CHUNKS = [None, 16]


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(cfg: dict) -> dict:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(ROOT))
    from dflash_flow.model.drafter import DFlashDrafter
    from dflash_flow.model.drafter_config import make_drafter_config
    from dflash_flow.model.objective import dflash_loss
    from dflash_flow.model.optim import build_optimizer

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    t = cfg["target"]
    tcfg = Qwen3Config(
        vocab_size=t["vocab"],
        hidden_size=t["hidden"],
        intermediate_size=t["intermediate"],
        num_hidden_layers=t["layers"],
        num_attention_heads=t["heads"],
        num_key_value_heads=t["kv_heads"],
        head_dim=t["head_dim"],
        max_position_embeddings=4096,
    )
    tcfg._attn_implementation = "sdpa"
    target = Qwen3ForCausalLM(tcfg).eval()
    for p in target.parameters():
        p.requires_grad_(False)
    mask_id = t["vocab"] - 1
    drafter = DFlashDrafter(
        make_drafter_config(
            tcfg, num_layers=cfg["drafter_layers"], block_size=cfg["block_size"], mask_token_id=mask_id
        )
    )
    opt, sched = build_optimizer(drafter, total_steps=1000)
    b, s = cfg["batch"], cfg["seq_len"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, mask_id, (b, s), generator=g)
    loss_mask = torch.ones(b, s, dtype=torch.long)
    loss_mask[:, : s // 8] = 0

    def target_forward():
        with torch.no_grad():
            out = target.model(input_ids=ids, output_hidden_states=True)
        return torch.cat([out.hidden_states[i + 1] for i in drafter.target_layer_ids], dim=-1)

    def train_step(feats):
        out = dflash_loss(
            drafter,
            embed_tokens=target.get_input_embeddings(),
            lm_head=target.lm_head,
            input_ids=ids,
            loss_mask=loss_mask,
            hidden_states=feats,
            num_anchors=cfg["num_anchors"],
            block_size=cfg["block_size"],
            mask_token_id=mask_id,
            generator=g,
            chunk_blocks=cfg["chunk_blocks"],
        )
        out.loss.backward()
        opt.step()
        sched.step()
        return out

    feats = target_forward()
    rss_before = current_rss_bytes()
    fwd_times, step_times, fwd_cpu, step_cpu = [], [], [], []
    for i in range(cfg["warmup"] + cfg["steps"]):
        t0, c0 = time.perf_counter(), time.process_time()
        feats = target_forward()
        t1, c1 = time.perf_counter(), time.process_time()
        out = train_step(feats)
        loss = out.loss.item()
        t2, c2 = time.perf_counter(), time.process_time()
        if i >= cfg["warmup"]:
            fwd_times.append(t1 - t0)
            step_times.append(t2 - t1)
            fwd_cpu.append(c1 - c0)
            step_cpu.append(c2 - c1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    blocks = int(out.kept_blocks.item())
    return dict(
        seq_len=cfg["seq_len"],
        drafter_layers=cfg["drafter_layers"],
        chunk_blocks=cfg["chunk_blocks"],
        target_forward_ms=round(1000 * statistics.median(fwd_times), 1),
        train_step_ms=round(1000 * statistics.median(step_times), 1),
        target_forward_cpu_ms=round(1000 * statistics.median(fwd_cpu), 1),
        train_step_cpu_ms=round(1000 * statistics.median(step_cpu), 1),
        draft_query_tokens=blocks * cfg["block_size"],
        drafter_params=sum(p.numel() for p in drafter.parameters()),
        rss_before_steps_mib=round(rss_before / 2**20, 1),
        peak_rss_mib=round(peak / 2**20, 1),
        peak_over_baseline_mib=round((peak - rss_before) / 2**20, 1),
        last_loss=round(loss, 4),
    )


def run_config(cfg: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        return dict(
            seq_len=cfg["seq_len"],
            drafter_layers=cfg["drafter_layers"],
            chunk_blocks=cfg["chunk_blocks"],
            error=proc.stderr[-2000:],
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="one small preset only")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sizes = SIZES[:1] if args.quick else SIZES
    runs = []
    for seq_len, layers in sizes:
        for chunk in CHUNKS:
            cfg = dict(COMMON, target=TARGET, seq_len=seq_len, drafter_layers=layers, chunk_blocks=chunk)
            result = run_config(cfg)
            runs.append(result)
            print(json.dumps(result), file=sys.stderr)
    report = dict(
        bench="model",
        created_unix=int(time.time()),
        machine=dict(python=platform.python_version(), cpus=os.cpu_count(), platform=platform.platform()),
        target=TARGET,
        common=COMMON,
        note=(
            "CPU, fp32, 1 thread on a shared 2-core box (wall times are noisy; *_cpu_ms is process CPU time). "
            "Each run is a fresh subprocess; peak memory is "
            "ru_maxrss, baseline is the RSS after models and features were built. chunk_blocks=null runs the "
            "loss in one pass (all logits live for the backward); 16 runs it in checkpointed chunks of 16 blocks."
        ),
        runs=runs,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
