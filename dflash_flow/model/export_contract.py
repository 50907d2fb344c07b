"""The export contract: what the serving engines read from a drafter directory, checked as they read it.

``check_export(dir)`` validates an exported drafter against the fields vLLM (``qwen3_dflash`` /
``qwen3_dflash2``) and SGLang (``srt/models/dflash.py``) read, and against the files a server running as
another user must open; it reads only ``config.json`` and the safetensors header. ``serve_commands(dir,
target)`` gives the commands that serve the drafter with each engine. What each engine reads:

* vLLM: ``architectures`` (``DFlashDraftModel`` / ``DFlash2DraftModel``); ``dflash_config.mask_token_id``
  (else top level); the target layers from ``eagle_aux_hidden_state_layer_ids`` when present, else
  ``dflash_config.target_layer_ids`` + 1; ``target_hidden_size`` (else ``hidden_size``); ``layer_types``,
  ``sliding_window``; ``is_causal`` / ``dflash_config.causal``; ``draft_vocab_size``. Weights bare
  (``layers.N...``, ``fc.weight`` [H, H*K], ``hidden_norm.weight``, ``norm.weight``), no ``mask_hidden``;
  ``num_speculative_tokens`` is ``block_size - 1``. DFlash 2: ``dflash_config.{conv_kernel_size,
  conv_group_size, selector_rank, selector_top_k, block_size}``, the selector's and convolutions' tensors.
* SGLang: architecture ``DFlashDraftModel``; ``block_size`` (``dflash_config`` first, default 16);
  ``target_layer_ids``; ``mask_token_id``; ``num_target_layers``; ``hidden_act`` ``silu``. Unknown tensors
  are skipped silently (a renamed tensor serves random weights). ``--speculative-num-draft-tokens`` is
  ``block_size``.
* Neither wants ``auto_map`` (with it, ``trust_remote_code`` would look for a ``dflash.py`` that is not there).
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import struct
from pathlib import Path
from typing import Any

from dflash_flow.core.errors import CheckpointError

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DFLASH = "DFlashDraftModel"
DFLASH2 = "DFlash2DraftModel"
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
_HEADER_LIMIT = 100 * 2**20  # safetensors' own header cap


def read_json_object(path: Path) -> dict[str, Any]:
    """An exported ``config.json`` as a dict, or a CheckpointError naming the file (bad JSON, not an object)."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(d, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return d


def read_safetensors_header(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """``{tensor name: shape}`` from a safetensors file's JSON header, without reading the weights."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise CheckpointError(f"{path}: too short to be a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > _HEADER_LIMIT or n > path.stat().st_size - 8:
                raise CheckpointError(f"{path}: not a safetensors file (header length {n})")
            header = json.loads(f.read(n))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted safetensors header ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupted safetensors header")
    return {k: tuple(v.get("shape", ())) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def _readable_by_others(path: Path, *, directory: bool = False) -> str | None:
    mode = path.stat().st_mode
    need = stat.S_IROTH | (stat.S_IXOTH if directory else 0)
    if mode & need != need:
        what = "directory" if directory else "file"
        return (f"{path} is mode {stat.S_IMODE(mode):04o}: a server running as another user cannot "
                f"{'enter' if directory else 'read'} this {what} (chmod o+r{'x' if directory else ''})")
    return None


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def config_problems(d: dict[str, Any]) -> list[str]:
    """Every way ``config.json`` content ``d`` breaks what vLLM or SGLang read (empty: none)."""
    problems: list[str] = []
    archs = d.get("architectures")
    if archs not in ([DFLASH], [DFLASH2]):
        problems.append(f"architectures must be [{DFLASH}] or [{DFLASH2}] (what vLLM and SGLang map to their "
                        f"DFlash models), got {archs!r}")
    variant2 = archs == [DFLASH2]
    if "auto_map" in d:
        problems.append("auto_map must be absent: the engines load their own DFlash model, and with auto_map "
                        "trust_remote_code looks for a dflash.py the export does not have")
    if d.get("model_type") != "qwen3":
        problems.append(f"model_type must be 'qwen3', got {d.get('model_type')!r}")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size", "num_target_layers"):
        if not _int(d.get(key)) or d[key] <= 0:
            problems.append(f"{key} must be a positive integer, got {d.get(key)!r}")
    if d.get("hidden_act") != "silu":
        problems.append(f"hidden_act must be 'silu' (SGLang's DFlash MLP), got {d.get('hidden_act')!r}")
    dcfg = d.get("dflash_config")
    if not isinstance(dcfg, dict):
        problems.append("dflash_config (mask_token_id, target_layer_ids) is missing")
        dcfg = {}
    vocab, hidden = d.get("vocab_size"), d.get("hidden_size")
    mask = dcfg.get("mask_token_id")
    if not _int(mask):
        problems.append(f"dflash_config.mask_token_id must be an integer (vLLM reads it there), got {mask!r}")
    elif _int(vocab) and not 0 <= mask < vocab:
        problems.append(f"dflash_config.mask_token_id {mask} is outside the vocabulary (vocab_size {vocab})")
    if "mask_token_id" in d and d["mask_token_id"] != mask:
        problems.append(f"top-level mask_token_id {d['mask_token_id']!r} differs from dflash_config's {mask!r}")
    ids = dcfg.get("target_layer_ids")
    n_target = d.get("num_target_layers")
    if not isinstance(ids, list) or not ids or not all(_int(i) for i in ids):
        problems.append(f"dflash_config.target_layer_ids must be a non-empty list of integers, got {ids!r}")
        ids = None
    elif _int(n_target) and not all(0 <= i < n_target for i in ids):
        problems.append(f"dflash_config.target_layer_ids {ids} out of range for num_target_layers {n_target}")
    for where, holder in (("", d), ("dflash_config.", dcfg)):
        aux = holder.get("eagle_aux_hidden_state_layer_ids")
        if aux is not None and ids is not None and aux != [i + 1 for i in ids]:
            problems.append(f"{where}eagle_aux_hidden_state_layer_ids {aux!r} is not target_layer_ids + 1 "
                            f"({[i + 1 for i in ids]}): vLLM would feed the drafter other target layers")
        if "target_layer_ids" in holder and holder is d and holder["target_layer_ids"] != ids:
            problems.append(f"top-level target_layer_ids {holder['target_layer_ids']!r} differs from dflash_config's")
    block = d.get("block_size")
    if not _int(block) or block < 2:
        problems.append(f"block_size must be an integer >= 2 at the top level (SGLang, SpecForge), got {block!r}")
    nested = dcfg.get("block_size")
    if nested is not None and nested != block:
        problems.append(f"dflash_config.block_size {nested!r} differs from block_size {block!r} (SGLang reads "
                        "the nested one first)")
    if variant2:
        if nested is None:
            problems.append("dflash_config.block_size is missing (DFlash 2 reads it there)")
        for key in DFLASH2_FIELDS:
            v = dcfg.get(key)
            if not _int(v) or v < 1:
                problems.append(f"dflash_config.{key} must be a positive integer (DFlash 2), got {v!r}")
    if d.get("is_causal") or dcfg.get("causal"):
        problems.append("is_causal / dflash_config.causal is set: a DFlash block attends both ways; vLLM would "
                        "draft with a causal mask the drafter was not trained with")
    if "target_hidden_size" in d and d["target_hidden_size"] != hidden:
        problems.append(f"target_hidden_size {d['target_hidden_size']!r} != hidden_size {hidden!r}: the drafter "
                        "was trained on the target's hidden size")
    if d.get("draft_vocab_size") not in (None, vocab):
        problems.append(f"draft_vocab_size {d['draft_vocab_size']!r} != vocab_size {vocab!r} (the drafter "
                        "shares the target's LM head)")
    layer_types = d.get("layer_types")
    n_layers = d.get("num_hidden_layers")
    if not isinstance(layer_types, list) or len(layer_types) != n_layers:
        problems.append(f"layer_types must list one type per drafter layer ({n_layers}), got {layer_types!r}")
    elif set(layer_types) - set(KNOWN_LAYER_TYPES):
        problems.append(f"layer_types {layer_types} holds types the engines do not know "
                        f"(known: {', '.join(KNOWN_LAYER_TYPES)})")
    elif "sliding_attention" in layer_types and not (_int(d.get("sliding_window")) and d["sliding_window"] > 0):
        problems.append(f"sliding_attention layers need a positive sliding_window, got {d.get('sliding_window')!r}")
    return problems


def weight_problems(d: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """Tensor names and shapes against the config, as vLLM's and SGLang's DFlash loaders map them."""
    problems: list[str] = []
    bad_prefix = sorted(k for k in shapes if k.startswith(("model.", "embed_tokens", "lm_head")))
    if bad_prefix:
        problems.append(f"tensors must be bare drafter weights (the loaders add 'model.'; embedding and LM head "
                        f"come from the target), found {bad_prefix[:3]}")
    if any(k == "mask_hidden" or k.startswith("mask_hidden.") for k in shapes):
        problems.append("mask_hidden must be absent (vLLM's DFlash loader refuses it)")
    hidden, n_layers = d.get("hidden_size"), d.get("num_hidden_layers")
    ids = (d.get("dflash_config") or {}).get("target_layer_ids")
    need = ["fc.weight", "hidden_norm.weight", "norm.weight"]
    if _int(n_layers):
        need += [f"layers.{i}.self_attn.q_proj.weight" for i in range(n_layers)]
        extra_layers = sorted({k.split(".")[1] for k in shapes if k.startswith("layers.")} - {str(i) for i in range(n_layers)})
        if extra_layers:
            problems.append(f"tensors of layers {extra_layers} beyond num_hidden_layers {n_layers} (SGLang would "
                            "skip them silently)")
    missing = [k for k in need if k not in shapes]
    if missing:
        problems.append(f"missing tensors {missing[:4]}")
    if _int(hidden) and isinstance(ids, list) and "fc.weight" in shapes:
        want = (hidden, hidden * len(ids))
        if tuple(shapes["fc.weight"]) != want:
            problems.append(f"fc.weight is {list(shapes['fc.weight'])}, expected {list(want)} (hidden_size x "
                            "hidden_size * len(target_layer_ids))")
    if (d.get("architectures") or [None])[0] == DFLASH2 and not any(k.startswith("candidate_selector.") for k in shapes):
        problems.append("DFlash 2 export without candidate_selector tensors")
    return problems


def check_export(path: str | os.PathLike) -> dict[str, Any]:
    """Validate an exported drafter directory against the serving contract; returns the facts the serve
    commands need (``variant``, ``block_size``, ``target_layer_ids``, ``mask_token_id``). Raises
    CheckpointError listing every problem, each saying what an engine would do with it."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root} is not a directory holding an exported drafter")
    cfg_path, weights = root / CONFIG_NAME, root / WEIGHTS_NAME
    for f in (cfg_path, weights):
        if not f.is_file():
            raise CheckpointError(f"{root}: no {f.name} (export a checkpoint with `dflash-flow export CK OUT`)")
    problems = [m for m in (_readable_by_others(root, directory=True), _readable_by_others(cfg_path),
                            _readable_by_others(weights)) if m]
    d = read_json_object(cfg_path)
    problems += config_problems(d) + weight_problems(d, read_safetensors_header(weights))
    if problems:
        raise CheckpointError(f"{root} breaks the serving contract (vLLM / SGLang):\n  " + "\n  ".join(problems))
    dcfg = d["dflash_config"]
    return {
        "variant": "dflash2" if d["architectures"] == [DFLASH2] else "dflash",
        "block_size": d["block_size"],
        "target_layer_ids": list(dcfg["target_layer_ids"]),
        "mask_token_id": dcfg["mask_token_id"],
    }


def serve_commands(drafter: str | os.PathLike, target: str | os.PathLike | None = None, *,
                   block_size: int | None = None) -> dict[str, str]:
    """The commands that serve ``drafter`` beside ``target`` (``TARGET`` when unknown) with vLLM and SGLang:
    ``num_speculative_tokens = block_size - 1`` for vLLM, ``--speculative-num-draft-tokens = block_size``
    for SGLang. ``block_size`` defaults to the export's. SGLang has no DFlash 2 model: only vLLM's then."""
    drafter = Path(drafter).resolve()
    d = json.loads((drafter / CONFIG_NAME).read_text())
    block = int(block_size if block_size is not None else d["block_size"])
    tgt = shlex.quote(str(Path(target).resolve())) if target is not None and Path(target).exists() else (
        shlex.quote(str(target)) if target is not None else "TARGET")
    spec = json.dumps({"method": "dflash", "model": str(drafter), "num_speculative_tokens": block - 1})
    out = {"vllm": f"vllm serve {tgt} --speculative-config {shlex.quote(spec)}"}
    if d.get("architectures") != [DFLASH2]:
        out["sglang"] = (f"python -m sglang.launch_server --model-path {tgt} --speculative-algorithm DFLASH "
                         f"--speculative-draft-model-path {shlex.quote(str(drafter))} "
                         f"--speculative-num-draft-tokens {block}")
    return out


#: Printed under the commands of a DFlash 2 export (the one kind serve_commands gives no SGLang command for).
DFLASH2_SERVING = ("a DFlash 2 drafter: vLLM's GPU runner serves it; vLLM's CPU runner and SGLang do not load DFlash 2 "
                   "(train a plain DFlash drafter for them: dflash-flow run pipelines/dflash1.yaml, or variant: dflash)")


def format_serve_commands(commands: dict[str, str]) -> str:
    names = {"vllm": "vLLM", "sglang": "SGLang"}
    lines = [f"serve it with {names.get(k, k)}:\n  {v}" for k, v in commands.items()]
    if "vllm" in commands and "sglang" not in commands:
        lines.append(DFLASH2_SERVING)
    return "\n".join(lines)


# -- where an export may go (torch-free: `dflash-flow export` checks it before loading anything) --------
EXPORT_FILES = (CONFIG_NAME, WEIGHTS_NAME)


def _is_ours(name: str) -> bool:
    """An export's file, or the temporary file of an export cut short (``atomic_path``'s names)."""
    return name in EXPORT_FILES or any(name.startswith(f".{f}.") and name.endswith(".tmp") for f in EXPORT_FILES)


def check_destination(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] | list = ()) -> None:
    """Refuse (CheckpointError) an export into ``out`` when that would destroy something: ``out`` is, or
    lies inside, one of ``inputs`` (links followed: a checkpoint being exported, its checkpoints
    directory), or ``out`` holds anything but an earlier drafter export (a training checkpoint, another
    model, any other file). A missing or empty directory, or an earlier export, is fine."""
    from dflash_flow.util import is_within

    out = Path(out)
    for src in inputs:
        if is_within(out, src):
            raise CheckpointError(
                f"refusing to export into {out}: it is {'' if os.path.realpath(out) == os.path.realpath(src) else 'inside '}"
                f"the input {src}; choose an output directory outside it"
            )
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise CheckpointError(f"refusing to export into {out}: it is not a directory")
    if not out.is_dir():
        return
    foreign = sorted(p.name for p in out.iterdir() if not _is_ours(p.name))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        kind = "a training checkpoint" if {"MANIFEST.json", "state.json"} & set(foreign) else "other files"
        raise CheckpointError(
            f"refusing to export into {out}: it holds {kind} ({shown}), not an earlier drafter export; "
            "choose a new or empty directory"
        )
    config = out / CONFIG_NAME
    weights = out / WEIGHTS_NAME
    if weights.is_file() and not weights.is_symlink() and not config.is_file():  # a link is replaced: harmless
        try:
            drafterish = "fc.weight" in read_safetensors_header(weights)
        except CheckpointError:
            drafterish = False
        if not drafterish:
            raise CheckpointError(f"refusing to export into {out}: its {WEIGHTS_NAME} is not a drafter's (no "
                                  "config.json beside it); choose a new or empty directory")
    if config.is_file():
        try:
            archs = json.loads(config.read_text()).get("architectures")
        except (OSError, ValueError, AttributeError):
            archs = None
        if not isinstance(archs, list) or not {DFLASH, DFLASH2} & set(archs):
            raise CheckpointError(
                f"refusing to export into {out}: its config.json is another model's (architectures {archs!r}), "
                "not a drafter's; choose a new or empty directory"
            )
