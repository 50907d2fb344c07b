"""Register the user stage, then load the YAML that names it and run it through the normal runner."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import my_stages  # noqa: E402,F401 - registers `Scale`

import dflash_flow.app  # noqa: E402,F401 - registers the `tracking:` section
from dflash_flow.core import Pipeline, load_graph  # noqa: E402

if __name__ == "__main__":
    graph = load_graph(Path(__file__).parent / "pipeline.yaml")
    result = Pipeline(graph).run()
    print("sink consumed", result.states["sink"][0]["count"], "items")
