"""What a store's features depend on (target, layers, tokenizer, template, the samples' tokens): compared
field by field, digested."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from dflash_flow.util import config_hash


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
