"""What the profile, e2e, fanout, torchdata and scale benchmarks share: the machine description, writing
a result file, the embedded pipeline shortened, and pipelines of sleep stages with known costs; and, for
the step benchmarks' ``--baseline``, the package at a git revision beside this tree's (``load_package``)."""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"
DFLASH_YAML = ROOT / "pipelines" / "dflash.yaml"  # the embedded default: a DFlash 2 drafter
DFLASH1_YAML = ROOT / "pipelines" / "dflash1.yaml"  # its DFlash recipe: what the peer comparisons train
# Pipelines create their output directory; keep it out of the working tree.
SCRATCH = Path(tempfile.gettempdir()) / "dflash-flow-bench"

from dflash_flow.core import Source  # noqa: E402 - after the path setup above


@attrs.define(kw_only=True, eq=False)
class ItemsSource(Source):
    """A source stage emitting the Python objects handed over as ``items`` (a benchmark's prepared work,
    not a YAML field); subclasses set ``output_type`` and register themselves."""

    items: list = attrs.field(factory=list, metadata={"config": False})

    @classmethod
    def config_fields(cls):
        return []

    def produce(self):
        yield from self.items


def load_package(rev: str, into: Path, name: str = "dflash_flow_before") -> str:
    """The ``dflash_flow`` package as of git revision ``rev`` (all of it), importable as ``name`` beside this
    tree's; unpacked into ``into`` once (a second call, e.g. from a measuring subprocess, reuses it)."""
    if not (into / name).is_dir():
        tar = subprocess.run(["git", "archive", rev, "dflash_flow"], cwd=ROOT, check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
            archive.extractall(into, filter="data")
        (into / "dflash_flow").rename(into / name)
        for path in (into / name).rglob("*.py"):
            path.write_text(path.read_text().replace("dflash_flow", name))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return name


def machine() -> dict[str, Any]:
    import torch

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg_at_start": [round(x, 2) for x in load] if load else None,
    }


def write_result(out: Path, data: dict[str, Any]) -> dict[str, Any]:
    out.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=1, default=str)
    out.write_text(text + "\n")
    print(text)
    return data


def embedded_overrides(output_dir: Path, *extra: str) -> list[str]:
    """The embedded default shortened for a benchmark: no tracking, no progress line, its own output."""
    return [
        f"output_dir={output_dir}",
        "tracking.enabled=false",
        "stages.monitor.progress=false",
        "checkpoint.every_steps=0",
        "checkpoint.at_epoch_end=false",
        *extra,
    ]


def embedded_validated(output_dir: Path, *extra: str, pipeline: Path = DFLASH_YAML):
    import dflash_flow.app  # noqa: F401 - registers the application sections
    from dflash_flow.core import load_graph, validated

    return validated(load_graph(pipeline, embedded_overrides(output_dir, *extra)))


def hash_graph(out: Path, a_replicas: int, cores: int, unit_mb: int):
    """``src`` -> ``a`` (``cores * unit_mb`` MB hashed an item, ``a_replicas`` replicas) -> ``b`` (``unit_mb``)
    -> ``sink``: GIL-free CPU work (hashlib lets go of the GIL on large buffers, as a kernel does), for the
    contention model's checks (tests/app/test_contention.py, profile_bench's ``contention`` row)."""
    import hashlib

    import attrs

    from dflash_flow.core import Graph, RuntimeOptions, Stage, cfg, registry
    from dflash_flow.stages.generic import Discard, Range

    if "BenchHash" not in registry.available():

        @registry.register_stage("BenchHash")
        @attrs.define(kw_only=True, eq=False)
        class BenchHash(Stage):
            mb: int = cfg(1, ge=0)

            def setup(self, ctx) -> None:
                self._buf = bytes(1 << 20)

            def process(self, item):
                for _ in range(self.mb):
                    hashlib.sha256(self._buf).digest()
                return (item,)

    cls = registry.resolve("BenchHash")
    g = Graph(name="hash", seed=0, output_dir=str(out / f"out{a_replicas}"), runtime=RuntimeOptions(capacity=8))
    g.add("src", Range(count=1_000_000))
    g.add("a", cls(mb=cores * unit_mb), inputs="src", replicas=a_replicas)
    g.add("b", cls(mb=unit_mb), inputs="a")
    g.add("sink", Discard(), inputs="b")
    return g


def sleep_graph(mix: dict[str, int], costs: dict[str, float], *, name: str = "sleep", count: int = 100_000,
                output_dir: Path | None = None, capacity: int = 8, jitter: float = 0.0, seed: int = 0):
    """``src`` (Range) -> ``a`` -> ``b`` (Delay) -> ``sink`` (Discard): a pipeline whose per-item costs are
    ``costs`` seconds of GIL-free sleep and whose replica counts are ``mix``; ``jitter``: each ``a`` and
    ``b`` item's sleep is uniform in cost * (1 +- jitter), drawn from ``seed``."""
    from dflash_flow.core import Graph, RuntimeOptions
    from dflash_flow.stages.generic import Delay, Discard, Range

    g = Graph(name=name, seed=seed, output_dir=str(output_dir or SCRATCH / name), runtime=RuntimeOptions(capacity=capacity))
    g.add("src", Range(count=count, service_s=costs["src"]), replicas=mix.get("src", 1))
    g.add("a", Delay(service_s=costs["a"], jitter_s=costs["a"] * jitter), inputs="src", replicas=mix.get("a", 1))
    g.add("b", Delay(service_s=costs["b"], jitter_s=costs["b"] * jitter), inputs="a", replicas=mix.get("b", 1))
    g.add("sink", Discard(), inputs="b")
    return g
