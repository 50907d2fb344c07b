"""GPU benchmark: the real pipeline with a Qwen3-8B-shaped target and a 5-layer B = 16 drafter on one GPU.

    python bench/gpu.py                      # on a CUDA machine (< 5 minutes on one H200)
    python bench/gpu.py --tiny --device cpu  # the same code path, tiny models, on a CPU (smoke test)

No network, no MLflow: the target has random weights drawn on the GPU (a config preset with
``init_device: cuda``), the data are synthetic token ids with a chat-like length distribution, and the
pipeline (TokenizedSource -> Bucketer -> Interleaver -> Padder x2 -> TargetForward -> DrafterStep) runs
in this process for a fixed number of steps. It reports target tokens/s, the drafter's step time, the GPU
busy fraction, the fraction of wall time the drafter waited for data, peak GPU memory, and a CUDA-path
correctness check: the DFlash loss of one small batch computed on the GPU in bf16 equals the CPU fp32
loss within bf16 tolerance. Results: ``bench/results/gpu.json``.

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


def correctness(device: str) -> dict:
    """DFlash loss of one batch on ``device`` in bf16 (fp32 on a CPU) vs the CPU in fp32, same anchors."""
    import torch

    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.objective import dflash_loss, sample_anchors
    from dflash_flow.model.target import TargetFeatureExtractor, load_target, load_target_config
    from dflash_flow.model.trainer import DrafterShape, build_drafter

    spec = {**TINY, "seed": 3}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, TINY["vocab_size"] - 1, (2, 96), generator=g)
    mask = torch.zeros_like(ids)
    mask[:, 40:] = 1
    attn = torch.ones_like(ids)
    losses: list[tuple[str, float]] = []
    for dev, dtype in (("cpu", torch.float32), (device, torch.bfloat16 if device.startswith("cuda") else torch.float32)):
        target = load_target(spec, device=dev, dtype=dtype)
        drafter = build_drafter(load_target_config(spec), DrafterShape(num_layers=2, block_size=8,
                                mask_token_id=TINY["vocab_size"] - 1), seed=1, device=dev, dtype=dtype)
        head = load_shared_head(spec, dev, dtype)
        feats = TargetFeatureExtractor(target, drafter.target_layer_ids)(ids.to(dev), attn.to(dev))
        anchors = sample_anchors(mask, 24, attention_mask=attn, generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            out = dflash_loss(drafter, embed_tokens=head.embed_tokens, lm_head=head.lm_head, input_ids=ids.to(dev),
                              loss_mask=mask.to(dev), hidden_states=feats, attention_mask=attn.to(dev),
                              gamma=4.0, anchors=(anchors[0].to(dev), anchors[1].to(dev)))
        losses.append((f"{dev}/{str(dtype).removeprefix('torch.')}", float(out.loss)))
    (_, ref), (_, got) = losses
    rel = abs(got - ref) / abs(ref)
    return {"reference": losses[0], "measured": losses[1], "rel_diff": rel, "tolerance": 2e-2, "ok": rel <= 2e-2}


class _GpuSampler:
    """GPU utilisation sampled every 0.2 s through NVML when it is available (None otherwise)."""

    def __init__(self, device: str) -> None:
        self.values: list[float] = []
        self._stop = threading.Event()
        self._thread = None
        try:
            import pynvml  # noqa: F401 - optional
            import torch

            self._util = lambda: float(torch.cuda.utilization(torch.device(device)))
            self._util()
        except Exception:  # no NVML: the busy fraction comes from the stages' busy time only
            self._util = None

    def __enter__(self):
        if self._util is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-sampler")
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.values.append(self._util())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.values) / len(self.values) / 100 if self.values else None


def run_pipeline(device: str, steps: int, tiny: bool, workdir: Path) -> dict:
    import torch

    from dflash_flow.core import Graph, Pipeline
    from dflash_flow.app import model_services

    arch = TINY if tiny else QWEN3_8B
    vocab = arch["vocab_size"]
    max_len = 512 if tiny else 3072
    data = synthetic_data(workdir / "data.jsonl", 64 if tiny else 1200, vocab, max_len)
    target = {**arch, "init_device": device if device.startswith("cuda") else "cpu"}
    layer_ids = [1, 2, 4, 5] if tiny else [1, 9, 17, 25, 33]
    g = Graph(name="gpu-bench", seed=42, output_dir=str(workdir / "out"))
    g.runtime.stall_timeout_s = 900
    g.sections["model"] = {"target": target, "target_layer_ids": layer_ids, "num_draft_layers": 2 if tiny else 5,
                           "block_size": 16, "mask_token_id": vocab - 1}
    g.add("source", "TokenizedSource", config={"paths": [str(data)], "max_length": max_len, "cache_dir": None,
                                              "vocab_size": vocab})
    g.add("bucketer", "Bucketer", inputs="source", config={"max_tokens": 4 * max_len, "max_batch_size": 4,
                                                           "num_buckets": 4, "epochs": 8})
    g.add("interleaver", "Interleaver", inputs="bucketer", config={"max_batches": steps})
    g.add("padder", "Padder", inputs="interleaver", replicas=2)
    g.add("target", "TargetForward", inputs="padder", devices=device,
          config={"dtype": "bfloat16" if device != "cpu" else "float32"})
    g.add("drafter", "DrafterStep", inputs="target", devices=device, ordered=True, config={
        "num_anchors": 64 if tiny else 512, "lr": 6e-4, "gamma": 7.0,
        "dtype": "bfloat16" if device != "cpu" else "float32"})
    g.add("sink", "Discard", inputs="drafter")
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    pipeline = Pipeline(g, services=model_services(g), check_devices=device.startswith("cuda"))
    t0 = time.perf_counter()
    with _GpuSampler(device) as sampler:
        pipeline.run()
    wall = time.perf_counter() - t0
    snap = pipeline.snapshot()
    tgt, dr = snap.stages["target"], snap.stages["drafter"]
    tgt_rep, dr_rep = tgt.replicas[0], dr.replicas[0]
    step = dr.metric("step_s")
    # Training wall: from the drafter's first item (its setup built models) to its end.
    train_wall = max(dr_rep.alive_s - _setup_s(dr_rep), 1e-9)
    busy_union = min(1.0, (tgt_rep.busy_s + dr_rep.busy_s) / max(dr_rep.alive_s, 1e-9))
    return {
        "steps": int(dr.metric("steps") or 0),
        "wall_s": wall,
        "target_tokens_per_s": float(tgt.metric("tokens") or 0) / max(tgt_rep.busy_s, 1e-9),
        "target_forward_s_mean": (tgt.metric("forward_s") or {}).get("mean"),
        "drafter_step_s_mean": step.get("mean") if step else None,
        "drafter_step_s_max": step.get("max") if step else None,
        "data_wait_fraction": dr_rep.blocked_in_s / max(train_wall, 1e-9),
        "gpu_busy_fraction_nvml": sampler.mean,
        "gpu_busy_fraction_upper_bound": busy_union,
        "peak_memory_gib": torch.cuda.max_memory_allocated(torch.device(device)) / 2**30 if device.startswith("cuda") else None,
    }


def _setup_s(rep) -> float:
    """Seconds a replica spent before its first item (its setup): alive minus what it then did."""
    return max(rep.alive_s - rep.busy_s - rep.blocked_in_s - rep.blocked_out_s, 0.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--tiny", action="store_true", help="tiny models (a smoke run of the same code path)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "gpu.json"))
    args = p.parse_args(argv)
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --tiny for a smoke run", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    result = {
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else platform.processor() or "cpu"},
        "workload": "tiny" if args.tiny else "Qwen3-8B-shaped target (random bf16), 5-layer drafter, B=16, 512 anchors, 4 x 3072 tokens per batch",
        "correctness": correctness(args.device),
    }
    with tempfile.TemporaryDirectory(prefix="dflash-gpu-bench-") as tmp:
        result["pipeline"] = run_pipeline(args.device, args.steps, args.tiny, Path(tmp))
    result["total_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=lambda x: None if isinstance(x, float) and math.isnan(x) else str(x)) + "\n")
    print(json.dumps(result, indent=2, default=str))
    return 0 if result["correctness"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
