"""Resumable training checkpoints: written atomically, verified on load, the last K of this run kept.

Layout of one checkpoint directory ``step-00000123/``:
  model.safetensors   trainable weights (safetensors: loading never runs code)
  optimizer.pt        optimizer + scheduler state (loaded with ``torch.load(weights_only=True)``)
  state.json          step, epoch, data position, every stage's state_dict, MLflow run id, the settings
                      that can change the result (``core.identity.result_settings``) and their hash,
                      the run's lineage id, the directory it was written into (a copy elsewhere is a
                      fork: ``Checkpointer.holds``) and the sha256 of every data file
  MANIFEST.json       sha256 of every file above; written last
A checkpoint is first written to a hidden temporary directory and renamed into place, so a crash
mid-write (or a full disk) leaves either the previous checkpoints or a complete new one, never a
half-written one.

Pruning removes only checkpoints of this run's lineage (``run_uid`` in state.json: a fresh run draws a
new one, a resumed run keeps its checkpoint's), so a checkpoint directory shared with anything else never
loses what it did not write. Loading checks everything it reads (the manifest, every checksum, the shape of
state.json) and names the checkpoint and the reason: ``not a valid checkpoint: PATH: why``.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core.errors import CheckpointError
from dflash_flow.util import atomic_write_text, fsync_dir, is_within, sha256_file

FORMAT_VERSION = 1
LATEST = "latest"
REQUIRED_FILES = ("model.safetensors", "optimizer.pt", "state.json")
MAX_MANIFEST_BYTES = 1 * 2**20
MAX_STATE_BYTES = 256 * 2**20
_STEP_NAME = re.compile(r"^step-\d{8,}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")

log = logging.getLogger("dflash_flow")

__all__ = [
    "LATEST",
    "Checkpoint",
    "CheckpointError",
    "CheckpointService",
    "Checkpointer",
    "InvalidCheckpoint",
    "load_checkpoint",
    "new_run_uid",
]


class InvalidCheckpoint(CheckpointError):
    """The directory is not a usable checkpoint (missing, corrupted or malformed files). ``--resume
    latest`` falls back past these to the newest valid one; a checkpoint of another configuration is a
    plain :class:`CheckpointError` (a decision to make, not damage to skip)."""


def _invalid(path: Path, why: str) -> InvalidCheckpoint:
    return InvalidCheckpoint(f"not a valid checkpoint: {path}: {why}")


def new_run_uid() -> str:
    """The lineage id of a fresh run (which checkpoints it may prune)."""
    return uuid.uuid4().hex


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
        """A sentence naming the first data file whose content differs from the one this checkpoint was
        trained on (None when all match, or when the checkpoint recorded none)."""
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


class _RecordingFile(io.FileIO):
    """A file that remembers the OSError of a failed write: torch's zip writer reports a full disk as a
    RuntimeError ("unexpected pos ...") that no longer says why."""

    error: OSError | None = None

    def write(self, b):  # noqa: ANN001
        try:
            return super().write(b)
        except OSError as exc:
            self.error = exc
            raise


def _torch_save(torch: Any, obj: Any, path: Path) -> None:
    with _RecordingFile(path, "w") as f:
        try:
            torch.save(obj, f)
        except Exception:
            if f.error is not None:
                raise f.error from None
            raise


def _nonfinite(tensors: dict[str, Any]) -> str | None:
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


class Checkpointer:
    """Writes and finds checkpoints in one directory.

    ``root``: the directory every write must stay in once symbolic links are followed (the run's output
    directory, or the checkpoint directory itself when the user chose one). ``run_uid``: this run's
    lineage, the only checkpoints it prunes. ``data_files``: sha256 per data file, recorded for resume.
    ``settings`` (``core.identity.result_settings``) and ``config_hash`` (their hash): what a checkpoint must
    match to be resumed (``load``); ``legacy_hash``: what a checkpoint written before checkpoints recorded
    their settings carries when it matches this configuration. ``length_keys`` (``core.identity.run_length_keys``)
    may differ when ``extend`` (``--extend``): the run is then extended, not refused.
    """

    def __init__(self, directory: str | Path, *, keep_last: int = 3, config_hash: str = "",
                 run_uid: str | None = None, data_files: dict[str, str] | None = None,
                 root: str | Path | None = None, settings: dict[str, Any] | None = None, legacy_hash: str = "",
                 length_keys: frozenset[str] | set[str] = frozenset(), extend: bool = False):
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.settings = settings
        self.legacy_hash = legacy_hash
        self.length_keys = frozenset(length_keys)
        self.extend = extend
        self.run_uid = run_uid or new_run_uid()
        self.data_files = dict(data_files or {})
        self.root = Path(root) if root is not None else None
        self.mlflow_run_id: str | None = None
        # The tracker may create its run late (store unreachable at start): ask it at save time.
        self.tracker: Any = None  # observe.tracking.Tracker, once the run has one

    # -- writing ------------------------------------------------------------------------------------
    def save(
        self,
        *,
        step: int,
        epoch: int,
        model_state: dict[str, Any],
        optimizer_state: dict[str, Any],
        data_position: dict[str, Any],
        stage_states: dict[str, list[dict[str, Any]]] | None = None,
        extra: dict[str, Any] | None = None,
        files: dict[str, str] | None = None,
    ) -> Path:
        """Write one checkpoint. ``files`` adds small text files (e.g. the drafter's ``config.json``, which
        makes the checkpoint directory loadable by ``dflash-flow export``). A write that fails (a full disk,
        a read-only mount) raises CheckpointError naming the checkpoint; the earlier ones stay intact."""
        final = self.dir / f"step-{step:08d}"
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        bad = _nonfinite(tensors)
        if bad is not None:
            raise CheckpointError(
                f"refusing to write checkpoint {final}: weight {bad} holds NaN or infinite values (the training "
                "diverged); the last checkpoint written stays the newest"
            )
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._check_contained()
            path = self._write(final, step, epoch, tensors, optimizer_state, data_position, stage_states, extra, files)
        except OSError as exc:
            raise CheckpointError(
                f"cannot write checkpoint {final}: {exc.strerror or exc}; the earlier checkpoints are intact"
            ) from exc
        self._prune()
        return path

    def _check_contained(self) -> None:
        if self.root is not None and not is_within(self.dir, self.root):
            raise CheckpointError(
                f"checkpoint directory {self.dir} leads outside {self.root} (through a symbolic link to "
                f"{os.path.realpath(self.dir)}); the run writes only inside its output directory"
            )

    def _write(self, final, step, epoch, tensors, optimizer_state, data_position, stage_states, extra, files) -> Path:
        import torch

        from dflash_flow.model.export import write_safetensors

        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-{self.run_uid[:12]}-", dir=self.dir))
        try:
            write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
            _torch_save(torch, optimizer_state, tmp / "optimizer.pt")
            state = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "epoch": epoch,
                "data_position": data_position,
                "stage_states": stage_states or {},
                "mlflow_run_id": (self.tracker.run_id if self.tracker is not None else None) or self.mlflow_run_id,
                "config_hash": self.config_hash,
                "settings": self.settings,
                "checkpoint_dir": os.path.realpath(self.dir),
                "run_uid": self.run_uid,
                "data_files": self.data_files,
                "extra": extra or {},
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1, default=_json_default))
            names = list(REQUIRED_FILES)
            for name, text in (files or {}).items():
                if not _plain_name(name) or name in names or name == "MANIFEST.json":
                    raise ValueError(f"bad checkpoint file name {name!r}")
                (tmp / name).write_text(text)
                names.append(name)
            manifest = {name: sha256_file(tmp / name) for name in names}
            (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
            for name in (*manifest, "MANIFEST.json"):
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
            if final.is_symlink():
                final.unlink()  # our name: the link goes, never what it points to
            elif final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_dir(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        atomic_write_text(self.dir / LATEST, final.name + "\n")
        return final

    def _prune(self) -> None:
        # The last K *written* of this run's lineage, not the K highest steps: a fresh run in a directory
        # that still holds an earlier run's (higher-step) checkpoints keeps its own, and leaves theirs alone.
        own = [p for p in self._by_write_time() if _run_uid_of(p) == self.run_uid]
        for old in own[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.dir.glob(f".tmp-step-*-{self.run_uid[:12]}-*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)

    # -- finding ------------------------------------------------------------------------------------
    def holds(self, ckpt: Checkpoint) -> bool:
        """Whether ``ckpt`` is one of this directory's own: it lies here and was written here (not copied or
        moved in from elsewhere). A resume from one continues its run; from any other, it forks a new one."""
        here = os.path.realpath(self.dir)
        return os.path.realpath(ckpt.path.parent) == here and ckpt.checkpoint_dir in (None, here)

    def list(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("step-*")
                      if _STEP_NAME.match(p.name) and not p.is_symlink() and (p / "MANIFEST.json").is_file())

    def _by_write_time(self) -> list[Path]:
        """Complete checkpoints, oldest written first (MANIFEST.json is written last)."""

        def key(p: Path) -> tuple[int, str]:
            try:
                return (p.joinpath("MANIFEST.json").stat().st_mtime_ns, p.name)
            except OSError:
                return (0, p.name)

        return sorted(self.list(), key=key)

    def candidates(self) -> list[Path]:
        """This directory's checkpoints, newest first: the one ``latest`` names, then by write time."""
        found = list(reversed(self._by_write_time()))
        marked = self._marked()
        if marked is not None and marked in found:
            found.remove(marked)
            found.insert(0, marked)
        return found

    def _marked(self) -> Path | None:
        marker = self.dir / LATEST
        try:
            with open(marker, "rb") as f:
                name = f.read(256).decode("utf-8", "replace").strip()
        except OSError:
            return None
        return self.dir / name if _STEP_NAME.match(name) else None  # never a path out of the directory

    def resolve(self, spec: str | Path) -> Path:
        """``latest`` or a path (a checkpoint dir, or a checkpoints dir whose latest is taken)."""
        if str(spec) == LATEST:
            found = self.candidates()
            if not found:
                raise CheckpointError(f"no checkpoint in {self.dir}")  # said by export too: no --resume here
            return found[0]
        p = Path(spec)
        if (p / "MANIFEST.json").is_file() or (p / "state.json").is_file():
            return p
        if (p / LATEST).is_file() or any(p.glob("step-*")):
            return Checkpointer(p).resolve(LATEST)
        raise CheckpointError(f"no checkpoint at {p}")

    def load(self, spec: str | Path, *, check_config: bool = True) -> Checkpoint:
        """Load ``spec``. For ``latest`` (or a directory of checkpoints) an invalid newest checkpoint is
        skipped with one warning and the newest valid one is loaded; a single checkpoint path must be valid."""
        expected = (Expected(self.config_hash, self.settings, self.legacy_hash, self.length_keys, self.extend)
                    if check_config else None)
        p = Path(spec)
        if str(spec) == LATEST:
            return _load_newest_valid(self, LATEST, expected)
        if not ((p / "MANIFEST.json").is_file() or (p / "state.json").is_file()) and (
            (p / LATEST).is_file() or any(p.glob("step-*"))
        ):
            return _load_newest_valid(Checkpointer(p), str(p), expected)
        return load_checkpoint(self.resolve(spec), expected=expected)


@attrs.frozen
class Expected:
    """What a checkpoint must match to be resumed: the settings that can change the result (None: compare
    ``config_hash`` only), their hash, and the hash an older checkpoint of the same configuration carries."""

    config_hash: str = ""
    settings: dict[str, Any] | None = None
    legacy_hash: str = ""
    length_keys: frozenset[str] = frozenset()  # settings an extended resume may change
    extend: bool = False


def _check_identity(path: Path, state: dict[str, Any], expected: Expected) -> None:
    from dflash_flow.core.identity import settings_differences

    recorded = state.get("settings")
    if recorded is not None and expected.settings is not None:
        length = expected.length_keys
        diffs = settings_differences({k: v for k, v in recorded.items() if k not in length},
                                     {k: v for k, v in expected.settings.items() if k not in length})
        longer = settings_differences({k: v for k, v in recorded.items() if k in length},
                                      {k: v for k, v in expected.settings.items() if k in length})
        if diffs:
            shown = "; ".join(diffs[:8]) + (f"; and {len(diffs) - 8} more" if len(diffs) > 8 else "")
            raise CheckpointError(
                f"cannot resume from {path}: the checkpoint was written by another configuration ({shown}); "
                "these change the trained weights or the data order: resume with the checkpoint's values, or drop "
                "--resume to start a fresh run (in another output_dir)"
            )
        if longer and not expected.extend:
            raise CheckpointError(
                f"cannot resume from {path}: the checkpoint was written by another configuration, with another run "
                f"length ({'; '.join(longer)}); pass --extend to train on to the new length (the learning-rate "
                "schedule is re-planned for the new total), or resume with the checkpoint's values"
            )
        return
    have = state.get("config_hash")
    if not expected.config_hash or have in (expected.config_hash, expected.legacy_hash):
        return
    raise CheckpointError(
        f"cannot resume from {path}: the checkpoint was written by another configuration (config hash {have} != "
        f"{expected.config_hash}; it predates checkpoints that record their settings, so the fields that differ "
        "cannot be named): resume with the pipeline file and --set options it was written with, or drop --resume "
        "to start a fresh run (in another output_dir)"
    )


def _load_newest_valid(ck: Checkpointer, spec: str, expected: Expected | None) -> Checkpoint:
    found = ck.candidates()
    if not found:
        raise CheckpointError(f"--resume {spec}: no checkpoint in {ck.dir}")
    skipped: list[InvalidCheckpoint] = []
    for path in found:
        try:
            loaded = load_checkpoint(path, expected=expected)
        except InvalidCheckpoint as exc:
            skipped.append(exc)
            continue
        if skipped:
            reasons = "; ".join(str(e).removeprefix("not a valid checkpoint: ") for e in skipped)
            log.warning("skipping %d invalid checkpoint(s) (%s); resuming from the newest valid one, %s",
                        len(skipped), reasons, path)
        return loaded
    raise skipped[0]


def _plain_name(name: Any) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name and not name.startswith(".")


def _run_uid_of(path: Path) -> str | None:
    try:
        with open(path / "state.json", "rb") as f:
            state = json.loads(f.read(MAX_STATE_BYTES))
    except (OSError, ValueError, RecursionError):
        return None
    return state.get("run_uid") if isinstance(state, dict) else None


def _read_json(path: Path, name: str, limit: int) -> Any:
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
        if not _plain_name(name):
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
    from dflash_flow.data.epoch import MAX_POSITION, plan_state_problem

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
        need(_is_int(position.get("epoch")) and 0 <= position["epoch"] <= MAX_POSITION,
             f"'data_position.epoch' must be a non-negative integer, got {position.get('epoch')!r:.80}")
        need(position.get("total") is None or (_is_int(position["total"]) and 0 <= position["total"] <= MAX_POSITION),
             f"'data_position.total' must be a non-negative integer, got {position.get('total')!r:.80}")
        if position.get("plan") is not None:
            problem = plan_state_problem(position["plan"])
            need(problem is None, f"'data_position.plan': {problem}")
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


def load_checkpoint(path: str | Path, *, expected_config_hash: str | None = None,
                    expected: Expected | None = None) -> Checkpoint:
    """Read and verify one checkpoint directory (nothing is unpickled here; the weights and the optimizer
    state are loaded on demand, from safetensors and with ``weights_only``). ``expected`` (or just
    ``expected_config_hash``): the configuration it must have been written by, else CheckpointError naming
    each setting that differs."""
    path = Path(path)
    if not (path / "MANIFEST.json").is_file():
        raise _invalid(path, "no MANIFEST.json (an incomplete checkpoint, or not a checkpoint)")
    manifest = _check_manifest(path, _read_json(path, "MANIFEST.json", MAX_MANIFEST_BYTES))
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
    state = _check_state(path, _read_json(path, "state.json", MAX_STATE_BYTES))
    if expected is None and expected_config_hash:
        expected = Expected(expected_config_hash)
    if expected is not None:
        _check_identity(path, state, expected)
    _check_safetensors_header(path)
    return Checkpoint(
        path=path,
        step=state["step"],
        epoch=state["epoch"],
        data_position=state.get("data_position") or {},
        stage_states=state.get("stage_states") or {},
        mlflow_run_id=state.get("mlflow_run_id"),
        config_hash=state.get("config_hash") or "",
        extra=state.get("extra") or {},
        run_uid=state.get("run_uid"),
        data_files=state.get("data_files") or {},
        settings=state.get("settings"),
        checkpoint_dir=state.get("checkpoint_dir"),
    )


def _check_safetensors_header(path: Path) -> None:
    """The weights file parses as safetensors (its header only: cheap, and it needs no torch)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path / "model.safetensors"), framework="numpy") as f:
            f.keys()
    except Exception as exc:  # noqa: BLE001 - SafetensorError and friends: the file is not what it claims
        raise _invalid(path, f"model.safetensors is not a safetensors file ({_first_line(exc)})") from None


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint state")


def checkpoint_size_estimate(num_params: int) -> int:
    """Bytes one checkpoint of a drafter with ``num_params`` trainable parameters may take: fp32 weights,
    fp32 masters and two AdamW moments (16 bytes a parameter), plus a little for the JSON files."""
    return int(math.ceil(num_params * 16)) + 2**20


class CheckpointService:
    """The run's checkpoint policy (``checkpoint:`` section) in front of a :class:`Checkpointer`.

    A trainer stage reports each optimizer step (``after_step``) and hands over a
    ``services.CheckpointPayload`` when a checkpoint is due; the service adds every other stage's state
    (``stage_states``, the pipeline's) and writes it. ``last_path`` is what the application reports.
    """

    def __init__(self, checkpointer: Checkpointer, policy: Any, stage_states: Any = None, dist: Any = None) -> None:
        self.checkpointer = checkpointer
        self.policy = policy
        self.on_signal = bool(policy.on_signal)
        self.stage_states = stage_states  # () -> {stage: [state per replica]}; set once the pipeline exists
        self.dist = dist  # app.distributed.Distributed under torchrun: rank 0 writes, every rank waits
        self.last_path: Path | None = None
        # (step) -> None, called by the writing rank before a checkpoint of ``step`` is written: the
        # application puts the metrics of every step up to it into MLflow first (session.flush_tracking),
        # so that a run killed after the checkpoint has, after its resume, each step's metrics exactly once.
        self.before_commit: Any = None

    def due(self, step: int, epoch_end: bool) -> bool:
        every = self.policy.every_steps
        return bool(every and step % every == 0) or (epoch_end and self.policy.at_epoch_end)

    def after_step(self, source: Any, *, step: int, epoch_end: bool) -> Path | None:
        return self.save(source, epoch_end=epoch_end) if self.due(step, epoch_end) else None

    def at_stop(self, source: Any, *, trained: bool) -> Path | None:
        """The stop checkpoint (``on_signal``), when the trainer trained since its last one; under torchrun
        every rank writes it regardless (the save is collective: no rank may skip it)."""
        if self.on_signal and (trained or self.dist is not None):
            return self.save(source)
        return None

    def save(self, source: Any, *, epoch_end: bool = False) -> Path | None:
        """Write a checkpoint. Under torchrun every rank calls this at the same step (it is collective):
        the ranks' data positions are gathered, rank 0 writes once, and nobody goes on before it is done."""
        payload = source.checkpoint_payload(epoch_end)
        extra = dict(payload.extra)
        if self.dist is not None:
            positions = self.dist.all_gather_object(payload.data_position)
            extra.update(world_size=self.dist.world_size, data_positions=positions)
            if self.dist.rank != 0:
                self.dist.barrier()
                self.last_path = self.checkpointer.dir / f"step-{payload.step:08d}"
                return self.last_path
        states = self.stage_states() if self.stage_states is not None else {}
        states[payload.stage] = [payload.stage_state]
        try:
            if self.before_commit is not None:
                self.before_commit(payload.step)
            self.last_path = self.checkpointer.save(
                step=payload.step,
                epoch=payload.epoch,
                model_state=payload.model_state,
                optimizer_state=payload.optimizer_state,
                data_position=payload.data_position,
                stage_states=states,
                extra=extra,
                files=payload.files,
            )
        finally:
            if self.dist is not None:
                self.dist.barrier()
        return self.last_path
