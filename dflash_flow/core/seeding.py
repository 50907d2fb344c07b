"""Every random choice derives from (run seed, epoch, rank, stage name, salt)."""

from __future__ import annotations

import hashlib


def derive_seed(run_seed: int, epoch: int = 0, rank: int = 0, stage: str = "", *salt: object) -> int:
    """A 63-bit seed that is stable across processes, Python versions and platforms.

    Hashing (instead of ``hash()`` or arithmetic mixing) keeps seeds independent between stages and
    immune to PYTHONHASHSEED.
    """
    text = "|".join(str(x) for x in (run_seed, epoch, rank, stage, *salt))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
