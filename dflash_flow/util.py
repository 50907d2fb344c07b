"""Small helpers every layer may use. Imports nothing from the package (bottom of the layer table)."""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

CACHE_ENV = "DFLASH_FLOW_CACHE"


def cache_root() -> Path:
    """Where built artefacts are cached across runs (tokenized files, the embedded target and dataset):
    ``$DFLASH_FLOW_CACHE``, else ``~/.cache/dflash-flow``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dflash-flow").expanduser()


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's content (hashlib reads it in chunks)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def is_within(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """Whether ``path``, with every symbolic link followed, lies inside ``root`` (also resolved): what a run
    writes or uploads must stay in its output directory even when a link inside it points elsewhere."""
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to a temporary file beside ``path``, fsync it and rename it into place: a crash
    leaves the old file or the new one, never half of one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))
