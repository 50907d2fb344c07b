"""Build a pipeline in Python -- the same Graph object a YAML file loads into -- and run it.

    python examples/compose.py            # runs it as `dflash-flow run` would (MLflow, summary), prints stage loads
    python examples/compose.py --bare     # the bare runtime only: threads and channels, no tracking
    python examples/compose.py --yaml     # prints the equivalent YAML instead
"""

from __future__ import annotations

import json
import sys

from dflash_flow.app import run
from dflash_flow.core import Graph, Pipeline
from dflash_flow.stages.generic import Delay, Discard, Range


def build() -> Graph:
    # Sections as in YAML (tracking on logs to ./mlflow.db, like `dflash-flow run`; off here to stay quick).
    g = Graph(name="compose-example", seed=7, output_dir="runs/compose-example", sections={"tracking": {"enabled": False}})
    g.add("numbers", Range(count=200, service_s=0.001))
    # Three replicas of a slow stage, fed by the shared round-robin.
    g.add("work", Delay(service_s=0.004), inputs="numbers", replicas=3, capacity=4)
    g.add("sink", Discard(), inputs="work")
    return g


def main() -> None:
    g = build()
    if "--yaml" in sys.argv:
        print(g.to_yaml(), end="")
        return
    if "--bare" in sys.argv:
        result = Pipeline(g).run()
        loads = {name: stage.fractions() for name, stage in result.snapshot.stages.items()}
    else:
        report = run(g, overrides=["stages.numbers.count=100"])  # --set-style overrides work on a Graph too
        print(f"{report.status} (exit {report.exit_code}); summary in {report.output_dir / 'summary.json'}")
        loads = json.loads((report.output_dir / "summary.json").read_text())["stages"]
    for name, f in loads.items():
        print(f"{name:8s} busy {f['busy']:.0%}  waiting for input {f['blocked_in']:.0%}  blocked on output {f['blocked_out']:.0%}")


if __name__ == "__main__":
    main()
