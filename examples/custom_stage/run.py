"""Register the user stage, then run the YAML that names it through the full runner (what `dflash-flow run`
does: output directory, summary, tracking as the file says)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import my_stages  # noqa: E402,F401 - registers `Scale`

from dflash_flow.app import run  # noqa: E402

if __name__ == "__main__":
    report = run(Path(__file__).parent / "pipeline.yaml")
    stages = json.loads((report.output_dir / "summary.json").read_text())["stages"]
    print(report.status, "- sink consumed", stages["sink"]["items_in"], "items")
    sys.exit(report.exit_code)
