"""``vllm serve`` (its API server module) with one optional change, in the vLLM environment (never ours):

    python interop/vllm_serve.py [--per-layer-knorm] API-SERVER-ARGS...

``--per-layer-knorm``: ``DFlashQwen3Model._normalize_context_k`` normed per layer (``vllm_side``'s
function; ``docs/vllm-cpu-dflash-knorm.md``) in every process of the server: ``interop/knorm_site`` goes in
front of PYTHONPATH, and its ``sitecustomize`` patches the module wherever it is imported (vLLM's CPU
platform spawns its engine and worker processes, so a patch made here alone would not reach the worker).
The installed vLLM is never edited. Without the flag this is exactly
``python -m vllm.entrypoints.openai.api_server ARGS``.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

SITE = Path(__file__).resolve().parent / "knorm_site"

if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--per-layer-knorm"]:
        args = args[1:]
        parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), *parts])  # the processes vLLM spawns
        runpy.run_path(str(SITE / "sitecustomize.py"))  # this process: the hook installed (or the patch made) now
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
