"""What a feature store's rows depend on, as plain comparable values (``store_identity``): the target (a digest
of its config and weights), the layer ids, the tokenizer's fingerprint, the chat template's digest and kwargs;
the build adds the samples' tokens. Weights are digested without loading them: a preset by its parameters and
seed, a model directory by the sha256 of each weights file (remembered per file version).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash_flow.util import config_hash

__all__ = ["store_identity", "target_fingerprint", "template_digest", "weights_digest"]

#: Config keys that say how a model was saved or is run, not what it computes.
_VOLATILE = frozenset({
    "_name_or_path", "transformers_version", "torch_dtype", "dtype", "_commit_hash", "_attn_implementation",
    "_attn_implementation_autoset", "attn_implementation", "use_cache", "output_hidden_states", "return_dict",
    "output_attentions", "torchscript", "architectures_autoset",
})
_WEIGHTS = re.compile(r".*\.(safetensors|bin|pt|pth)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _clean(d: Any) -> Any:
    if isinstance(d, Mapping):
        return {k: _clean(v) for k, v in sorted(d.items()) if k not in _VOLATILE}
    if isinstance(d, list | tuple):
        return [_clean(v) for v in d]
    return d


def _file_sha256(path: Path) -> str:
    real = Path(os.path.realpath(path))
    if _SHA256.match(real.name):  # a Hugging Face cache blob: named by its content's sha256
        return real.name
    from dflash_flow.data.store import file_sha256

    return file_sha256(real)


def _dir_digest(path: Path) -> str | None:
    files = sorted(p for p in path.iterdir() if _WEIGHTS.match(p.name) and p.is_file())
    if not files:
        return None
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        h.update(f"{f.name}\0{_file_sha256(f)}\n".encode())
    return "files:" + h.hexdigest()


def weights_digest(spec: Any) -> str | None:
    """A digest of the target's weights without loading them (None when that cannot be had here)."""
    from dflash_flow.model.facts import preset_params

    params = preset_params(spec)
    if params is not None:
        return "preset:" + config_hash(params)
    path = Path(os.fspath(spec)).expanduser()
    if path.is_dir():
        return _dir_digest(path)
    try:  # a hub id: its snapshot in the local cache, never the network
        from huggingface_hub import snapshot_download

        return _dir_digest(Path(snapshot_download(str(spec), local_files_only=True)))
    except Exception:  # noqa: BLE001 - not cached here: unknown, not a failure
        return None


def target_fingerprint(spec: Any, *, trust_remote_code: bool = False) -> dict[str, Any]:
    """``{"config": digest, "weights": digest}`` of a resolved target spec (a path, preset or mapping)."""
    from dflash_flow.model.target import load_target_config

    config = load_target_config(spec, trust_remote_code=trust_remote_code)
    return {"config": config_hash(_clean(config.to_dict())), "weights": weights_digest(spec)}


def template_digest(template: str | None) -> str | None:
    return None if template is None else hashlib.blake2b(template.encode(), digest_size=16).hexdigest()


def store_identity(target: Any, layer_ids: Sequence[int], *, trust_remote_code: bool = False,
                   tokenizer: str | None = None, chat_template: str | None = None,
                   template_kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The identity a store built for this target and data has (``tokens`` comes from the build).
    ``tokenizer``: a fingerprint (``data.store.tokenizer_fingerprint``); ``chat_template``: the template's
    text (digested here). None: not known here (not compared)."""
    return {
        "target": target_fingerprint(target, trust_remote_code=trust_remote_code),
        "layer_ids": [int(i) for i in layer_ids],
        "tokenizer": tokenizer,
        "chat_template": template_digest(chat_template),
        "template_kwargs": dict(template_kwargs) if template_kwargs is not None else None,
        "tokens": None,
    }
