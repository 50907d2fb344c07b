"""The environment of a run, checked in the main thread before any stage thread or MLflow run exists: the
output directory (writable, not a file, no link out of it, locked against a second run, an earlier run's
files moved aside), the files and directories stages and commands will write, and the free space."""

from __future__ import annotations

from pathlib import Path

from dflash_flow.core.validate import Validated
from dflash_flow.util import nearest_existing, probe_write

__all__ = ["EARLIER_RUN_FILES", "OutputLock", "check_free_space", "check_output_file", "check_stage_outputs",
           "check_writable_dir", "escaping_links", "prepare_output_dir", "set_aside_earlier_run"]

_LOCK_NAME = ".dflash-flow.lock"
_MAX_WALK = 20_000  # entries of the output directory looked at for symbolic links (a run makes a few dozen)


def escaping_links(root: Path, limit: int = _MAX_WALK) -> list[tuple[Path, str]]:
    """Symbolic links under ``root`` that lead out of it (link, where it leads), without following any."""
    import os

    from dflash_flow.util import is_within

    out: list[tuple[Path, str]] = []
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            seen += 1
            p = Path(dirpath) / name
            if p.is_symlink() and not is_within(p, root):
                out.append((p, os.path.realpath(p)))
        if seen >= limit:
            break
    return out


def prepare_output_dir(output_dir: Path) -> None:
    """Make the output directory and prove the run can write in it (raises ``UserError``): not a file, not
    read-only, no symbolic link inside that leads out of it (whatever the run writes or uploads stays in)."""
    from dflash_flow.app.exits import UserError

    if output_dir.exists() and not output_dir.is_dir():
        raise UserError(f"output_dir {output_dir} is an existing file, not a directory; choose another output_dir")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output_dir {output_dir}: {exc.strerror or exc}") from None
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
    from dflash_flow.app.exits import UserError

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
    from dflash_flow.app.exits import UserError

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
    """Directories stages write into at the end of the run (``Stage.output_dirs``, e.g. DrafterStep's
    ``export_dir``) must not be files, nor directories holding anything but an earlier export (which the
    export would refuse): found now, not after hours of training."""
    from dflash_flow.app.exits import UserError
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


#: What a run writes at the top of its output directory that a later fresh run there would overwrite.
EARLIER_RUN_FILES = ("summary.json", "batches.jsonl", "batches.rank*.jsonl")


def set_aside_earlier_run(output_dir: Path) -> list[tuple[Path, Path]]:
    """A fresh run into an output directory an earlier run wrote (without checkpoints: with them it is
    refused): that run's ``summary.json`` and batch logs are moved aside (``NAME.old``, ``NAME.old.2``, ...),
    never overwritten, and the console says so. Returns (file, where it went) pairs."""
    import logging

    from dflash_flow.util import move_aside

    moved = []
    for pattern in EARLIER_RUN_FILES:
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
    """An exclusive ``flock`` on ``OUTPUT/.dflash-flow.lock`` for as long as the run lives: a second run on
    the same output directory is refused, naming the first one's pid. The OS releases it when the process
    ends, however it ends."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd: int | None = fd
        self.path = path

    @classmethod
    def acquire(cls, output_dir: Path) -> OutputLock:
        import fcntl
        import json
        import os
        import socket
        import time

        from dflash_flow.app.exits import UserError

        path = output_dir / _LOCK_NAME
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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, record + b"\n", 0)
        except OSError:
            pass  # the lock holds without its note
        return cls(fd, path)

    def release(self) -> None:
        import os

        if self.fd is not None:
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = None


def check_free_space(directory: Path, need: int, what: str) -> None:
    """Raise ``UserError`` when the filesystem of ``directory`` (or its nearest existing parent) has less
    than ``need`` bytes free."""
    import shutil

    from dflash_flow.app.exits import UserError

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
