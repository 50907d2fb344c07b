"""Resumable training checkpoints: written atomically, verified on load, the last K kept.

Layout of one checkpoint directory ``step-00000123/``:
  model.safetensors   trainable weights (safetensors: loading never runs code)
  optimizer.pt        optimizer + scheduler state (loaded with ``torch.load(weights_only=True)``)
  state.json          step, epoch, data position, every stage's state_dict, MLflow run id, config hash
  MANIFEST.json       sha256 of every file above; written last
A checkpoint is first written to a hidden temporary directory and renamed into place, so a crash
mid-write leaves either the previous checkpoints or a complete new one, never a half-written one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

from dflash_flow.core.errors import CheckpointError
from dflash_flow.util import atomic_write_text, sha256_file

FORMAT_VERSION = 1
LATEST = "latest"

__all__ = ["LATEST", "Checkpoint", "CheckpointError", "CheckpointService", "Checkpointer", "load_checkpoint"]

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

    def model_state(self, device: str = "cpu") -> dict[str, Any]:
        from safetensors.torch import load_file

        return load_file(str(self.path / "model.safetensors"), device=device)

    def optimizer_state(self) -> dict[str, Any]:
        import torch

        return torch.load(self.path / "optimizer.pt", map_location="cpu", weights_only=True)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Checkpointer:
    """Writes and finds checkpoints in one directory."""

    def __init__(self, directory: str | Path, *, keep_last: int = 3, config_hash: str = ""):
        self.dir = Path(directory)
        self.keep_last = keep_last
        self.config_hash = config_hash
        self.mlflow_run_id: str | None = None
        # The tracker may create its run late (store unreachable at start): ask it at save time.
        self.tracker: Any = None

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
        makes the checkpoint directory loadable by ``dflash-flow export``)."""
        import torch
        from safetensors.torch import save_file

        self.dir.mkdir(parents=True, exist_ok=True)
        final = self.dir / f"step-{step:08d}"
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-step-{step:08d}-", dir=self.dir))
        try:
            tensors = {k: v.detach().to("cpu").contiguous() for k, v in model_state.items()}
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            torch.save(optimizer_state, tmp / "optimizer.pt")
            state = {
                "format_version": FORMAT_VERSION,
                "step": step,
                "epoch": epoch,
                "data_position": data_position,
                "stage_states": stage_states or {},
                "mlflow_run_id": getattr(self.tracker, "run_id", None) or self.mlflow_run_id,
                "config_hash": self.config_hash,
                "extra": extra or {},
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1, default=_json_default))
            names = ["model.safetensors", "optimizer.pt", "state.json"]
            for name, text in (files or {}).items():
                if "/" in name or name.startswith(".") or name in names or name == "MANIFEST.json":
                    raise ValueError(f"bad checkpoint file name {name!r}")
                (tmp / name).write_text(text)
                names.append(name)
            manifest = {name: sha256_file(tmp / name) for name in names}
            (tmp / "MANIFEST.json").write_text(json.dumps(manifest, indent=1))
            for name in (*manifest, "MANIFEST.json"):
                with open(tmp / name, "rb") as f:
                    os.fsync(f.fileno())
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_latest(final.name)
        self._prune()
        return final

    def _write_latest(self, name: str) -> None:
        atomic_write_text(self.dir / LATEST, name + "\n")

    def _prune(self) -> None:
        # The last K *written*, not the K highest steps: a fresh run in an output directory that still
        # holds an earlier run's (higher-step) checkpoints must keep its own, and `latest` must find them.
        complete = self._by_write_time()
        for old in complete[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.dir.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    def list(self) -> list[Path]:
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("step-*") if (p / "MANIFEST.json").is_file())

    def _by_write_time(self) -> list[Path]:
        """Complete checkpoints, oldest written first (MANIFEST.json is written last)."""

        def key(p: Path) -> tuple[int, str]:
            try:
                return (p.joinpath("MANIFEST.json").stat().st_mtime_ns, p.name)
            except OSError:
                return (0, p.name)

        return sorted(self.list(), key=key)

    def resolve(self, spec: str | Path) -> Path:
        """``latest`` or a path (a checkpoint dir, or a checkpoints dir whose latest is taken)."""
        if str(spec) == LATEST:
            marker = self.dir / LATEST
            if marker.is_file():
                cand = self.dir / marker.read_text().strip()
                if (cand / "MANIFEST.json").is_file():
                    return cand
            found = self._by_write_time()
            if not found:
                raise CheckpointError(f"--resume latest: no checkpoint in {self.dir}")
            return found[-1]
        p = Path(spec)
        if (p / "MANIFEST.json").is_file() or (p / "state.json").is_file():
            return p
        if (p / LATEST).is_file() or any(p.glob("step-*")):
            return Checkpointer(p).resolve(LATEST)
        raise CheckpointError(f"no checkpoint at {p}")

    def load(self, spec: str | Path, *, check_config: bool = True) -> Checkpoint:
        return load_checkpoint(self.resolve(spec), expected_config_hash=self.config_hash if check_config else None)


def load_checkpoint(path: str | Path, *, expected_config_hash: str | None = None) -> Checkpoint:
    path = Path(path)
    manifest_path = path / "MANIFEST.json"
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: not a complete checkpoint (no MANIFEST.json)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted MANIFEST.json ({exc})") from None
    for name, digest in manifest.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: missing {name}")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{path}: {name} is corrupted (checksum mismatch)")
    try:
        state = json.loads((path / "state.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: corrupted state.json ({exc})") from None
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {state.get('format_version')} is not supported")
    if expected_config_hash and state.get("config_hash") != expected_config_hash:
        raise CheckpointError(
            f"{path}: checkpoint was written by another configuration (config hash "
            f"{state.get('config_hash')} != {expected_config_hash}); the stages section must match to resume"
        )
    return Checkpoint(
        path=path,
        step=int(state["step"]),
        epoch=int(state["epoch"]),
        data_position=state.get("data_position") or {},
        stage_states=state.get("stage_states") or {},
        mlflow_run_id=state.get("mlflow_run_id"),
        config_hash=state.get("config_hash", ""),
        extra=state.get("extra") or {},
    )


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

    def due(self, step: int, epoch_end: bool) -> bool:
        every = self.policy.every_steps
        return bool(every and step % every == 0) or (epoch_end and self.policy.at_epoch_end)

    def after_step(self, source: Any, *, step: int, epoch_end: bool) -> Path | None:
        return self.save(source, epoch_end=epoch_end) if self.due(step, epoch_end) else None

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
