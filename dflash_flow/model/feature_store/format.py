"""The store's format: file names, the shard trailer and index rows, the errors, the dtypes (codecs), the
token digest, and the identity (what the features depend on: target, layers, tokenizer, template, the
samples' tokens), compared field by field and digested."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import torch

from dflash_flow.core.errors import DflashFlowError
from dflash_flow.util import config_hash

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

    def direct(self, out: torch.Tensor) -> np.ndarray | None:
        """``out``'s bytes (writable uint8) when a stored row is copied straight into it (the storage dtype,
        contiguous, on CPU); else None."""
        if self.scaled or out.dtype != self.torch_dtype or out.device.type != "cpu" or not out.is_contiguous():
            return None
        return (out.view(torch.int16) if self.itemsize == 2 else out).numpy().reshape(-1).view(np.uint8)

    def decode_into(self, payload: np.ndarray, out: torch.Tensor) -> None:
        """Decode into ``out [L, F]`` (a CPU tensor): one copy when ``out`` has the storage dtype."""
        raw = self.direct(out)
        if raw is not None:
            np.copyto(raw, payload[: raw.size])
        else:
            out.copy_(self.decode(payload, out.shape[0], out.shape[1], out.dtype))

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


def flatten_identity(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """An identity as dotted fields (``target.weights``); ``template_kwargs`` stays one field."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and k != "template_kwargs":
            out.update(flatten_identity(v, name + "."))
        else:
            out[name] = v
    return out


def compare_identity(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(field, stored, expected) for every field (dotted: ``target.weights``) known on both sides (not None)
    whose values differ. A field the store did not record (a hybrid store knows no corpus digest) is not
    compared here: every row's token digest is (``FeatureStore.read_into``)."""
    s, e = flatten_identity(stored), flatten_identity(expected)
    return [(k, s.get(k), v) for k, v in sorted(e.items())
            if v is not None and s.get(k) is not None and _norm(s.get(k)) != _norm(v)]


def fill_unknown(stored: dict[str, Any], expected: Mapping[str, Any]) -> bool:
    """Record in ``stored`` the fields of ``expected`` it did not know; whether any was added."""
    added = False
    for k, v in expected.items():
        if isinstance(v, Mapping) and k != "template_kwargs" and isinstance(stored.get(k), dict):
            added |= fill_unknown(stored[k], v)
        elif stored.get(k) is None and v is not None:
            stored[k] = _norm(v)
            added = True
    return added


def _norm(v: Any) -> Any:
    return json.loads(json.dumps(v, sort_keys=True, default=str))


def identity_digest(identity: Mapping[str, Any]) -> str:
    return config_hash(_norm(identity))


def corpus_digest(sample_ids: Sequence[int], lengths: Sequence[int], digests: Sequence[int]) -> str:
    """The samples' identity: every (id, length, token digest), in id order."""
    order = np.argsort(np.asarray(sample_ids, dtype=np.int64), kind="stable")
    table = np.stack([np.asarray(sample_ids, dtype=np.int64)[order].astype("<u8"),
                      np.asarray(lengths, dtype=np.int64)[order].astype("<u8"),
                      np.asarray(digests, dtype=np.uint64)[order].astype("<u8")], axis=1)
    return hashlib.blake2b(np.ascontiguousarray(table).tobytes(), digest_size=16).hexdigest()
