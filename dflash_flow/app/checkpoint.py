"""The run's checkpoints: CheckpointService and the Checkpointer (writing atomically, pruning this run's lineage,
finding the newest valid one); the files and loading are checkpoint_format's.

Layout of one checkpoint directory ``step-00000123/``:
  model.safetensors   trainable weights (safetensors: loading never runs code)
  optimizer.pt        optimizer + scheduler state (loaded with ``torch.load(weights_only=True)``)
  state.json          step, epoch, data position, every stage's state, MLflow run id, the result settings and
                      their hash, the lineage id (``run_uid``: the only checkpoints a run prunes), the directory
                      it was written into (a copy elsewhere is a fork) and the sha256 of every data file
  MANIFEST.json       sha256 of every file above; written last
Written to a hidden temporary directory and renamed into place: a crash leaves the old ones or a complete new one."""
from __future__ import annotations

import io
import json
import logging
import os
import re
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

from dflash_flow.core.errors import CheckpointError
from dflash_flow.util import atomic_write_text, fsync_dir, is_within, sha256_file

from .checkpoint_format import (
    FORMAT_VERSION,
    LATEST,
    MAX_STATE_BYTES,
    REQUIRED_FILES,
    Checkpoint,
    Expected,
    InvalidCheckpoint,
    load_checkpoint,
    plain_name,
    read_json,
)

_STEP_NAME = re.compile(r"^step-\d{8,}$")

log = logging.getLogger("dflash_flow")


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


class Checkpointer:
    """Writes and finds checkpoints in one directory, never outside ``root`` (links followed). ``expected``: what
    a resume must match (from ``config_hash``, ``settings``, ...); ``data_files``: sha256 per data file."""

    def __init__(self, directory: str | Path, *, keep_last: int = 3, config_hash: str = "",
                 run_uid: str | None = None, data_files: dict[str, str] | None = None,
                 root: str | Path | None = None, settings: dict[str, Any] | None = None, legacy_hash: str = "",
                 length_keys: frozenset[str] | set[str] = frozenset(), extend: bool = False,
                 moved: dict[str, str] | None = None):
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.expected = Expected(config_hash, settings, legacy_hash, frozenset(length_keys), extend, dict(moved or {}))
        self.run_uid = run_uid or uuid.uuid4().hex  # a fresh run's lineage
        self.data_files = dict(data_files or {})
        self.root = Path(root) if root is not None else None
        self.mlflow_run_id: str | None = None  # recorded when a save names none

    def save(self, *, step: int, epoch: int, model_state: dict[str, Any], optimizer_state: dict[str, Any],
             data_position: dict[str, Any], stage_states: dict[str, list[dict[str, Any]]] | None = None,
             extra: dict[str, Any] | None = None, files: dict[str, str] | None = None,
             mlflow_run_id: str | None = None) -> Path:
        """Write one checkpoint (``files``: small text files, e.g. the drafter's ``config.json``)."""
        final = self.dir / f"step-{step:08d}"
        import torch

        tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
        bad = next((k for k, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())),
                   None)
        if bad is not None:
            raise CheckpointError(f"refusing to write checkpoint {final}: weight {bad} holds NaN or infinite values (the "
                                  "training diverged); the last checkpoint written stays the newest")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            if self.root is not None and not is_within(self.dir, self.root):
                raise CheckpointError(f"checkpoint directory {self.dir} leads outside {self.root} (through a symbolic "
                                      f"link to {os.path.realpath(self.dir)}); the run writes only inside its output "
                                      "directory")
            path = self._write(final, step, epoch, tensors, optimizer_state, data_position, stage_states, extra, files,
                               mlflow_run_id or self.mlflow_run_id)
        except OSError as exc:
            raise CheckpointError(f"cannot write checkpoint {final}: {exc.strerror or exc}; the earlier checkpoints "
                                  "are intact") from exc
        self._prune()
        return path

    def _write(self, final, step, epoch, tensors, optimizer_state, data_position, stage_states, extra, files,
               mlflow_run_id) -> Path:
        import torch

        from dflash_flow.model.export import write_safetensors

        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-{self.run_uid[:12]}-", dir=self.dir))
        try:
            write_safetensors(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
            with _RecordingFile(tmp / "optimizer.pt", "w") as f:
                try:
                    torch.save(optimizer_state, f)
                except Exception:
                    if f.error is not None:
                        raise f.error from None
                    raise
            state = {"format_version": FORMAT_VERSION, "step": step, "epoch": epoch, "data_position": data_position,
                     "stage_states": stage_states or {}, "mlflow_run_id": mlflow_run_id,
                     "config_hash": self.expected.config_hash, "settings": self.expected.settings,
                     "checkpoint_dir": os.path.realpath(self.dir), "run_uid": self.run_uid,
                     "data_files": self.data_files, "extra": extra or {}}
            (tmp / "state.json").write_text(json.dumps(state, indent=1, default=_json_default))
            names = list(REQUIRED_FILES)
            for name, text in (files or {}).items():
                if not plain_name(name) or name in names or name == "MANIFEST.json":
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
        # The last K *written* of this run's lineage, not the K highest steps: an earlier run's stay.
        own = [p for p in self._by_write_time() if _run_uid_of(p) == self.run_uid]
        for old in own[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.dir.glob(f".tmp-step-*-{self.run_uid[:12]}-*"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)

    def holds(self, ckpt: Checkpoint) -> bool:
        """Whether ``ckpt`` lies here and was written here (a resume from any other forks a new run)."""
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
        if _is_checkpoint(p):
            return p
        if holds_checkpoints(p):
            return Checkpointer(p).resolve(LATEST)
        raise CheckpointError(f"no checkpoint at {p}")

    def load(self, spec: str | Path, *, check_config: bool = True) -> Checkpoint:
        """Load ``spec``; ``latest`` or a checkpoints directory: the newest valid one (invalid ones warned of)."""
        expected = self.expected if check_config else None
        p = Path(spec)
        if str(spec) == LATEST:
            return _load_newest_valid(self, LATEST, expected)
        if not _is_checkpoint(p) and holds_checkpoints(p):
            return _load_newest_valid(Checkpointer(p), str(p), expected)
        return load_checkpoint(self.resolve(spec), expected=expected)


def _is_checkpoint(p: Path) -> bool:
    return (p / "MANIFEST.json").is_file() or (p / "state.json").is_file()


def holds_checkpoints(p: Path) -> bool:
    return (p / LATEST).is_file() or any(p.glob("step-*"))


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


def _run_uid_of(path: Path) -> str | None:
    try:
        state = read_json(path, "state.json", MAX_STATE_BYTES)
    except InvalidCheckpoint:
        return None
    return state.get("run_uid") if isinstance(state, dict) else None


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"cannot store {type(obj).__name__} in a checkpoint state")


class CheckpointService:
    """The ``checkpoint:`` policy in front of a :class:`Checkpointer`: the trainer reports each step and hands
    over a ``services.CheckpointPayload`` when one is due; the service adds the other stages' states."""

    def __init__(self, checkpointer: Checkpointer, policy: Any, *, stage_states: Any = None, dist: Any = None,
                 tracker: Any = None, before_commit: Any = None, elapsed_s: Any = None) -> None:
        self.checkpointer, self.policy, self.on_signal = checkpointer, policy, bool(policy.on_signal)
        self.stage_states = stage_states  # () -> {stage: [state per replica]}: the running pipeline's
        self.dist = dist  # app.distributed.Distributed under torchrun: rank 0 writes, every rank waits
        self.tracker = tracker  # its run id is asked at each save (a run made late, the store unreachable at first)
        self.before_commit = before_commit  # (step) -> None before a checkpoint commits (runner.flush_tracking)
        self.elapsed_s = elapsed_s  # () -> seconds run, resumed runs included (state.json's extra.elapsed_s)
        self.last_path: Path | None = None

    def after_step(self, source: Any, *, step: int, epoch_end: bool) -> Path | None:
        every = self.policy.every_steps
        due = bool(every and step % every == 0) or (epoch_end and self.policy.at_epoch_end)
        return self.save(source, epoch_end=epoch_end) if due else None

    def at_stop(self, source: Any, *, trained: bool) -> Path | None:
        """The stop checkpoint (``on_signal``), when the trainer trained since its last one; under torchrun
        every rank writes it regardless (the save is collective: no rank may skip it)."""
        if self.on_signal and (trained or self.dist is not None):
            return self.save(source)
        return None

    def save(self, source: Any, *, epoch_end: bool = False) -> Path | None:
        """Write a checkpoint; under torchrun collective: positions gathered, rank 0 writes, all wait for it."""
        payload = source.checkpoint_payload(epoch_end)
        extra = dict(payload.extra)
        if self.elapsed_s is not None:
            extra["elapsed_s"] = round(float(self.elapsed_s()), 3)
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
                step=payload.step, epoch=payload.epoch, model_state=payload.model_state,
                optimizer_state=payload.optimizer_state, data_position=payload.data_position, stage_states=states,
                extra=extra, files=payload.files, mlflow_run_id=self.tracker.run_id if self.tracker is not None else None)
        finally:
            if self.dist is not None:
                self.dist.barrier()
        return self.last_path
