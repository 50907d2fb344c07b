"""``--resume latest --extend`` to the same or a shorter length (issue 40.15): "nothing to extend", refused
before anything runs, the run's summary kept (it was a silent no-op that wrote over the real summary)."""

from __future__ import annotations

from pathlib import Path

import pytest
from reltools import read_lines, train_pipeline, write_tokenized, write_yaml

from dflash_flow.app import run
from dflash_flow.app.model_spec import extend_problem

pytestmark = pytest.mark.timeout(300)

KEYS = {"stages.bucketer.epochs", "stages.interleaver.max_batches"}


def test_extend_problem_names_what_did_not_grow():
    old = {"stages.bucketer.epochs": 2, "stages.interleaver.max_batches": None, "seed": 1}
    assert extend_problem(old, {**old, "stages.bucketer.epochs": 3}, KEYS) is None
    same = extend_problem(old, old, KEYS)
    assert same.startswith("nothing to extend: the run length is the same (epochs 2, max_batches unlimited)")
    fewer = extend_problem(old, {**old, "stages.bucketer.epochs": 1}, KEYS)
    assert "shorter (stages.bucketer.epochs: 2 in the checkpoint, 1 now)" in fewer
    budget = {**old, "stages.interleaver.max_batches": 5}
    assert "shorter" in extend_problem(budget, {**budget, "stages.interleaver.max_batches": 4}, KEYS)
    assert extend_problem(budget, {**budget, "stages.interleaver.max_batches": None}, KEYS) is None  # no budget: longer
    assert extend_problem(None, old, KEYS) is None  # an old checkpoint: cannot be told


def _pipeline(tmp_path: Path, max_batches: int) -> Path:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_tokenized(data, 32, seed=3)
    doc = train_pipeline(tmp_path, data=data, output_dir=tmp_path / "out", tracking=False, epochs=1)
    next(s for s in doc["stages"] if s["name"] == "interleaver")["config"] = {"max_batches": max_batches}
    return write_yaml(tmp_path / f"b{max_batches}.yaml", doc)


@pytest.mark.slow
def test_extend_to_the_same_or_fewer_batches_is_refused_and_the_summary_kept(tmp_path):
    out = tmp_path / "out"
    assert run(_pipeline(tmp_path, 3)).ok
    summary = (out / "summary.json").read_bytes()
    batches = read_lines(out / "batches.jsonl")
    for budget, says in ((3, "the same (epochs 1, max_batches 3)"), (2, "shorter")):
        refused = run(_pipeline(tmp_path, budget), resume="latest", extend=True)
        assert refused.exit_code == 2, refused.error
        assert refused.error.startswith("nothing to extend") and says in refused.error
        assert (out / "summary.json").read_bytes() == summary
        assert read_lines(out / "batches.jsonl") == batches
