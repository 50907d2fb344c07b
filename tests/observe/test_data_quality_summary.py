"""Bad records reach the end-of-run summary: a real source reads a file with unusable lines and
over-long samples; the printed summary and summary.json say how many, why, and what to do."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_flow.core import Graph, Pipeline
from dflash_flow.observe.report import summary_table, write_run_report
from dflash_flow.services import RunServices
from dflash_flow.stages.monitor import Monitor
from dflash_flow.stages.sources import TokenizedSource


def _file(tmp_path: Path) -> Path:
    rows = [json.dumps({"input_ids": list(range(1, 9)), "loss_mask": [0, 0] + [1] * 6}) for _ in range(20)]
    rows += [json.dumps({"input_ids": list(range(1, 60)), "loss_mask": [1] * 59})] * 3  # over max_length
    rows += ["{broken", json.dumps({"turns": []}), "[1, 2]"]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def test_bad_records_and_dropped_samples_are_in_the_summary(tmp_path: Path) -> None:
    g = Graph(name="quality", output_dir=str(tmp_path / "out"))
    g.add("src", TokenizedSource(paths=[str(_file(tmp_path))], cache_dir=None, vocab_size=100, max_length=32,
                                 overflow="drop"))
    g.add("monitor", Monitor(interval_s=0.2, progress=False), inputs="src")
    services = RunServices()
    Pipeline(g, services=services, check_devices=False).run()
    record = services.record

    table = " ".join(summary_table(record, width=200).split())
    assert "data: records not trained as read (see the log for file:line)" in table
    assert "src 1 unusable, skipped: invalid_json" in table
    assert "src 1 unusable, skipped: not_object" in table
    assert "src 3 dropped (over max_length)" in table

    summary = json.loads(write_run_report(record, output_dir=tmp_path / "out", plots=False).summary.read_text())
    rows = {(r["stage"], r["what"]): r["records"] for r in summary["data_quality"]}
    assert rows[("src", "unusable, skipped: invalid_json")] == 1 and rows[("src", "dropped (over max_length)")] == 3
    assert rows[("src", "unusable, skipped: missing_field")] == 1  # the 'turns' record
    assert sum(rows.values()) == 6


def test_a_clean_file_has_no_data_section(tmp_path: Path) -> None:
    path = tmp_path / "clean.jsonl"
    path.write_text("".join(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}) + "\n" for _ in range(5)))
    g = Graph(name="clean", output_dir=str(tmp_path / "out"))
    g.add("src", TokenizedSource(paths=[str(path)], cache_dir=None, vocab_size=100))
    g.add("monitor", Monitor(interval_s=0.2, progress=False), inputs="src")
    services = RunServices()
    Pipeline(g, services=services, check_devices=False).run()
    assert "data:" not in summary_table(services.record) and services.record.summary()["data_quality"] == []
