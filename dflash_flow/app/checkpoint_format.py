"""A checkpoint on disk: its files and limits, Checkpoint, Expected, load_checkpoint (checking all it reads)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core.errors import CheckpointError
from dflash_flow.util import sha256_file

FORMAT_VERSION = 1
LATEST = "latest"
REQUIRED_FILES = ("model.safetensors", "optimizer.pt", "state.json")
MAX_MANIFEST_BYTES = 1 * 2**20
MAX_STATE_BYTES = 256 * 2**20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class InvalidCheckpoint(CheckpointError):
    """Not a usable checkpoint (missing, corrupted or malformed files): ``--resume latest`` falls back past these
    to the newest valid one (another configuration is a plain :class:`CheckpointError`: not damage to skip)."""


def _invalid(path: Path, why: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"not a valid checkpoint: {path}: {why}")


@attrs.define
class Checkpoint:
    path: Path
    step: int
    epoch: int
    data_position: dict[str, Any]
    stage_states: dict[str, list[dict[str, Any]]]
    mlflow_run_id: str | None
    config_hash: str
    extra: dict[str, Any]
    run_uid: str | None = None
    data_files: dict[str, str] = attrs.field(factory=dict)
    settings: dict[str, Any] | None = None  # None: written before checkpoints recorded them
    checkpoint_dir: str | None = None  # the directory (resolved) it was written into; None: not recorded
    extend: bool = False  # the resume was asked to extend the run (--extend): its length may differ

    def model_state(self, device: str = "cpu") -> dict[str, Any]:
        from safetensors.torch import load_file

        try:
            return load_file(str(self.path / "model.safetensors"), device=device)
        except Exception as exc:  # noqa: BLE001 - any failure to read the file is the file's fault
            raise _invalid(self.path, f"model.safetensors cannot be read ({_first_line(exc)})") from None

    def optimizer_state(self) -> dict[str, Any]:
        import torch

        try:
            return torch.load(self.path / "optimizer.pt", map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - weights_only refuses code (UnpicklingError) and garbage alike
            raise _invalid(self.path, f"optimizer.pt cannot be loaded safely ({_first_line(exc)})") from None

    def data_change(self, current: dict[str, str]) -> str | None:
        """A sentence naming the first data file that changed since this checkpoint (None: none did)."""
        for name, digest in current.items():
            old = self.data_files.get(name)
            if old is not None and old != digest:
                return (f"cannot resume from {self.path}: data file {name} changed since the checkpoint was written "
                        f"(sha256 {old[:12]}... then, {digest[:12]}... now); resume with the data it was trained on, "
                        "or start a fresh run")
        return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


@attrs.frozen
class Expected:
    """What a checkpoint must match to be resumed: the settings that can change the result (None: compare
    ``config_hash`` only), their hash, and the hash an older checkpoint of the same configuration carries."""

    config_hash: str = ""
    settings: dict[str, Any] | None = None
    legacy_hash: str = ""
    length_keys: frozenset[str] = frozenset()  # settings an extended resume may change
    extend: bool = False
    moved: dict[str, str] = attrs.field(factory=dict)  # stage settings since moved into a section: their keys now


def _check_identity(path: Path, state: dict[str, Any], expected: Expected) -> None:
    from dflash_flow.core.identity import recorded_as_today, settings_differences

    recorded = state.get("settings")
    if recorded is not None and expected.settings is not None:
        recorded = recorded_as_today(recorded, expected.moved, expected.settings)
        diffs, longer = (settings_differences(*({k: v for k, v in d.items() if (k in expected.length_keys) == length}
                                                for d in (recorded, expected.settings))) for length in (False, True))
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            raise CheckpointError(f"cannot resume from {path}: the checkpoint was written by another configuration "
                                  f"({shown}); these change the trained weights or the data order: resume with the "
                                  "checkpoint's values, or drop --resume to start a fresh run (in another output_dir)")
        if longer and not expected.extend:
            raise CheckpointError(f"cannot resume from {path}: the checkpoint was written by another configuration, with "
                                  f"another run length ({'; '.join(longer)}); pass --extend to train on to the new length "
                                  "(the learning-rate schedule is re-planned for the new total), or resume with the "
                                  "checkpoint's values")
        return
    have = state.get("config_hash")
    if not expected.config_hash or have in (expected.config_hash, expected.legacy_hash):
        return
    raise CheckpointError(f"cannot resume from {path}: the checkpoint was written by another configuration (config hash "
                          f"{have} != {expected.config_hash}; it predates checkpoints that record their settings, so the "
                          "fields that differ cannot be named): resume with the pipeline file and --set options it was "
                          "written with, or drop --resume to start a fresh run (in another output_dir)")


def plain_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def read_json(path: Path, name: str, limit: int) -> Any:
    f = path / name
    try:
        if f.stat().st_size > limit:
            raise _invalid(path, f"{name} is larger than {limit // 2**20} MiB")
        return json.loads(f.read_bytes())
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, bad UTF-8, a 5000-digit number, nesting
        raise _invalid(path, f"{name} is not valid JSON ({_first_line(exc)})") from None
    except OSError as exc:
        raise _invalid(path, f"{name} cannot be read ({exc.strerror or exc})") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_manifest(path: Path, manifest: Any) -> dict[str, str]:
    if not isinstance(manifest, dict):
        raise _invalid(path, f"MANIFEST.json must be a JSON object of file name -> sha256, got {type(manifest).__name__}")
    if not manifest:
        raise _invalid(path, "MANIFEST.json lists no files")
    for name, digest in manifest.items():
        if not plain_name(name):
            raise _invalid(path, f"MANIFEST.json names {name!r}, not a file of the checkpoint directory")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise _invalid(path, f"MANIFEST.json: the checksum of {name} is not a sha256 ({digest!r:.80})")
    for name in REQUIRED_FILES:
        if name not in manifest:
            raise _invalid(path, f"MANIFEST.json does not list {name}")
    return manifest


def _out_of_range(value: Any, where: str, depth: int = 0) -> str | None:
    """The first number under ``value`` that no checkpoint writes (NaN, infinity, an integer beyond 2**63),
    named by its path (``data_position.total (1e+30)``); None if there is none."""
    if isinstance(value, bool) or depth > 64:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"'{where}' ({value})"
    if isinstance(value, int) and abs(value) >= 2**63:
        return f"'{where}' ({value:.3g})"
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for k, v in items:
        found = _out_of_range(v, f"{where}.{k}", depth + 1)
        if found:
            return found
    return None


def _check_state(path: Path, state: Any) -> dict[str, Any]:
    from dflash_flow.data.epoch import MAX_POSITION, DataPosition

    def need(ok: bool, why: str) -> None:
        if not ok:
            raise _invalid(path, f"state.json: {why}")

    need(isinstance(state, dict), f"must be a JSON object, got {type(state).__name__}")
    version = state.get("format_version")
    if version != FORMAT_VERSION:
        raise _invalid(path, f"checkpoint format {version!r} is not supported (this version reads {FORMAT_VERSION})")
    for key in ("step", "epoch"):
        need(key in state, f"has no '{key}'")
        v = state[key]
        need(_is_int(v) and 0 <= v <= MAX_POSITION, f"'{key}' must be a non-negative integer, got {v!r:.80}"
             + (" (beyond 2**53: no run is that long)" if _is_int(v) and v > MAX_POSITION else ""))
    for key in ("data_position", "extra", "data_files", "settings"):
        need(state.get(key) is None or isinstance(state[key], dict), f"'{key}' must be an object")
    position = state.get("data_position") or {}
    if position:
        problem = DataPosition.problem(position)
        need(problem is None, str(problem))
    for where, value in (("data_position", position), ("stage_states", state.get("stage_states"))):
        bad = _out_of_range(value, where)
        need(bad is None, f"{bad} is not a number a checkpoint holds")
    need("stage_states" in state, "has no 'stage_states'")  # every writer records it ({} when there are none)
    stage_states = state["stage_states"]
    need(isinstance(stage_states, dict), "'stage_states' must be an object")
    for name, reps in stage_states.items():
        need(isinstance(reps, list) and all(isinstance(r, dict) for r in reps),
             f"'stage_states.{name}' must be a list of objects (one per replica)")
    for key in ("mlflow_run_id", "run_uid", "config_hash", "checkpoint_dir"):
        need(state.get(key) is None or isinstance(state[key], str), f"'{key}' must be a string")
    files = state.get("data_files") or {}
    need(all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()), "'data_files' must map names to sha256")
    return state


def load_checkpoint(path: str | Path, *, expected: Expected | None = None) -> Checkpoint:
    """Read and verify one checkpoint directory (nothing unpickled; weights and optimizer load on demand);
    ``expected``: the configuration it must have been written by, else CheckpointError naming what differs."""
    path = Path(path)
    if not (path / "MANIFEST.json").is_file():
        raise _invalid(path, "no MANIFEST.json (an incomplete checkpoint, or not a checkpoint)")
    manifest = _check_manifest(path, read_json(path, "MANIFEST.json", MAX_MANIFEST_BYTES))
    for name, digest in manifest.items():
        f = path / name
        if f.is_symlink() or not f.is_file():
            raise _invalid(path, f"missing {name}" if not f.exists() else f"{name} is not a regular file")
        try:
            actual = sha256_file(f)
        except OSError as exc:
            raise _invalid(path, f"{name} cannot be read ({exc.strerror or exc})") from None
        if actual != digest:
            raise _invalid(path, f"{name} is corrupted (checksum mismatch)")
    state = _check_state(path, read_json(path, "state.json", MAX_STATE_BYTES))
    if expected is not None:
        _check_identity(path, state, expected)
    _check_safetensors_header(path)
    return Checkpoint(path=path, step=state["step"], epoch=state["epoch"], data_position=state.get("data_position") or {},
                      stage_states=state.get("stage_states") or {}, mlflow_run_id=state.get("mlflow_run_id"),
                      config_hash=state.get("config_hash") or "", extra=state.get("extra") or {},
                      run_uid=state.get("run_uid"), data_files=state.get("data_files") or {},
                      settings=state.get("settings"), checkpoint_dir=state.get("checkpoint_dir"))


def _check_safetensors_header(path: Path) -> None:
    """The weights file parses as safetensors (its header only: cheap, and it needs no torch)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends: the file is not what it claims
        raise _invalid(path, f"model.safetensors is not a safetensors file ({_first_line(exc)})") from None

