"""The prepare phase of a run: everything before the MLflow run that can fail on the user's input or machine
(``UserError``): the ranks agree, the output directory is made, checked and locked, the places the run writes
checked, the checkpoint to resume found and verified, the free space measured."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

from dflash_flow.app.exits import UserError
from dflash_flow.core.validate import Validated
from dflash_flow.util import config_hash, is_within, move_aside, nearest_existing, probe_write


def resume_config_hash(graph) -> str:
    """The hash of what must match to resume (``core.identity.result_settings``)."""
    from dflash_flow.core.identity import result_settings

    return config_hash(result_settings(graph))


def legacy_config_hash(graph) -> str:
    """The hash checkpoints written before they recorded their settings carry (the seed and every stage's
    spec as written, placement and capacity included): such a checkpoint resumes when it matches."""
    from dflash_flow.core.identity import legacy_stage_configs

    d = graph.to_dict()
    configs = legacy_stage_configs(graph)
    stages = [{**s, "config": configs[s["name"]]} if configs.get(s["name"]) else s for s in d.get("stages", [])]
    return config_hash({"seed": d.get("seed"), "stages": stages})


def build_resume_state(v: Validated, ckpt) -> dict[str, list[dict[str, Any]]]:
    """Per-stage resume states. Stages that plan data ahead of the trainer resume from the trainer's
    position (``resume_state_for``), not from how far they had run ahead when the checkpoint was taken."""
    from dflash_flow.app.checkpoint_format import InvalidCheckpoint
    from dflash_flow.core import Stage
    from dflash_flow.data.epoch import DataPosition

    if ckpt is None:
        return {}
    out: dict[str, list[dict[str, Any]]] = {}
    try:  # read once, every field checked; handed to the stages that plan ahead of the trainer
        position = DataPosition.from_dict(ckpt.data_position) if ckpt.data_position else None
    except ValueError as exc:
        raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json: {exc}") from None
    for spec in v.graph.stages:
        cls = v.classes[spec.name]
        try:
            state = cls.resume_state_for(position) if position is not None else None
        except (TypeError, ValueError, KeyError, IndexError, OverflowError) as exc:
            raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json: 'data_position' does not give "
                                    f"stage '{spec.name}' a state ({type(exc).__name__}: {exc})") from None
        if state is not None:
            out[spec.name] = [state] * spec.replicas
        elif spec.name in ckpt.stage_states:
            out[spec.name] = ckpt.stage_states[spec.name]
        elif ckpt.stage_states and cls.affects_result and cls.get_state is not Stage.get_state:
            # This stage keeps a state (the trainer's) and would start over while the data continues.
            raise InvalidCheckpoint(f"not a valid checkpoint: {ckpt.path}: state.json has no state for stage "
                                    f"'{spec.name}' ({spec.type})")
    return out


def prepare(v: Validated, dist_ctx, output_dir: Path, resume: str | None, extend: bool = False):
    """The prepare phase; raises UserError. Returns (the lock, None off rank 0; the checkpointer; the checkpoint)."""
    from dflash_flow.app.checkpoint import Checkpointer
    from dflash_flow.app.model_spec import checkpoint_bytes, data_fingerprint
    from dflash_flow.core.identity import moved_setting_keys, result_settings, run_length_keys

    graph, main = v.graph, dist_ctx is None or dist_ctx.is_main
    if dist_ctx is not None:
        _agree(v, dist_ctx)
    lock = None
    if main:
        prepare_output_dir(output_dir)
        lock = OutputLock.acquire(output_dir)  # under torchrun rank 0 holds it for the ranks of the job
    else:
        _make_output_dir(output_dir)
    try:
        ck = graph.sections["checkpoint"]
        # OUTPUT/checkpoints inside the output directory by default; a directory the user chose is its own root.
        ck_dir, ck_root = (Path(ck.dir).expanduser(),) * 2 if ck.dir else (output_dir / "checkpoints", output_dir)
        if main:
            _check_places(v, output_dir, ck, ck_dir)
        checkpointer = Checkpointer(
            ck_dir, keep_last=ck.keep_last, config_hash=resume_config_hash(graph), settings=result_settings(graph),
            legacy_hash=legacy_config_hash(graph), length_keys=run_length_keys(graph), extend=extend,
            moved=moved_setting_keys(graph), data_files=data_fingerprint(v) if main else {}, root=ck_root)
        ckpt = _checkpoint_to_resume(v, checkpointer, resume, extend, main)
        need_ckpt, need_export = checkpoint_bytes(v) if main else (0, 0)
        if need_ckpt:
            check_free_space(ck_dir, need_ckpt + (need_export if ck_root == output_dir else 0),
                             "one checkpoint and the export")
            if ck_root != output_dir:
                check_free_space(output_dir, need_export, "the exported drafter")
        if main and ckpt is None:  # a fresh run: an earlier run's summary and batch logs kept, not overwritten
            set_aside_earlier_run(output_dir)
        return lock, checkpointer, ckpt
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _agree(v: Validated, dist_ctx) -> None:
    """Every rank, before anything is written: one job, one config, one data set, one version."""
    from importlib.metadata import version

    from dflash_flow.app.distributed import disagreement
    from dflash_flow.app.model_spec import data_fingerprint
    from dflash_flow.core.identity import result_settings

    # The settings field by field (not their hash), so that a disagreement names the field: "seed".
    facts = {"config": result_settings(v.graph), "data_files": data_fingerprint(v), "version": version("dflash-flow")}
    problem = disagreement(dist_ctx.all_gather_object(facts))
    if problem:
        raise UserError(f"rank {dist_ctx.rank}: {problem}")


def _make_output_dir(output_dir: Path) -> None:
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output_dir {output_dir}: {exc.strerror or exc}") from None


def _check_places(v: Validated, output_dir: Path, ck, ck_dir: Path) -> None:
    """The tracking store, the stages' outputs and the checkpoint directory can be written (rank 0)."""
    from dflash_flow.observe.store import check_tracking_uri

    tracking = v.graph.sections["tracking"]
    if tracking.enabled:
        problem = check_tracking_uri(tracking.tracking_uri)
        if problem:
            raise UserError(f"tracking: {problem}")
    check_stage_outputs(v, output_dir)
    check_writable_dir(ck_dir, "checkpoint.dir" if ck.dir else "the checkpoint directory")
    links = escaping_links(ck_dir) if ck.dir and ck_dir.is_dir() else []
    if links:
        link, target = links[0]
        raise UserError(f"checkpoint.dir {ck_dir}: {link.relative_to(ck_dir)} is a symbolic link to {target}, "
                        "outside it; checkpoints are written and pruned only inside their directory")


def _checkpoint_to_resume(v: Validated, checkpointer, resume: str | None, extend: bool, main: bool):
    """The checkpoint ``resume`` names, verified; None for a fresh run (refused over another run's checkpoints)."""
    from dflash_flow.core.errors import CheckpointError

    if resume == "auto":  # torchrun --max-restarts: the first attempt starts fresh, a restart continues
        resume = "latest" if checkpointer.list() else None
    if extend and not resume:
        raise UserError("--extend lengthens a resumed run: pass it with --resume latest (or a checkpoint path)")
    if not resume:
        earlier = checkpointer.candidates() if main else []
        if earlier:  # a fresh run would mix its checkpoints with another run's
            raise UserError(
                f"{checkpointer.dir} holds the checkpoints of an earlier run (newest: {earlier[0].name}); pass "
                "--resume latest to continue it (with --extend to train it longer), or choose another output_dir "
                "(--set output_dir=...)")
        return None
    try:
        ckpt = checkpointer.load(resume)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    change = ckpt.data_change(checkpointer.data_files)
    if change:
        raise UserError(change)
    if extend:
        from dflash_flow.app.model_spec import extend_problem

        want = checkpointer.expected
        why = extend_problem(ckpt.settings, want.settings, want.length_keys, want.moved)
        if why:
            raise UserError(why)
    try:
        build_resume_state(v, ckpt)  # every stage's state can be derived from it (built again later)
    except CheckpointError as exc:
        raise UserError(str(exc)) from None
    ckpt.extend = extend
    if ckpt.run_uid:
        checkpointer.run_uid = ckpt.run_uid  # the resumed run prunes the checkpoints of its lineage
    return ckpt


_MAX_WALK = 20_000  # entries of the output directory looked at for symbolic links (a run makes a few dozen)


def escaping_links(root: Path) -> list[tuple[Path, str]]:
    """Symbolic links under ``root`` that lead out of it (link, where it leads), without following any."""
    out: list[tuple[Path, str]] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            seen += 1
            p = Path(dirpath) / name
            if p.is_symlink() and not is_within(p, root):
                out.append((p, os.path.realpath(p)))
        if seen >= _MAX_WALK:
            break
    return out


def prepare_output_dir(output_dir: Path) -> None:
    """Make the output directory and prove the run can write in it (raises ``UserError``): not a file, not
    read-only, no symbolic link inside that leads out of it (whatever the run writes or uploads stays in)."""
    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output_dir {output_dir} is an existing file, not a directory; choose another output_dir")
    _make_output_dir(output_dir)
    why = probe_write(output_dir)
    if why:
        raise UserError(f"output_dir {output_dir} is not writable: {why}")
    links = escaping_links(output_dir)
    if links:
        link, target = links[0]
        more = f" (and {len(links) - 1} more)" if len(links) > 1 else ""
        raise UserError(
            f"output_dir {output_dir}: {link.relative_to(output_dir)} is a symbolic link to {target}, outside "
            f"the output directory{more}; a run writes and uploads only inside its output_dir (remove the link "
            "or choose another output_dir)"
        )


def check_writable_dir(path: Path, what: str) -> None:
    """``path`` is a directory the run can write, or can be created (creating nothing): raises ``UserError``
    naming ``what`` (e.g. ``checkpoint.dir``) when it is a file or its nearest existing parent is read-only."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{what} {path} is an existing file, not a directory")
    base = nearest_existing(path)
    if not base.is_dir():
        raise UserError(f"cannot create {what} {path}: {base} is not a directory")
    why = probe_write(base)
    if why:
        raise UserError(f"{what} {path} is not writable: {why}" if base == path else
                        f"cannot create {what} {path}: {base} is not writable ({why})")


def check_output_file(path: Path, what: str, *, make_parents: bool = False) -> None:
    """``path`` can be written as a file, checked before any work (raises ``UserError`` naming ``what``, e.g.
    ``--out``): not a directory, its folder exists (or, with ``make_parents``, can be created) and is writable."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"{what} {path} is a directory; name a file (for example one inside it)")
    parent = path.parent
    if not make_parents and not parent.is_dir():
        raise UserError(f"{what} {path}: the directory {parent} does not exist (create it first)" if not parent.exists()
                        else f"{what} {path}: {parent} is not a directory")
    base = nearest_existing(parent)
    if not base.is_dir():
        raise UserError(f"{what} {path}: {base} is not a directory")
    why = probe_write(base)
    if why:
        raise UserError(f"{what} {path}: cannot write in {base} ({why})")


def check_stage_outputs(v: Validated, output_dir: Path) -> None:
    """Directories stages write into at the end (``Stage.output_dirs``: ``export_dir``) are neither files nor
    hold anything but an earlier export: found now, not after hours of training."""
    from dflash_flow.core.errors import CheckpointError
    from dflash_flow.model.export_contract import check_destination

    for name, conf in v.configs.items():
        for sub in conf.output_dirs():
            target = output_dir / sub
            if target.exists() and not target.is_dir():
                raise UserError(f"stage '{name}': export_dir {target} is an existing file, not a directory")
            try:
                check_destination(target)
            except CheckpointError as exc:
                raise UserError(f"stage '{name}': export_dir: {exc} (or set export_dir)") from None


def set_aside_earlier_run(output_dir: Path) -> list[tuple[Path, Path]]:
    """An earlier run's ``summary.json`` and batch logs moved aside (``NAME.old``, ...) for a fresh run, never
    overwritten, with a warning. Returns (file, where it went) pairs."""
    moved = []
    for pattern in ("summary.json", "batches.jsonl", "batches.rank*.jsonl"):
        for p in sorted(output_dir.glob(pattern)):
            if p.is_file() and not p.is_symlink():
                moved.append((p, move_aside(p)))
    if moved:
        logging.getLogger("dflash_flow").warning(
            "output_dir %s holds an earlier run's %s: moved aside to %s (this run writes its own; --resume "
            "continues a run instead)", output_dir, ", ".join(p.name for p, _ in moved),
            ", ".join(q.name for _, q in moved))
    return moved


class OutputLock:
    """An exclusive ``flock`` on ``OUTPUT/.dflash-flow.lock`` for as long as the run lives (the OS releases it
    however the process ends): a second run on the same output directory is refused, naming the first's pid."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, output_dir: Path) -> OutputLock:
        path = output_dir / ".dflash-flow.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise UserError(f"cannot create the run lock {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace")
            os.close(fd)
            try:
                info = json.loads(holder)
                who = f"pid {info['pid']} on {info.get('host', '?')}"
            except (ValueError, KeyError, TypeError):
                who = "another process"
            raise UserError(
                f"output_dir {output_dir} is in use by another run ({who}); wait for it to end or choose "
                "another output_dir"
            ) from None
        except OSError as exc:
            os.close(fd)
            raise UserError(f"cannot lock {path}: {exc.strerror or exc}") from None
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}).encode()
        with contextlib.suppress(OSError):  # the lock holds without its note
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
        return cls(fd, path)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def check_free_space(directory: Path, need: int, what: str) -> None:
    """Raise ``UserError`` when the filesystem of ``directory`` has less than ``need`` bytes free."""
    base = nearest_existing(directory)
    try:
        free = shutil.disk_usage(base).free
    except OSError:
        return
    if free < need:
        raise UserError(
            f"not enough free space in {directory} for {what}: about {_size(need)} needed, {_size(free)} free; "
            "free some space or choose another output_dir (or checkpoint.dir)"
        )


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"
