"""``model.features``: where the target's features come from, declared once for the run (torch-free, cheap to
import: the application's ``model:`` section holds it and validation reads it).

* ``online`` (default): the target runs in every epoch (``TargetForward``, as always).
* ``offline``: the features are read from a store on disk that ``dflash-flow features build PIPELINE``
  wrote; no target is loaded. The store must match the pipeline (target config and weights, layer ids,
  tokenizer, chat template, the samples' tokens): a mismatch is refused naming the field.
* ``hybrid``: the first epoch computes each sample's features and writes them to the store (and keeps
  them in RAM up to ``ram_budget_mb``); later epochs read them. Without ``path`` it is RAM only: what
  ``TargetForward.cache_features`` has always done.

The store itself (files, dtypes, fp8 scales): ``model.feature_store``; the backend that reads or fills it:
``model.store_backend``; the commands: ``app.features_commands``; the guide: docs/features.md.
"""

from __future__ import annotations

import attrs

from dflash_flow.core import cfg

__all__ = ["FEATURE_MODES", "STORE_DTYPES", "FeaturesConfig"]

FEATURE_MODES = ("online", "offline", "hybrid")
#: Storage dtypes: fp8 is e4m3 (OCP "fn") with one fp32 scale per token.
STORE_DTYPES = ("auto", "fp32", "bf16", "fp16", "fp8")
MAX_RAM_MB = 16 * 2**20  # 16 TiB: a bound a machine can hold, not a default


@attrs.define(kw_only=True)
class FeaturesConfig:
    """``model.features``: online (the target runs every epoch), offline (read a store that ``dflash-flow
    features build`` wrote; no target loaded) or hybrid (the first epoch computes and writes, later epochs
    read)."""

    mode: str = cfg("online", choices=FEATURE_MODES,
                    doc="online: the target runs every epoch; offline: read the store (no target loaded); hybrid: "
                    "the first epoch computes and writes the store, later epochs read it.")
    path: str | None = cfg(None, result=False,
                           doc="The store's directory (offline: required; hybrid: null keeps the features in RAM only).")
    dtype: str = cfg("auto", choices=STORE_DTYPES,
                     doc="How features are stored: auto (the target's compute dtype: lossless), fp32, bf16, fp16, "
                     "or fp8 (e4m3 with a scale per token: half of bf16's bytes).")
    ram_budget_mb: float = cfg(4096.0, ge=0, le=MAX_RAM_MB, result=False,
                               doc="Features kept in RAM (the RAM tier: read before the disk; what does not fit is "
                               "read from the store, or computed again without one).")
    shard_mb: float = cfg(1024.0, gt=0, le=2**20, result=False,
                          doc="Size of one shard file of the store (the unit written atomically and resumed).")
    free_space_margin_mb: float = cfg(1024.0, ge=0, le=2**30, result=False,
                                      doc="Space left free on the store's filesystem: a build that would leave less "
                                      "is refused before a byte is written.")
    verify_tokens: bool = cfg(True, result=False,
                              doc="Check each row's tokens against the batch's (a digest per sample): a store from "
                              "other data, tokenizer or chat template is refused at the first row.")

    def problems(self) -> list[tuple[str, str]]:
        """(field, message) for values that cannot work together (validation reports them located)."""
        out = []
        if self.mode == "offline" and not self.path:
            out.append(("path", "mode offline reads a store: set model.features.path to the directory "
                                "`dflash-flow features build PIPELINE` wrote"))
        if self.mode == "online" and self.path:
            out.append(("path", "mode online neither reads nor writes a store: set mode offline or hybrid, or "
                                "remove path"))
        return out

    @property
    def ram_budget_bytes(self) -> int:
        return int(self.ram_budget_mb * 2**20)

    @property
    def shard_bytes(self) -> int:
        return int(self.shard_mb * 2**20)

    @property
    def margin_bytes(self) -> int:
        return int(self.free_space_margin_mb * 2**20)
