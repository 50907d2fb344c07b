"""Devices and dtypes of the models: the default dtype and attention kernel per device, ``dtype`` names."""

from __future__ import annotations

import torch


def as_device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    # "cuda" and "cuda:0" must be the same cache key and the same placement.
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on accelerators (the dtype the released drafters were trained against), fp32 on CPU
    (CPU bf16 matmuls are slow and lossy, and tests compare at 1e-5)."""
    return torch.float32 if as_device(device).type == "cpu" else torch.bfloat16


def default_attn_implementation(device: str | torch.device) -> str:
    """flash_attention_2 only where it can actually run (CUDA and the package imports); sdpa otherwise.
    flash-attn is an optional extra and cannot even be built on CPU-only machines."""
    if as_device(device).type == "cuda":
        try:
            import flash_attn  # noqa: F401
        except Exception:  # ImportError, or a broken CUDA build raising at import
            return "sdpa"
        return "flash_attention_2"
    return "sdpa"



def resolve_dtype(name: str | None, device: str | torch.device) -> torch.dtype:
    """A dtype from its config name; ``auto`` (or None) is :func:`default_dtype` for the device."""
    if name in (None, "auto"):
        return default_dtype(device)
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected auto, float32, bfloat16 or float16") from None

