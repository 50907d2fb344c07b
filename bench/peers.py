"""What the peer comparisons need, fetched or installed, never silently missing.

* SpecForge 0.2.0: its wheel, pinned by hash in ``requirements/bench.txt``, is downloaded with
  ``pip download --require-hashes`` into ``<cache>/wheels`` (``<cache>``: ``$DFLASH_FLOW_CACHE`` or
  ``~/.cache/dflash-flow``), checked against the pin, and unpacked into ``<cache>/specforge-0.2.0``
  (``$DFLASH_SPECFORGE_DIR`` names another unpacked copy). It is never installed (it pins torch 2.11).
* torchdata: the package's ``torchdata`` extra (its pin is read from ``pyproject.toml``), installed with pip
  into this interpreter when it is missing.

Each ``ensure_*`` returns what it made ready or raises :class:`Missing` with the one command that would
make it ready (no network, a changed index, a hash mismatch).

    python bench/peers.py          # fetch / install both, print where they are
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "requirements" / "bench.txt"
SPECFORGE_VERSION = "0.2.0"
MARKER = Path("specforge") / "algorithms" / "common" / "dflash_family_model.py"


class Missing(RuntimeError):
    """A peer is not available; the message ends with the one command that would fix it."""


def _cache() -> Path:
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from dflash_flow.util import cache_root

    return cache_root()


def specforge_pin() -> tuple[str, str]:
    """``(requirement, sha256)`` of the SpecForge line in requirements/bench.txt."""
    for line in REQUIREMENTS.read_text().splitlines():
        m = re.match(r"\s*(specforge==\S+)\s+--hash=sha256:([0-9a-f]{64})", line)
        if m:
            return m.group(1), m.group(2)
    raise Missing(f"{REQUIREMENTS}: no 'specforge==... --hash=sha256:...' line")


def specforge_dir(path: str | os.PathLike | None = None) -> Path:
    """Where the unpacked wheel is (or will be): ``path``, ``$DFLASH_SPECFORGE_DIR``, or the cache."""
    if path:
        return Path(path).expanduser()
    env = os.environ.get("DFLASH_SPECFORGE_DIR")
    return Path(env).expanduser() if env else _cache() / f"specforge-{SPECFORGE_VERSION}"


def download_command(wheels: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", str(REQUIREMENTS),
            "-d", str(wheels)]


def ensure_specforge(path: str | os.PathLike | None = None) -> Path:
    """The unpacked SpecForge wheel, downloaded (hash-checked) and unpacked first when it is not there."""
    root = specforge_dir(path)
    if (root / MARKER).is_file():
        return root
    if path or os.environ.get("DFLASH_SPECFORGE_DIR"):
        raise Missing(f"no unpacked SpecForge wheel at {root}; drop DFLASH_SPECFORGE_DIR / --specforge and the "
                      f"benchmark fetches it into {_cache() / f'specforge-{SPECFORGE_VERSION}'}")
    from dflash_flow.util import sha256_file

    requirement, digest = specforge_pin()
    wheels = _cache() / "wheels"
    wheel = wheels / f"specforge-{SPECFORGE_VERSION}-py3-none-any.whl"
    cmd = download_command(wheels)
    if not wheel.is_file():
        wheels.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not wheel.is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise Missing(f"could not download {requirement} ({' / '.join(tail)}); run: {shlex.join(cmd)}")
    if sha256_file(wheel) != digest:
        raise Missing(f"{wheel} does not match the sha256 pinned in {REQUIREMENTS}; delete it and run: "
                      f"{shlex.join(cmd)}")
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".specforge-") as tmp:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(tmp)
        if not (Path(tmp) / MARKER).is_file():
            raise Missing(f"{wheel} holds no {MARKER}")
        if not root.exists():  # another process may have unpacked it meanwhile
            os.replace(tmp, root)
    if not (root / MARKER).is_file():
        raise Missing(f"{root} exists but holds no {MARKER}: delete it and rerun")
    return root


def torchdata_requirement() -> str:
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = extras["torchdata"]
    return req


def install_command() -> list[str]:
    return [sys.executable, "-m", "pip", "install", "-q", torchdata_requirement()]


def ensure_torchdata() -> str:
    """torchdata's version, installed (the ``torchdata`` extra's pin) first when it is missing."""
    if importlib.util.find_spec("torchdata") is None:
        cmd = install_command()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        importlib.invalidate_caches()
        if proc.returncode != 0 or importlib.util.find_spec("torchdata") is None:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-2:]
            raise Missing(f"could not install {torchdata_requirement()} ({' / '.join(tail)}); run: {shlex.join(cmd)}")
    from importlib.metadata import version

    return version("torchdata")


def main() -> int:
    try:
        print(f"specforge: {ensure_specforge()}")
        print(f"torchdata: {ensure_torchdata()}")
    except Missing as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
