"""The run summary's evaluation rows (issue 40.24): each figure once (``tau`` is ``tau_h64``: not shown twice;
``tau`` at every horizon is in the acceptance table), counts as integers (``1,010``, not ``1,010.00``)."""

from __future__ import annotations

from dflash_flow.items import EvalReport
from dflash_flow.observe.console import cell
from dflash_flow.observe.record import RunRecord
from dflash_flow.observe.report import summary_table
from dflash_flow.observe.sample import EvalPoint


def _record() -> RunRecord:
    r = RunRecord(total_steps=10)
    trained = EvalReport("trained", metrics={"tau": 4.5, "speedup_forwards": 4.25, "tokens_generated": 1010.0},
                         by_horizon={64: {"tau": 4.5, "speedup_forwards": 4.25, "tokens_generated": 1010.0},
                                     448: {"tau": 5.5, "speedup_forwards": 5.0, "tokens_generated": 12120.0}},
                         temperature=0.0, lossless=True, num_prompts=16)
    r.add_eval(EvalPoint(10, (trained,)))
    return r


def test_each_evaluation_figure_once_and_counts_as_integers():
    text = summary_table(_record(), width=140)
    rows = [ln.split() for ln in text.splitlines() if ln.split()[:1] == ["trained"]]
    evaluation = [row for row in rows if len(row) == 3]  # trained, metric, value
    names = [row[1] for row in evaluation]
    assert len(names) == len(set(names)), names
    assert "tau_h64" not in names and "speedup_forwards_h64" not in names and "tokens_generated_h64" not in names
    assert "tau" not in names and "tau_h448" not in names  # the acceptance table has them
    assert ["trained", "tokens_generated", "1,010"] in evaluation
    assert ["trained", "tokens_generated_h448", "12,120"] in evaluation
    assert ["trained", "speedup_forwards_h448", "5"] in evaluation
    acceptance = [row for row in rows if len(row) == 4]
    assert acceptance == [["trained", "4.5", "4.5", "5.5"]]


def test_cell_prints_whole_floats_as_counts():
    assert [cell(1010.0), cell(12120.0), cell(3_000_000.0), cell(0.0), cell(2.5), cell(1234.5)] == [
        "1,010", "12,120", "3,000,000", "0", "2.5", "1,234.50"]
