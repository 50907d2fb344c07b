"""Issue 23, the careless user in-process: output paths that cannot be written are refused before any work
(one line, no traceback), counts that may be zero (a Padder replica whose first batch is a filler),
options that would be clamped silently (``eval --limit 0``), inputs that alias (a data file listed twice)."""

from __future__ import annotations

import textwrap
import time

import pytest
from typer.testing import CliRunner

from dflash_flow.cli import app

SLEEPY = textwrap.dedent(
    """\
    name: sleepy
    output_dir: {out}
    stages:
      - name: src
        type: Range
        config: {{count: 100000}}
      - name: work
        type: Delay
        inputs: [src]
        config: {{service_s: 0.05}}
      - name: sink
        type: Discard
        inputs: [work]
    """
)


@pytest.fixture
def sleepy(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(SLEEPY.format(out=tmp_path / "out"))
    return f


def _one_clean_line(res, *needles: str) -> None:
    text = res.output
    assert res.exit_code == 2, text
    assert "Traceback" not in text and len(text.strip().splitlines()) == 1, text
    for n in needles:
        assert n in text, text


@pytest.mark.parametrize("where", ["dir", "missing"])
def test_graph_output_that_cannot_be_a_file_is_one_line(sleepy, tmp_path, where):
    target = tmp_path if where == "dir" else tmp_path / "missing" / "dir" / "x.mmd"
    res = CliRunner().invoke(app, ["graph", str(sleepy), "-o", str(target)])
    _one_clean_line(res, "--output", str(target), "is a directory" if where == "dir" else "does not exist")
    assert not (tmp_path / "missing").exists()


def test_profile_out_is_checked_before_the_profile_runs(sleepy, tmp_path):
    t0 = time.monotonic()
    res = CliRunner().invoke(app, ["profile", str(sleepy), "--steps", "200", "--warmup", "0", "--out", str(tmp_path)])
    took = time.monotonic() - t0
    _one_clean_line(res, "--out", "is a directory")
    assert took < 5.0, took  # 200 steps of 0.05 s would take 10 s: nothing was profiled
    assert not (tmp_path / "out").exists()


def test_a_padder_replica_whose_first_batch_is_a_filler_pads_it():
    """Two ranks on 7 samples: a rank's last step is a filler, and the Padder replica it reaches may have
    seen nothing yet (0 padded tokens so far: the efficiency gauge divided by zero)."""
    from dflash_flow.core import StageContext
    from dflash_flow.items import BatchMeta, PlannedBatch, Sample
    from dflash_flow.stages.padder import Padder

    pad = Padder()
    ctx = StageContext(name="padder", rank=1, world_size=2)
    pad.setup(ctx)
    filler = BatchMeta(epoch=0, index=-1, bucket=0, lengths=[], real_tokens=0, padded_tokens=0, num_samples=0,
                       filler=True, rank=1)
    (out,) = pad.process(PlannedBatch(meta=filler, samples=[]))
    assert out.meta.filler and out.input_ids.numel() == 0
    real = BatchMeta(epoch=0, index=1, bucket=0, lengths=[3], real_tokens=3, padded_tokens=4, num_samples=1,
                     padded_len=4, rank=1)
    sample = Sample(sample_id=5, input_ids=[1, 2, 3], loss_mask=[0, 1, 1])
    (out,) = pad.process(PlannedBatch(meta=real, samples=[sample]))
    assert out.input_ids.shape == (1, 4)
    assert ctx.metrics.read()["padding_efficiency"] == pytest.approx(0.75)


@pytest.fixture
def eval_args(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "there"}\n')
    return ["eval", "--drafter", str(drafter), "--prompts", str(prompts)]


@pytest.mark.parametrize("limit", ["0", "-1"])
def test_eval_limit_below_one_is_refused_not_clamped_to_one_prompt(eval_args, limit):
    res = CliRunner().invoke(app, [*eval_args, "--target", "embedded", "--limit", limit])
    _one_clean_line(res, f"--limit must be at least 1, got {limit}")


def test_eval_target_that_does_not_exist_says_so(eval_args, tmp_path):
    missing = tmp_path / "nonexistent"
    res = CliRunner().invoke(app, [*eval_args, "--target", str(missing)])
    _one_clean_line(res, f"--target {missing} does not exist")
    assert "tokenizer" not in res.output


def _two_source_pipeline(tmp_path, first: list[str], second: list[str] | None):
    from reltools import train_pipeline, write_yaml

    doc = train_pipeline(tmp_path, data=tmp_path / "unused", output_dir=tmp_path / "out")
    doc["stages"][0]["config"]["paths"] = first
    if second is not None:
        extra = {**doc["stages"][0], "name": "source2", "config": {**doc["stages"][0]["config"], "paths": second}}
        doc["stages"].insert(1, extra)
        doc["stages"][2]["inputs"] = ["source", "source2"]
    return write_yaml(tmp_path / "p.yaml", doc)


@pytest.mark.parametrize("how", ["link", "two-stages"])
def test_a_data_file_read_twice_is_refused_naming_both(tmp_path, how):
    from reltools import write_tokenized

    data = write_tokenized(tmp_path / "tok.jsonl", 8)
    if how == "link":
        (tmp_path / "alias.jsonl").symlink_to(data)
        path = _two_source_pipeline(tmp_path, [str(data), str(tmp_path / "alias.jsonl")], None)
    else:
        path = _two_source_pipeline(tmp_path, [str(data)], [str(data)])
    res = CliRunner().invoke(app, ["validate", str(path)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert "is the same file as" in res.output and "trained twice per epoch" in res.output, res.output
    assert ("stage 'source' paths[0]" in res.output) == (how == "two-stages"), res.output


# -- 23.2: a run that trains nothing (or less than its plan) fails, and exports nothing -------------------
def _write_empty_arrow(path, stream: bool):
    import pyarrow as pa
    import pyarrow.ipc as ipc

    table = pa.table({"input_ids": pa.array([], pa.list_(pa.int64())), "loss_mask": pa.array([], pa.list_(pa.int64()))})
    opener = ipc.new_stream if stream else ipc.new_file
    with opener(str(path), table.schema) as w:
        w.write_table(table)
    return path


def _run_in_process(tmp_path, doc):
    from reltools import write_yaml

    from dflash_flow.app import run

    return run(write_yaml(tmp_path / "p.yaml", doc), check_devices=False)


@pytest.mark.parametrize("stream", [False, True], ids=["arrow-file", "arrow-stream"])
def test_an_empty_dataset_fails_clearly_and_exports_no_drafter(tmp_path, stream):
    """A 0-row Arrow file or stream (a schema, no rows): exit 2 naming the file, MLflow FAILED, no drafter."""
    from reltools import mlflow_runs, train_pipeline

    data = _write_empty_arrow(tmp_path / "empty.arrow", stream=stream)
    out = tmp_path / "out"
    report = _run_in_process(tmp_path, train_pipeline(tmp_path, data=data, output_dir=out, epochs=1))
    assert report.status == "FAILED" and report.exit_code == 2, (report.status, report.error)
    assert f"{data}: no records (0 rows)" in report.error, report.error
    assert not (out / "drafter").exists()
    (run,) = mlflow_runs(tmp_path / "mlflow.db")
    assert run.info.status == "FAILED"


def test_a_bucketer_that_received_no_sample_fails_instead_of_planning_nothing():
    """Whatever the source (a plugin emitting nothing, an empty table), no samples is an error, not 0 steps."""
    import numpy as np

    from dflash_flow.core import StageContext
    from dflash_flow.data.reports import DataError
    from dflash_flow.items import SampleTable
    from dflash_flow.stages.bucketer import Bucketer

    empty = SampleTable(name="src", lengths=np.zeros(0, np.int64), sample_ids=np.zeros(0, np.int64), fetch=None,
                        inputs=["a.arrow"])
    for items in ([], [empty]):
        b = Bucketer()
        b.setup(StageContext(name="bucketer"))
        for it in items:
            b.process(it)
        with pytest.raises(DataError, match="nothing to train on"):
            list(b.finish() or [])


@pytest.mark.slow
def test_a_stream_that_ends_before_its_plan_fails_and_exports_nothing(tmp_path):
    import attrs
    from reltools import mlflow_runs, train_pipeline, write_tokenized

    from dflash_flow.core import Stage, register_stage
    from dflash_flow.items import PlannedBatch

    @register_stage(name="RelDropAfterTwo")
    @attrs.define(kw_only=True, eq=False)
    class Gate(Stage):
        input_type = PlannedBatch
        output_type = PlannedBatch
        _seen: int = attrs.field(default=0, init=False)

        def process(self, item):
            self._seen += 1
            return (item,) if self._seen <= 2 else None

    data = write_tokenized(tmp_path / "tok.jsonl", 24, seed=2)
    out = tmp_path / "out"
    doc = train_pipeline(tmp_path, data=data, output_dir=out, epochs=1, every_steps=0)
    doc["stages"].insert(3, {"name": "gate", "type": "RelDropAfterTwo", "inputs": ["interleaver"]})
    doc["stages"][4]["inputs"] = ["gate"]
    report = _run_in_process(tmp_path, doc)
    assert report.status == "FAILED" and report.exit_code == 1, (report.status, report.error)
    assert "the data stream ended after 2 of the" in report.error and "nothing is exported" in report.error
    assert not (out / "drafter").exists()
    (run,) = mlflow_runs(tmp_path / "mlflow.db")
    assert run.info.status == "FAILED"


def test_rank_disagreement_names_the_field_and_the_ranks():
    from dflash_flow.app.distributed import disagreement

    same = {"config_hash": "a", "data_files": {"d.jsonl": "1"}, "version": "0.1.0"}
    assert disagreement([same, dict(same), dict(same)]) is None
    seed = disagreement([same, {**same, "config_hash": "b"}, dict(same)])
    assert "disagree on config_hash ('a' on rank 0, 'b' on rank 1)" in seed and "rank(s) 1 differ" in seed
    data = disagreement([same, dict(same), {**same, "data_files": {"d.jsonl": "2"}}])
    assert "disagree on data_files (d.jsonl: '1' on rank 0, '2' on rank 2)" in data and "rank(s) 2 differ" in data
    assert "version" in disagreement([same, {**same, "version": "0.2.0"}])
    # The config is compared field by field (core.identity.result_settings): the message names the field.
    flat = {"seed": 7, "stages.source.type": "T", "stages.source.paths": ["a"]}
    seed = disagreement([{"config": flat}, {"config": {**flat, "seed": 8}}])
    assert "disagree on config (seed: 7 on rank 0, 8 on rank 1)" in seed, seed


def test_the_launcher_blames_the_first_real_fault_not_a_rank_that_lost_its_peer():
    from dflash_flow.app.distributed import lost_peer
    from dflash_flow.app.launch import summarize

    gloo = ("stage 'drafter' replica 0 failed in process: RuntimeError: [pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:64646. This is typically caused by a remote worker crashing.")
    assert lost_peer(gloo) and lost_peer(RuntimeError("x")) is False
    assert lost_peer(ValueError("wrapped")) is False
    chained = RuntimeError("outer")
    chained.__cause__ = RuntimeError("Connection reset by peer")
    assert lost_peer(chained)
    from dflash_flow.core import StageError

    assert lost_peer(StageError("drafter", 0, "process", RuntimeError("Connection reset by peer")))  # its original
    fault = "stage 'target' replica 0 failed in process: InjectedFault: boom"
    records = {0: {"rank": 0, "status": "FAILED", "code": 1, "error": gloo, "stage": "drafter", "time": 5.0, "lost_peer": True},
               1: {"rank": 1, "status": "FAILED", "code": 1, "error": fault, "stage": "target", "time": 6.0, "lost_peer": False}}
    line = summarize(records, [0, 1], 1)
    assert line.startswith(f"rank 1 failed: {fault}") and "rank(s) 0 then lost their connection" in line, line
    # Two real faults: the earlier one; only lost peers: the earliest of those, said to be a consequence.
    records[0] = {**records[1], "rank": 0, "time": 7.0}
    assert summarize(records, [0, 1], 1).startswith("rank 1 failed")
    only_peers = {r: {**records[1], "rank": r, "error": gloo, "lost_peer": True, "time": 9.0 - r} for r in (0, 1)}
    assert "lost its connection to another rank" in summarize(only_peers, [0, 1], 1)
    # A rank refused at start-up (a user error): named without repeating its own "rank N:" prefix.
    refused = {0: {"rank": 0, "status": "FAILED", "code": 2, "error": "rank 0: the ranks of this job disagree"}}
    assert summarize(refused, [0], 2) == "rank 0 failed: the ranks of this job disagree"
    assert summarize({0: {"rank": 0, "status": "RUNNING"}}, [0, 1], 1).startswith("rank 0 died without reporting")
    assert summarize({0: {"rank": 0, "status": "FINISHED", "code": 0}, 1: {"rank": 1, "status": "FINISHED", "code": 0}}, [0, 1], 0) is None


def test_export_says_no_checkpoint_before_importing_torch(tmp_path):
    """`dflash-flow export` with nothing to export answers before torch and transformers are imported
    (they took 13-23 s on a busy machine to say "no checkpoint"): the checkpoint is resolved and checked,
    the destination too, and only then are the model libraries loaded."""
    import json
    import subprocess
    import sys

    (tmp_path / "empty").mkdir()
    (tmp_path / "ck" / "checkpoints").mkdir(parents=True)
    (tmp_path / "ck" / "checkpoints" / "step-00000002").mkdir()
    probe = (
        "import json, sys\n"
        "from dflash_flow.cli import main\n"
        "sys.argv = ['dflash-flow', 'export', *sys.argv[1:]]\n"
        "try:\n    main()\nexcept SystemExit as exc:\n    code = exc.code\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules)\n"
        "print(json.dumps({'code': code, 'heavy': heavy}))\n"
    )
    cases = [
        ([tmp_path / "missing", tmp_path / "out"], "error: no checkpoint at " + str(tmp_path / "missing")),
        ([tmp_path / "empty", tmp_path / "out"], "error: no checkpoint at " + str(tmp_path / "empty")),
        ([tmp_path / "ck" / "checkpoints", tmp_path / "out"], "error: no checkpoint in " + str(tmp_path / "ck" / "checkpoints")),
        ([tmp_path / "ck", tmp_path / "ck" / "x"], "refusing to export into " + str(tmp_path / "ck" / "x") + ": it is inside the input"),
    ]
    for args, message in cases:
        proc = subprocess.run([sys.executable, "-c", probe, *map(str, args)], capture_output=True, text=True, timeout=120)
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["code"] == 2, proc.stderr
        assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert result["heavy"] == [], (args, result)
