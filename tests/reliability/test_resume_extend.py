"""Extending a run and output directories (issue 22.6): a finished run trains on to more epochs, or a
stopped one to a larger ``max_batches``, only when asked (``extend=True``, the CLI's ``--extend``), with the
learning-rate schedule re-planned over the new total; without it the resume is refused naming the field and
the flag. A fresh run into an output directory that holds another run's checkpoints is refused, naming the
directory. In-process runs of the tiny real training pipeline (32 samples: 9-10 batches an epoch)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from reltools import read_lines, train_pipeline, write_tokenized, write_yaml

from dflash_flow.app import run

pytestmark = pytest.mark.timeout(300)


def _pipeline(tmp_path: Path, *, epochs: int = 2, max_batches: int | None = None) -> Path:
    data = tmp_path / "data.jsonl"
    if not data.exists():
        write_tokenized(data, 32, seed=3)
    doc = train_pipeline(tmp_path, data=data, output_dir=tmp_path / "out", tracking=False, epochs=epochs)
    if max_batches is not None:
        next(s for s in doc["stages"] if s["name"] == "interleaver")["config"] = {"max_batches": max_batches}
    name = f"e{epochs}-b{max_batches}.yaml"
    return write_yaml(tmp_path / name, doc)


def _latest_state(out: Path) -> tuple[dict, dict]:
    import torch

    ckdir = out / "checkpoints"
    latest = ckdir / (ckdir / "latest").read_text().strip()
    return (json.loads((latest / "state.json").read_text()),
            torch.load(latest / "optimizer.pt", map_location="cpu", weights_only=True)["scheduler"])


def test_a_finished_run_gets_more_epochs_only_when_asked_with_the_schedule_replanned(tmp_path):
    out = tmp_path / "out"
    first = run(_pipeline(tmp_path, epochs=2))
    assert first.ok, first.error
    done = len(read_lines(out / "batches.jsonl"))
    state, sched = _latest_state(out)
    assert state["step"] == sched["total_steps"] == done  # the floor reached at the last step

    # Another length without --extend: refused, naming the field and the flag; nothing trained.
    three = _pipeline(tmp_path, epochs=3)
    refused = run(three, resume="latest")
    assert refused.exit_code == 2
    assert "stages.bucketer.epochs: 2 in the checkpoint, 3 now" in refused.error and "--extend" in refused.error
    assert len(read_lines(out / "batches.jsonl")) == done
    # --extend without --resume: nothing to extend.
    alone = run(three, extend=True)
    assert alone.exit_code == 2 and "--resume" in alone.error

    extended = run(three, resume="latest", extend=True)
    assert extended.ok, extended.error
    lines = [json.loads(line) for line in read_lines(out / "batches.jsonl")[done:]]
    assert {b["epoch"] for b in lines} == {2}, "the extension trains the third epoch, and only it"
    assert sorted(i for b in lines for i in b["sample_ids"]) == list(range(32)), "every sample once"
    state, sched = _latest_state(out)
    total = done + len(lines)
    assert state["step"] == sched["total_steps"] == total
    # Re-planned, not re-spanned: from the resumed step on the lr is that of a run planned with the new
    # total from the start (the same warmup steps, the cosine over the rest to its floor, 0, at the last step),
    # so it rises from the finished run's floor. The reported lr is the next update's.
    assert sched["respan_from"] is None
    warmup = sched["warmup_steps"]
    assert warmup == math.ceil(done * 0.04)

    def planned(step: int) -> float:
        return 6e-4 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))

    lrs = extended.record.history.train.series("lr")
    assert [s for s, _ in lrs] == list(range(done + 1, total + 1))
    for step, lr in lrs:
        assert lr == pytest.approx(planned(step), rel=1e-9, abs=1e-15), f"lr at step {step}"
    assert lrs[0][1] > 0 and lrs[-1][1] == pytest.approx(0.0, abs=1e-15)


def test_a_stopped_run_gets_a_larger_batch_budget_with_extend(tmp_path):
    out = tmp_path / "out"
    first = run(_pipeline(tmp_path, max_batches=5))
    assert first.ok, first.error
    assert len(read_lines(out / "batches.jsonl")) == 5
    refused = run(_pipeline(tmp_path, max_batches=8), resume="latest")
    assert refused.exit_code == 2
    assert "stages.interleaver.max_batches: 5 in the checkpoint, 8 now" in refused.error and "--extend" in refused.error
    extended = run(_pipeline(tmp_path, max_batches=8), resume="latest", extend=True)
    assert extended.ok, extended.error
    assert len(read_lines(out / "batches.jsonl")) == 8
    state, sched = _latest_state(out)
    assert state["step"] == sched["total_steps"] == 8


def test_a_fresh_run_into_a_directory_holding_another_runs_checkpoints_is_refused(tmp_path):
    path = _pipeline(tmp_path, max_batches=3)
    assert run(path).ok
    before = read_lines(tmp_path / "out" / "batches.jsonl")
    again = run(path)
    assert again.exit_code == 2 and again.status == "FAILED"
    assert f"{tmp_path / 'out' / 'checkpoints'} holds the checkpoints of an earlier run" in again.error
    assert "--resume latest" in again.error and "another output_dir" in again.error
    assert read_lines(tmp_path / "out" / "batches.jsonl") == before, "the refused run wrote into the directory"


def test_torchrun_passes_extend_to_every_rank():
    from dflash_flow.app.launch import torchrun_command

    cmd = torchrun_command(Path("p.yaml"), nproc=2, resume="latest", extend=True)
    assert cmd[-3:] == ["--resume", "latest", "--extend"]
    assert "--extend" not in torchrun_command(Path("p.yaml"), nproc=2, resume="latest")


@pytest.mark.slow
def test_the_cli_refuses_a_fresh_run_over_checkpoints_and_extends_with_the_flag(tmp_path):
    from reltools import cli

    path = _pipeline(tmp_path, max_batches=3)
    assert cli(["run", path], cwd=tmp_path).returncode == 0
    again = cli(["run", path], cwd=tmp_path, timeout=60)
    assert again.returncode == 2 and "holds the checkpoints of an earlier run" in again.stderr
    assert "Traceback" not in again.stderr
    longer = ["run", path, "--set", "stages.interleaver.max_batches=5", "--resume", "latest"]
    refused = cli(longer, cwd=tmp_path, timeout=60)
    assert refused.returncode == 2 and "max_batches: 3 in the checkpoint, 5 now" in refused.stderr
    assert "pass --extend" in refused.stderr
    extended = cli([*longer, "--extend"], cwd=tmp_path)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert len(read_lines(tmp_path / "out" / "batches.jsonl")) == 5
