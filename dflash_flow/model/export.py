"""Save and load drafter checkpoints in the Hugging Face layout DFlash inference engines load: ``config.json``
(a Qwen3 config plus the DFlash keys, checked against what vLLM and SGLang read: ``export_contract``) and
``model.safetensors`` with the drafter's own weights (never unpickled), world-readable (a server often runs as
another user). ``load_drafter`` builds either variant from ``architectures`` and accepts z-lab's codebooks."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from dflash_flow.core.errors import CheckpointError
from dflash_flow.model import dflash2
from dflash_flow.model.drafter import DFlashDrafter
from dflash_flow.model.drafter_config import LAYER_TYPES, SLIDING_ATTENTION, draft_value
from dflash_flow.model.export_contract import CONFIG_NAME, WEIGHTS_NAME, check_destination, read_json_object
from dflash_flow.model.export_contract import DFLASH as ARCHITECTURE
from dflash_flow.util import atomic_path, atomic_write_text, refuse_outside

FILE_MODE = 0o644  # read by inference servers, often another user
DIR_MODE = 0o755


def drafter_config_dict(config: Any) -> dict[str, Any]:
    """The ``config.json`` content for a drafter config, with the keys inference engines require."""
    d = config.to_dict()
    d.pop("auto_map", None)  # the engines refuse or strip it (export_contract)
    variant2 = dflash2.is_dflash2_config(config)
    d["architectures"] = [dflash2.ARCHITECTURE if variant2 else ARCHITECTURE]
    d["model_type"] = "qwen3"
    d["block_size"] = int(draft_value(config, "block_size", 16))
    d["num_target_layers"] = int(config.num_target_layers)
    d["layer_types"] = list(config.layer_types)
    d["sliding_window"] = config.sliding_window
    dcfg = dict(getattr(config, "dflash_config", None) or {})
    if dcfg.get("mask_token_id") is None:
        raise CheckpointError("drafter config has no dflash_config.mask_token_id; inference would guess it")
    dcfg["mask_token_id"] = int(dcfg["mask_token_id"])
    dcfg["target_layer_ids"] = [int(i) for i in draft_value(config, "target_layer_ids")]
    if variant2:
        dcfg["block_size"] = d["block_size"]  # DFlash 2 readers look there
    else:
        dcfg.pop("block_size", None)
    d["dflash_config"] = dcfg
    return d


_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file``, with its I/O failures (``SafetensorError: ... (os error 28)``) raised
    as the OSError they are."""
    from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - SafetensorError has no errno of its own
        found = _OS_ERROR.search(str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code), str(path)) from exc


def save_drafter(drafter: DFlashDrafter, path: str | os.PathLike, *, state: dict[str, Any] | None = None,
                 inputs: tuple = (), check_stop: Callable[[], None] | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``path`` (which must pass ``check_destination``),
    atomically; refuses NaN or infinite weights; checks the result against the serving contract.
    ``check_stop()`` (raises to stop) runs between tensors: a stop abandons the export before any write."""
    from dflash_flow.model.export_contract import check_export

    out = Path(path)
    check_destination(out, inputs)
    config = drafter_config_dict(drafter.config)
    # The config's ids may have been defaulted; what the module trained with is the truth.
    if config["dflash_config"]["target_layer_ids"] != list(drafter.target_layer_ids):
        raise CheckpointError(
            f"config target_layer_ids {config['dflash_config']['target_layer_ids']} differ from the "
            f"drafter's {drafter.target_layer_ids}"
        )
    stop = check_stop if check_stop is not None else (lambda: None)
    gathered: dict[str, torch.Tensor] = {}
    for k, v in (state if state is not None else drafter.state_dict()).items():
        stop()
        gathered[k] = v.detach().contiguous().cpu()
    for k, t in gathered.items():  # a second pass: a stop is checked between tensors here too
        stop()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise CheckpointError(
                f"refusing to export the drafter to {out}: weight {k} holds NaN or infinite values (the training "
                "diverged); export an earlier checkpoint instead"
            )
    stop()  # the last point before files are written: from here the export completes
    if not out.is_dir():
        out.mkdir(parents=True, exist_ok=True)
        os.chmod(out, DIR_MODE)  # whatever the umask: a server running as another user must enter it
    with atomic_path(out / WEIGHTS_NAME, mode=FILE_MODE) as tmp:
        write_safetensors(gathered, tmp, metadata={"format": "pt"})
    atomic_write_text(out / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n", mode=FILE_MODE)
    check_export(out)
    return out


@attrs.define(frozen=True)
class Exported:
    path: Path
    serve_commands: dict[str, str]  # engine -> the command that serves the export beside its target


@attrs.define(frozen=True)
class DrafterExporter:
    """A run's final export (``services.Exporter``): the drafter written to ``root/out``, never outside ``root``
    (a symbolic link followed), and the commands that serve it."""

    root: Path

    def export(self, drafter: DFlashDrafter, state: dict[str, Any], out: str, *, target: str | None,
               check_stop: Callable[[], None] | None = None) -> Exported:
        from dflash_flow.model.export_contract import serve_commands

        path = self.root / out
        refuse_outside(path, self.root)
        save_drafter(drafter, path, state=state, check_stop=check_stop)
        return Exported(path, serve_commands(path, target))


def _validate_config_dict(d: dict[str, Any], where: Path) -> None:
    problems = []
    archs = d.get("architectures") or []
    if not isinstance(archs, list) or not {ARCHITECTURE, dflash2.ARCHITECTURE} & set(archs):
        problems.append(f"architectures {archs} names neither {ARCHITECTURE} nor {dflash2.ARCHITECTURE}")
    if d.get("model_type") != "qwen3":
        problems.append(f"model_type is {d.get('model_type')!r}, expected 'qwen3'")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_target_layers"):
        if not isinstance(d.get(key), int) or d[key] <= 0:
            problems.append(f"{key} must be a positive integer, got {d.get(key)!r}")
    dcfg = d.get("dflash_config")
    if not isinstance(dcfg, dict):
        problems.append("dflash_config is missing")
    else:
        mask_id = dcfg.get("mask_token_id")
        if not isinstance(mask_id, int):
            problems.append(f"dflash_config.mask_token_id must be an integer, got {mask_id!r}")
        elif isinstance(d.get("vocab_size"), int) and not 0 <= mask_id < d["vocab_size"]:
            problems.append(f"mask_token_id {mask_id} outside vocab_size {d['vocab_size']}")
        ids = dcfg.get("target_layer_ids")
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            problems.append(f"dflash_config.target_layer_ids must be a non-empty list of ints, got {ids!r}")
        elif isinstance(d.get("num_target_layers"), int) and not all(0 <= i < d["num_target_layers"] for i in ids):
            problems.append(f"target_layer_ids {ids} out of range for {d['num_target_layers']} target layers")
    block_size = d.get("block_size")
    if not isinstance(block_size, int) or block_size < 2:
        problems.append(f"block_size must be an integer >= 2, got {block_size!r}")
    if isinstance(archs, list) and dflash2.ARCHITECTURE in archs and isinstance(dcfg, dict):
        hidden, vocab = d.get("hidden_size"), d.get("vocab_size")
        if isinstance(hidden, int) and hidden > 0 and isinstance(vocab, int) and vocab > 0:
            found = dflash2.dflash2_problems({k: dcfg.get(k) for k in dflash2.DFLASH2_KEYS}, hidden_size=hidden,
                                             vocab_size=vocab)
            problems.extend(f"dflash_config.{message}" for _, message in found)
    layer_types = d.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != d.get("num_hidden_layers"):
            problems.append(f"layer_types {layer_types!r} does not have num_hidden_layers entries")
        elif set(layer_types) - set(LAYER_TYPES):
            problems.append(f"unknown layer types in {layer_types}")
        elif SLIDING_ATTENTION in layer_types and not d.get("sliding_window"):
            problems.append("sliding_attention layers but no sliding_window")
    if problems:
        raise CheckpointError(f"invalid drafter config {where}:\n  " + "\n  ".join(problems))


def load_drafter_config(path: str | os.PathLike):
    """Read and validate ``config.json`` of a drafter checkpoint directory; returns a ``Qwen3Config``."""
    from transformers import Qwen3Config

    where = Path(path) / CONFIG_NAME
    if not where.is_file():
        raise CheckpointError(f"no {CONFIG_NAME} in {Path(path)}")
    d = read_json_object(where)
    _validate_config_dict(d, where)
    if SLIDING_ATTENTION in (d.get("layer_types") or []):
        d["use_sliding_window"] = True  # else Qwen3Config silently drops sliding_window
    try:
        return Qwen3Config.from_dict(d)
    except Exception as e:  # the strict dataclass raises various types for bad field values
        raise CheckpointError(f"{where}: not a valid Qwen3 config: {e}") from e


def check_compatible(config: Any, target_config: Any, *, mask_token_id: int | None = None) -> None:
    """Raise CheckpointError when a drafter config cannot serve ``target_config`` (or another mask id)."""
    tc = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    problems = []
    if config.hidden_size != tc.hidden_size:
        problems.append(f"hidden_size {config.hidden_size} != target {tc.hidden_size}")
    if config.vocab_size != tc.vocab_size:
        problems.append(f"vocab_size {config.vocab_size} != target {tc.vocab_size}")
    if config.num_target_layers != tc.num_hidden_layers:
        problems.append(f"num_target_layers {config.num_target_layers} != target layers {tc.num_hidden_layers}")
    ids = draft_value(config, "target_layer_ids")
    if any(not 0 <= i < tc.num_hidden_layers for i in ids):
        problems.append(f"target_layer_ids {ids} out of range for {tc.num_hidden_layers} target layers")
    if mask_token_id is not None and draft_value(config, "mask_token_id") != mask_token_id:
        problems.append(f"mask_token_id {draft_value(config, 'mask_token_id')} != expected {mask_token_id}")
    if problems:
        raise CheckpointError("drafter does not match the target:\n  " + "\n  ".join(problems))


def load_drafter(path: str | os.PathLike, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, target_config: Any = None,
                 mask_token_id: int | None = None) -> DFlashDrafter:
    """Load a drafter checkpoint (safetensors only); CheckpointError for a missing or corrupted file, weights
    that do not fit the config, or a drafter made for another ``target_config``/``mask_token_id``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    config = load_drafter_config(root)
    if target_config is not None:
        check_compatible(config, target_config, mask_token_id=mask_token_id)
    elif mask_token_id is not None and draft_value(config, "mask_token_id") != mask_token_id:
        raise CheckpointError(f"mask_token_id {draft_value(config, 'mask_token_id')} != expected {mask_token_id}")
    weights = root / WEIGHTS_NAME
    if not weights.is_file():
        raise CheckpointError(f"no {WEIGHTS_NAME} in {root}")
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise CheckpointError(f"{weights} is corrupted or not a safetensors file: {e}") from e

    with torch.device("meta"):
        model = dflash2.drafter_from_config(config)
    expected = model.state_dict()
    for name in ("predecessor_codebook", "successor_codebook"):  # z-lab's module names them .weight
        key = f"candidate_selector.{name}"
        if key in expected and key not in state and f"{key}.weight" in state:
            state[key] = state.pop(f"{key}.weight")
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: file {tuple(state[k].shape)} vs config {tuple(expected[k].shape)}"
             for k in sorted(set(expected) & set(state)) if state[k].shape != expected[k].shape]
    lines = [f"{what.format(len(keys))}, e.g. {keys[:3]}" for what, keys in (
        ("missing {} tensors", missing), ("unexpected {} tensors", unexpected), ("{} shape mismatches", wrong)) if keys]
    if lines:
        raise CheckpointError(
            f"{weights} does not match {root / CONFIG_NAME} (a checkpoint from another config?):\n  "
            + "\n  ".join(lines)
        )
    model = model.to_empty(device=device)
    # to_empty leaves non-persistent buffers (RoPE inv_freq) uninitialised: rebuild them.
    model.rotary_emb = type(model.rotary_emb)(config).to(device)
    model.load_state_dict(state, strict=True)
    if dtype is not None:
        model = model.to(dtype=dtype)
    return model
