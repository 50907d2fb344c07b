"""Stage metrics are typed fields (issue 35.5): a stage declares its metrics as a class of
``core.metrics.stage_metric`` fields and ``ctx.metrics.declare(ThatClass)``; no stage module names a metric by
string (``ctx.metrics.counter("tokens", ...)``), and every metrics class a stage declares lists (name, kind,
unit) without a replica (``core.metrics.declared_metrics``) and is a registered stage's ``stage_metrics``, which
``dflash-flow stages NAME`` lists. Parsed with ``ast``; the rule tests itself on a bad module first."""

from __future__ import annotations

import ast
from pathlib import Path

import attrs

from dflash_flow.core.metrics import declared_metrics

STAGES = Path(__file__).resolve().parents[2] / "dflash_flow" / "stages"
BY_STRING = {"counter", "gauge", "summary", "labeled"}


def problems(source: str, where: str) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in BY_STRING
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append(f"{where}:{node.lineno}: metric {node.args[0].value!r} declared by string "
                       f"(.{node.func.attr}(...)): make it a stage_metric field and declare the class")
    return out


def test_the_rule_finds_a_metric_declared_by_string():
    bad = "def setup(self, ctx):\n    m = ctx.metrics\n    self._n = m.counter('rows', 'rows', 'Rows')\n"
    assert problems(bad, "bad.py") == ["bad.py:3: metric 'rows' declared by string (.counter(...)): make it a "
                                       "stage_metric field and declare the class"]
    assert problems("self._m = ctx.metrics.declare(RowMetrics)\n", "good.py") == []


def test_no_stage_declares_a_metric_by_string():
    found = [p for path in sorted(STAGES.glob("*.py")) for p in problems(path.read_text(), path.name)]
    assert found == [], "\n".join(found)


def test_every_stage_metrics_class_lists_its_metrics():
    import importlib

    classes = []
    for path in sorted(STAGES.glob("*.py")):
        module = importlib.import_module(f"dflash_flow.stages.{path.stem}")
        classes += [c for name, c in vars(module).items()
                    if name.endswith("Metrics") and attrs.has(c) and c.__module__ == module.__name__]
    assert len(classes) >= 8  # Bucketer, Padder, Interleaver, sources, TargetForward (2), DrafterStep, Monitor, Discard
    for cls in classes:
        listed = declared_metrics(cls)
        assert listed and len({name for name, *_ in listed}) == len(listed), cls.__name__
    # each is a registered stage's (its ``stage_metrics``), so ``dflash-flow stages NAME`` lists what it declares
    from dflash_flow.core import registry

    owned = {c for name in registry.available() for c in registry.resolve(name).stage_metrics}
    assert [c.__name__ for c in classes if c not in owned] == []


def test_the_stages_command_lists_a_stage_metrics():
    from dflash_flow.core.graph import describe_stage

    text = describe_stage("DrafterStep")
    assert "metrics (in MLflow: stage/<stage>/metric/<name>" in text
    assert "  - loss: gauge, nats  Last step's loss" in text and "  - step_s: summary, s  " in text
    assert "bad_records: labeled, records" in describe_stage("ChatSource")


def test_the_data_report_reads_the_sources_own_bad_records_metric():
    from dflash_flow.observe.sample import BAD_RECORDS_METRIC
    from dflash_flow.stages.sources import SourceMetrics

    assert BAD_RECORDS_METRIC in {name for name, *_ in declared_metrics(SourceMetrics)}
