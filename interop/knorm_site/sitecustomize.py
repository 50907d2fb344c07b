"""Loaded at start-up by every Python process whose PYTHONPATH holds this directory (``interop/vllm_serve.py
--per-layer-knorm`` puts it there): when vLLM's ``qwen3_dflash`` module is imported, its
``DFlashQwen3Model._normalize_context_k`` is replaced by the per-layer one of ``interop/vllm_side.py``
(``docs/vllm-cpu-dflash-knorm.md``). vLLM's CPU platform spawns its engine and worker processes (a fresh
interpreter each), so a patch made in the server's own process would not reach the worker that drafts; this
one reaches every process. The installed vLLM is never edited."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys

TARGET = "vllm.model_executor.models.qwen3_dflash"
INTEROP = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _patch(module) -> None:
    if INTEROP not in sys.path:
        sys.path.append(INTEROP)
    from vllm_side import per_layer_normalize_context_k

    module.DFlashQwen3Model._normalize_context_k = per_layer_normalize_context_k
    print(f"knorm_site: pid {os.getpid()}: DFlashQwen3Model._normalize_context_k normed per layer", flush=True)


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if TARGET in sys.modules:
    _patch(sys.modules[TARGET])
else:
    sys.meta_path.insert(0, _Hook())
