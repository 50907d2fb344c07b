"""The store's format: file names, the shard trailer and index rows, the errors, the dtypes (codecs) and the
token digest. Dtypes (bytes per token for F features): fp32 4F, bf16 2F, fp16 2F, fp8 F + 4 (e4m3 "fn" values,
one fp32 scale per token: ``amax / 448``, so every token uses the format's whole range)."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from dflash_flow.core.errors import DflashFlowError

FORMAT = "dflash-flow-feature-store"
VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.bin"
SHARDS = "shards"
RANKS = "ranks"
LOCK = ".lock"
SUFFIX = ".dfs"
SHARD_MAGIC = b"DFFEAT01"
TRAILER = struct.Struct("<8sQQII")  # magic, index offset, rows, meta length, crc32(index + meta)
ALIGN = 64
#: One row of a shard's index (and of the merged index, with the shard's number in ``shard``).
INDEX_DTYPE = np.dtype([("sid", "<i8"), ("offset", "<u8"), ("length", "<u4"), ("crc", "<u4"), ("tokens", "<u8")])
MERGED_DTYPE = np.dtype([("sid", "<i8"), ("shard", "<u4"), ("length", "<u4"), ("offset", "<u8"), ("crc", "<u4"),
                         ("pad", "<u4"), ("tokens", "<u8")])


FP8_MAX = 448.0  # the largest finite e4m3fn value
REOPEN = "run `dflash-flow features build PIPELINE` again: it computes only the missing samples"


class FeatureStoreError(DflashFlowError):
    """A store that cannot be used as asked: missing or damaged files, another identity, no space, locked."""


class StoreMismatch(FeatureStoreError):
    """The store was built for another target, tokenizer, template, layer set or data: ``fields`` names them."""

    def __init__(self, path: Path, fields: list[tuple[str, Any, Any]]):
        self.path = path
        self.fields = fields
        shown = "; ".join(f"{name}: store {_short(a)} vs this pipeline {_short(b)}" for name, a, b in fields)
        super().__init__(
            f"feature store {path} was built for another {', '.join(n for n, _, _ in fields)} ({shown}): build one for "
            "this pipeline into another path (`dflash-flow features build PIPELINE`), or point model.features.path "
            "at the store built for it")


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str) if not isinstance(value, str) else value
    return text if len(text) <= 48 else text[:45] + "..."


@attrs.frozen
class Codec:
    """How a row ``[L, F]`` is stored: ``itemsize`` bytes per value, plus a fp32 scale per token (fp8)."""

    name: str
    torch_dtype: torch.dtype
    itemsize: int
    scaled: bool = False

    def bytes_per_token(self, width: int) -> int:
        return width * self.itemsize + (4 if self.scaled else 0)

    def row_bytes(self, length: int, width: int) -> int:
        return length * self.bytes_per_token(width)

    def encode(self, row: torch.Tensor) -> np.ndarray:
        """The row's bytes (uint8, contiguous) as stored."""
        x = row.detach().to("cpu")
        if not self.scaled:
            x = x.to(self.torch_dtype).contiguous()
            if self.itemsize == 2:
                x = x.view(torch.int16)
            return x.numpy().reshape(-1).view(np.uint8)
        x = x.to(torch.float32)
        amax = x.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).contiguous()
        return np.concatenate([q.view(torch.uint8).numpy().reshape(-1), scale.numpy().view(np.uint8)])

    def decode(self, payload: np.ndarray, length: int, width: int, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """A stored row back as a tensor ``[L, F]`` (``out_dtype``: default the storage dtype; fp8: float32)."""
        n = length * width
        if not self.scaled:
            raw = torch.from_numpy(np.array(payload[: n * self.itemsize]))
            x = raw.view(self.torch_dtype).reshape(length, width)
            return x if out_dtype in (None, self.torch_dtype) else x.to(out_dtype)
        q = torch.from_numpy(np.array(payload[:n])).view(torch.float8_e4m3fn).reshape(length, width)
        scale = torch.from_numpy(np.array(payload[n : n + 4 * length]).view(np.float32))
        x = q.to(torch.float32) * scale[:, None]
        return x if out_dtype in (None, torch.float32) else x.to(out_dtype)

    def decode_into(self, payload: np.ndarray, out: torch.Tensor) -> None:
        """Decode into ``out [L, F]`` (a CPU tensor): one copy from the page cache when ``out`` has the
        storage dtype."""
        length, width = out.shape
        if not self.scaled and out.dtype == self.torch_dtype and out.device.type == "cpu" and out.is_contiguous():
            n = length * width * self.itemsize
            if self.itemsize == 2:
                np.copyto(out.view(torch.int16).numpy(), payload[:n].view(np.int16).reshape(length, width))
            else:
                np.copyto(out.numpy(), payload[:n].view(np.float32).reshape(length, width))
            return
        out.copy_(self.decode(payload, length, width, out.dtype))

    def roundtrip(self, row: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """What a read of ``row`` gives back (hybrid training uses these values from the first epoch on, so
        that a row computed now and one read later are the same)."""
        length, width = row.shape
        return self.decode(self.encode(row), length, width, out_dtype)

    def default_out_dtype(self) -> torch.dtype:
        return torch.float32 if self.scaled else self.torch_dtype


CODECS: dict[str, Codec] = {
    "fp32": Codec("fp32", torch.float32, 4),
    "bf16": Codec("bf16", torch.bfloat16, 2),
    "fp16": Codec("fp16", torch.float16, 2),
    "fp8": Codec("fp8", torch.float8_e4m3fn, 1, scaled=True),
}
_BY_TORCH = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def codec(name: str, compute_dtype: torch.dtype | None = None) -> Codec:
    """The codec of a dtype name; ``auto``: the target's compute dtype (lossless)."""
    if name == "auto":
        name = _BY_TORCH.get(compute_dtype or torch.float32, "fp32")
    try:
        return CODECS[name]
    except KeyError:
        raise FeatureStoreError(f"unknown feature store dtype {name!r}; known: {sorted(CODECS)}") from None


def token_digest(ids: Any) -> int:
    """A 64-bit digest of a sample's token ids (checked against the batch's on every read)."""
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().to("cpu").numpy()
    data = np.ascontiguousarray(np.asarray(ids).astype("<i4", copy=False))
    return int.from_bytes(hashlib.blake2b(memoryview(data).cast("B"), digest_size=8).digest(), "little")


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def estimate_bytes(tokens: int, samples: int, width: int, dtype: str) -> int:
    """Disk bytes of ``samples`` rows of ``tokens`` tokens in all: rows, their alignment, the index entries
    (in the shard and in the merged index)."""
    c = CODECS[dtype]
    return tokens * c.bytes_per_token(width) + samples * (ALIGN // 2 + 2 * INDEX_DTYPE.itemsize)


def id_ranges(ids: Iterable[int]) -> list[list[int]]:
    """Sorted ids as ``[start, end)`` ranges."""
    out: list[list[int]] = []
    for i in sorted(int(x) for x in ids):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        elif not out or out[-1][1] < i:
            out.append([i, i + 1])
    return out
