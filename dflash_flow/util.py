"""Small helpers every layer may use. Imports nothing from the package (bottom of the layer table)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

CACHE_ENV = "DFLASH_FLOW_CACHE"


def cache_root() -> Path:
    """Where built artefacts are cached across runs: ``$DFLASH_FLOW_CACHE``, else ``~/.cache/dflash-flow``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-flow").expanduser()


def cache_dir_problem(setting: str | None, path: str | os.PathLike | None) -> str | None:
    """What is wrong with a cache directory (``path``: the ``setting`` resolved), in one line that says what to do;
    None: nothing. Wrong: it, or its nearest existing parent, is a file or a symbolic link that leads nowhere."""
    why = None
    for p in (Path(path).expanduser(), *Path(path).expanduser().parents) if path is not None else ():
        if p.is_symlink() and not p.exists():
            why = f"{p} is a symbolic link to {os.readlink(p)}, which does not exist"
            break
        if p.exists():
            why = None if p.is_dir() else f"{p} is not a directory (a file is there)"
            break
    if why is None:
        return None
    origin = f" (cache_dir 'auto' lies under ${CACHE_ENV}={os.environ[CACHE_ENV]})" \
        if setting == "auto" and os.environ.get(CACHE_ENV) else ""
    return (f"cache_dir {path}: {why}{origin}; point cache_dir (or ${CACHE_ENV}) at a directory, or set it to null "
            "to keep the tokens in memory")


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content (hashlib reads it in chunks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def blake2b_file(path: str | os.PathLike) -> str:
    """Hex 20-byte blake2b of a file's content: the data cache's and the feature store's file digest."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=20)).hexdigest()


def is_within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether ``path``, with every symbolic link followed, lies inside ``root`` (also resolved)."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def refuse_outside(path: str | os.PathLike, root: str | os.PathLike) -> None:
    """What the run writes stays inside its output directory, even past a symbolic link made mid-run."""
    import errno

    if not is_within(path, root):
        raise PermissionError(errno.EACCES, f"refusing to write outside output_dir {root} (a symbolic link leads to "
                              f"{os.path.realpath(path)})", str(path))


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int = 0o644, durable: bool = True) -> Iterator[Path]:
    """The one atomic write: yields a new temporary file beside ``path`` (O_EXCL) for the block to fill, then
    fsyncs it (unless ``durable=False``) and renames it onto ``path`` (removed on an error): a crash leaves the old
    file or the new one, and a link at ``path`` is replaced, never written through."""
    path = Path(path)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        os.fchmod(fd, mode)
        os.close(fd)
        yield tmp
        # Again: a writer may have replaced the file (safetensors writes a new one and renames it over).
        os.chmod(tmp, mode)
        if durable:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o644, durable: bool = True) -> Path:
    with atomic_path(path, mode=mode, durable=durable) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int = 0o644, durable: bool = True) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"), mode=mode, durable=durable)


def move_aside(path: str | os.PathLike) -> Path:
    """Rename ``path`` to the first free ``NAME.old``, ``NAME.old.2``, ... beside it and return where it went."""
    path = Path(path)
    n = 1
    while True:
        dest = path.with_name(f"{path.name}.old" + (f".{n}" if n > 1 else ""))
        if not (dest.exists() or dest.is_symlink()):
            os.rename(path, dest)
            return dest
        n += 1


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename inside ``path`` durable (where the platform allows opening a directory)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest parent that exists (where a directory to be made would be made)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def probe_write(directory: str | os.PathLike) -> str | None:
    """None when a file can be made in ``directory``, else why (unlike ``os.access``: right for root)."""
    try:
        fd, name = tempfile.mkstemp(prefix=".dflash-probe-", dir=directory)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def local_dirs(*fields: tuple[str, Any]) -> list[tuple[str, str, str]]:
    """``(field, path, "dir")`` for the values naming a local directory, not a preset or a hub id."""
    return [(field, value, "dir") for field, value in fields if isinstance(value, str) and value
            and (value.startswith(("/", ".", "~")) or Path(value).expanduser().exists())]


def config_hash(obj: Any, *, compact: bool = True) -> str:
    """A stable short hash of plain data: sha256 of its sorted-key JSON, 16 hex characters. ``compact=False``:
    JSON's default separators, as the keys of the shipped embedded target and dataset were made."""
    separators = (",", ":") if compact else None
    blob = json.dumps(obj, sort_keys=True, default=str, separators=separators)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
