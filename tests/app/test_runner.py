"""The Python runner (``dflash_flow.app.run``): what ``dflash-flow run`` does, from a Graph or a file, with
overrides; a real MLflow store read back through ``MlflowClient``."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest

from dflash_flow.app import run
from dflash_flow.core import ConfigError, Graph, Pipeline, Stage, StageError, register_stage
from dflash_flow.stages.generic import Discard, Range

REPO = Path(__file__).resolve().parents[2]


def _graph(tmp_path: Path, **sections) -> Graph:
    g = Graph(name="runner", seed=3, output_dir=str(tmp_path / "out"), sections=sections)
    g.add("numbers", Range(count=30))
    g.add("sink", Discard(), inputs="numbers")
    return g


def test_run_a_graph_with_tracking_checkpoint_dir_and_summary(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    report = run(_graph(tmp_path, tracking={"tracking_uri": uri, "experiment": "runner", "system_metrics": False}))
    assert report.ok and report.status == "FINISHED" and report.exit_code == 0
    assert report.output_dir == tmp_path / "out" and (report.output_dir / "summary.json").is_file()
    run_info = MlflowClient(tracking_uri=uri).get_run(report.mlflow_run_id).info
    assert run_info.status == "FINISHED"


def test_run_a_file_with_overrides_and_a_plugin_stage(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sys.path.insert(0, str(REPO / "examples" / "custom_stage"))
    import my_stages  # noqa: F401 - registers Scale

    report = run(REPO / "examples" / "custom_stage" / "pipeline.yaml",
                 overrides=["stages.numbers.count=7", f"output_dir={tmp_path / 'custom'}"])
    assert report.ok and report.mlflow_run_id is None  # tracking: {enabled: false} in the file
    assert (tmp_path / "custom" / "summary.json").is_file()


def test_sections_given_as_plain_mappings_are_structured_and_checked(tmp_path):
    report = run(_graph(tmp_path, tracking={"enabled": False}, checkpoint={"keep_last": 2}))
    assert report.ok
    with pytest.raises(ConfigError, match=r"tracking\.enabled"):
        run(_graph(tmp_path, tracking={"enabled": "maybe"}))
    with pytest.raises(ConfigError, match="unknown section 'trackin'; did you mean 'tracking'"):
        run(_graph(tmp_path, trackin={"enabled": False}))


def test_invalid_pipelines_raise_before_anything_runs(tmp_path):
    g = _graph(tmp_path, tracking={"enabled": False})
    g.add("orphan", Discard(), inputs="nowhere")
    with pytest.raises(ConfigError, match="dangling input"):
        run(g)
    assert not (tmp_path / "out").exists()


@register_stage
@attrs.define(kw_only=True, eq=False)
class ReturnsBareItem(Stage):
    """Returns its output bare (a mistake the runtime names)."""

    def process(self, item):
        return item * 2


def test_a_bare_item_returned_by_process_gets_a_message_saying_so(tmp_path):
    g = Graph(name="bare", output_dir=str(tmp_path / "out"))
    g.add("numbers", Range(count=3))
    g.add("double", ReturnsBareItem(), inputs="numbers")
    g.add("sink", Discard(), inputs="double")
    with pytest.raises(StageError, match=r"returned a bare int; return its outputs in a list or tuple"):
        Pipeline(g, check_devices=False).run()
