"""The data-parallel tests run real torchrun jobs (gloo, CPU); helpers come from tests/reliability."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for p in (HERE, HERE.parent / "reliability"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))
