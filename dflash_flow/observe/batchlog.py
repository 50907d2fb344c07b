"""The trained-batch log (DrafterStep's ``record_batches``): one JSON line per batch trained (epoch, index,
sample ids), flushed per line, inside the run's output directory and never through a symbolic link."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from dflash_flow.util import refuse_outside


class BatchLog:
    """``OUTPUT/batches.jsonl`` (``batches.rank<r>.jsonl`` under torchrun). ``append``: a resumed run
    continues the file (its lines after the checkpoint are trained again, so appear twice); a fresh run
    starts a new one, whatever an earlier run left."""

    def __init__(self, root: Path, *, rank: int, world_size: int, append: bool) -> None:
        self.path = root / ("batches.jsonl" if world_size == 1 else f"batches.rank{rank}.jsonl")
        refuse_outside(self.path.parent, root)
        flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_APPEND if append else os.O_TRUNC)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise PermissionError(errno.EACCES, "refusing to follow a symbolic link in output_dir",
                                      str(self.path)) from None
            raise
        self._file: Any = os.fdopen(fd, "a" if append else "w")

    def write(self, meta: Any) -> None:
        """One trained batch (``items.BatchMeta``); a failed write names the file (a full disk's does not)."""
        try:
            self._file.write(json.dumps({"epoch": meta.epoch, "index": meta.index,
                                         "sample_ids": list(meta.sample_ids)}) + "\n")
            self._file.flush()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
