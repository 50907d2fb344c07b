"""The output directory of a fresh run (issue 40.12): an export directory holding other files is refused in
the prepare phase (not after the training), and an earlier run's summary and batch log are moved aside, never
overwritten."""

from __future__ import annotations

import json
import logging

import pytest

from dflash_flow.app.exits import UserError
from dflash_flow.app.prepare import prepare
from dflash_flow.core.config import load_graph_text
from dflash_flow.core.validate import validated

PIPELINE = """
output_dir: {out}
tracking: {{enabled: false}}
stages:
  - {{name: source, type: TokenizedSource, config: {{paths: [{data}], cache_dir: null}}}}
  - {{name: bucketer, type: Bucketer, inputs: [source]}}
  - {{name: interleaver, type: Interleaver, inputs: [bucketer]}}
  - {{name: padder, type: Padder, inputs: [interleaver]}}
  - {{name: target, type: TargetForward, inputs: [padder]}}
  - {{name: drafter, type: DrafterStep, inputs: [target]}}
model: {{target: tiny-qwen3-8l}}
"""


def _validated(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}) + "\n")
    out = tmp_path / "out"
    return validated(load_graph_text(PIPELINE.format(out=out, data=data), "p.yaml"), check_devices=False), out


def test_an_export_directory_holding_other_files_is_refused_before_training(tmp_path):
    v, out = _validated(tmp_path)
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "notes.txt").write_text("mine\n")
    with pytest.raises(UserError) as e:
        prepare(v, None, out, resume=None)
    msg = str(e.value)
    assert "stage 'drafter': export_dir" in msg and "notes.txt" in msg and "choose a new or empty directory" in msg
    assert (out / "drafter" / "notes.txt").read_text() == "mine\n"
    lock, _, _ = prepare(v, None, out / "other", resume=None)  # the lock was let go: a later prepare works
    lock.release()


def test_an_earlier_export_is_fine(tmp_path):
    v, out = _validated(tmp_path)
    (out / "drafter").mkdir(parents=True)
    (out / "drafter" / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    lock, _, ckpt = prepare(v, None, out, resume=None)
    lock.release()
    assert ckpt is None


def test_a_fresh_run_moves_an_earlier_runs_summary_and_batch_log_aside_and_says_so(tmp_path, caplog):
    v, out = _validated(tmp_path)
    out.mkdir()
    (out / "summary.json").write_text('{"status": "FINISHED"}')
    (out / "batches.jsonl").write_text('{"epoch": 0, "index": 0, "sample_ids": [1]}\n')
    (out / "batches.rank1.jsonl").write_text("rank 1\n")
    with caplog.at_level(logging.WARNING, logger="dflash_flow"):
        lock, _, _ = prepare(v, None, out, resume=None)
    lock.release()
    assert not (out / "summary.json").exists() and not (out / "batches.jsonl").exists()
    assert (out / "summary.json.old").read_text() == '{"status": "FINISHED"}'
    assert (out / "batches.jsonl.old").read_text().startswith('{"epoch": 0')
    assert (out / "batches.rank1.jsonl.old").read_text() == "rank 1\n"
    [said] = [r.getMessage() for r in caplog.records if "moved aside" in r.getMessage()]
    assert "summary.json" in said and "batches.jsonl.old" in said
