"""Build and run a pipeline in Python: the same Graph object a YAML file loads into.

    python examples/compose.py            # runs a small generic pipeline and prints its stage loads
    python examples/compose.py --yaml     # prints the equivalent YAML instead
"""

from __future__ import annotations

import sys

from dflash_flow.core import Graph, Pipeline, load_graph_text
from dflash_flow.stages.generic import Delay, Discard, Range


def build() -> Graph:
    g = Graph(name="compose-example", seed=7, output_dir="runs/compose-example")
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
    assert load_graph_text(g.to_yaml()) == g  # YAML round trip gives an equal graph
    result = Pipeline(g).run()
    for name, stage in result.snapshot.stages.items():
        f = stage.fractions()
        print(f"{name:8s} busy {f['busy']:.0%}  waiting for input {f['blocked_in']:.0%}  blocked on output {f['blocked_out']:.0%}")


if __name__ == "__main__":
    main()
