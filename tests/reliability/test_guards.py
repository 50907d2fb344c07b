"""The guards behind the CLI cases, in-process on real parts: the checkpoint writer on a full tmpfs, pruning
that leaves other programs' directories alone, `latest` falling back past damage, NaN weights refused, a
diverging trainer stopped (or its step skipped), uploads that never follow a link out of the output
directory (a real sqlite MLflow store read back), the run lock, the readers' bounds, and the watchdog's
suspended-time rule as a property."""

from __future__ import annotations

import json
import logging
import math
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_flow.app.checkpoint import Checkpointer
from dflash_flow.app.checkpoint_format import InvalidCheckpoint
from dflash_flow.core.errors import CheckpointError

GiB = 2**30


def _save(ck: Checkpointer, step: int, size: int = 4, value: float | None = None):
    w = torch.full((size,), float(step if value is None else value))
    return ck.save(step=step, epoch=0, model_state={"w": w}, optimizer_state={"step": step, "m": torch.zeros(size)},
                   data_position={"epoch": 0, "plan": None, "total": step})


@pytest.fixture
def small_disk(tmp_path):
    where = tmp_path / "disk"
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"needs a tmpfs mount (root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.mark.parametrize("big", ["weights", "optimizer"])
def test_a_full_disk_mid_checkpoint_names_it_and_leaves_the_last_one_intact(small_disk, big):
    ck = Checkpointer(small_disk / "ckpts", keep_last=3, config_hash="h")
    _save(ck, 1)
    n = 400_000  # 1.6 MB of float32: more than the disk holds
    w = torch.zeros(n if big == "weights" else 4)
    m = torch.zeros(n if big == "optimizer" else 4)
    with pytest.raises(CheckpointError) as info:
        ck.save(step=2, epoch=0, model_state={"w": w}, optimizer_state={"m": m}, data_position={})
    assert str(info.value) == (f"cannot write checkpoint {small_disk / 'ckpts' / 'step-00000002'}: No space left on "
                               "device; the earlier checkpoints are intact")
    assert not list((small_disk / "ckpts").glob(".tmp-*")), "the half-written checkpoint is removed"
    good = ck.load("latest")
    assert good.step == 1 and float(good.model_state()["w"][0]) == 1.0


def test_pruning_removes_only_this_runs_checkpoints(tmp_path):
    foreign = tmp_path / "step-00000001"  # another program's directory with a checkpoint-like name
    foreign.mkdir()
    (foreign / "MANIFEST.json").write_text("{}")
    (foreign / "keep.txt").write_text("mine")
    (tmp_path / ".tmp-step-00000009-someone-else").mkdir()
    other = Checkpointer(tmp_path, keep_last=1, config_hash="h")
    _save(other, 50)  # an earlier run's real checkpoint
    ours = Checkpointer(tmp_path, keep_last=1, config_hash="h")
    for step in (2, 3, 4):
        _save(ours, step)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".tmp-step-00000009-someone-else", "latest", "step-00000001", "step-00000004", "step-00000050"]
    assert (foreign / "keep.txt").read_text() == "mine"


def test_latest_falls_back_past_damaged_checkpoints_with_one_warning(tmp_path, caplog):
    ck = Checkpointer(tmp_path, keep_last=5, config_hash="h")
    for step in (1, 2, 3):
        _save(ck, step)
    (tmp_path / "step-00000003" / "state.json").write_text("[]")  # newest: checksum now wrong
    (tmp_path / "step-00000002" / "MANIFEST.json").write_text("[1, 2]")  # next: manifest a list
    with caplog.at_level(logging.WARNING, logger="dflash_flow"):
        got = ck.load("latest")
    assert got.step == 1
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].startswith("skipping 2 invalid checkpoint(s) (")
    assert "step-00000003: state.json is corrupted (checksum mismatch)" in warnings[0]
    assert "step-00000002: MANIFEST.json must be a JSON object" in warnings[0]
    # A single checkpoint named explicitly is not replaced by another one.
    with pytest.raises(InvalidCheckpoint, match=r"^not a valid checkpoint: .*step-00000003: state.json is corrupted"):
        ck.load(tmp_path / "step-00000003")
    # Another configuration is a decision, not damage: no fallback past it.
    _save(ck, 4)
    with pytest.raises(CheckpointError, match="written by another configuration"):
        Checkpointer(tmp_path, config_hash="other").load("latest")


def test_a_hostile_latest_marker_cannot_point_out_of_the_directory(tmp_path):
    ck = Checkpointer(tmp_path / "c", keep_last=5, config_hash="h")
    _save(ck, 1)
    outside = Checkpointer(tmp_path / "elsewhere", keep_last=5, config_hash="h")
    _save(outside, 7)
    (tmp_path / "c" / "latest").write_text("../elsewhere/step-00000007\n")
    assert ck.load("latest").step == 1


def test_nonfinite_weights_are_never_checkpointed_nor_exported(tmp_path):
    from dflash_flow.model.export import save_drafter
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, build_drafter

    ck = Checkpointer(tmp_path / "ckpt", keep_last=2, config_hash="h")
    _save(ck, 1)
    with pytest.raises(CheckpointError, match=r"refusing to write checkpoint .*step-00000002: weight w holds NaN"):
        _save(ck, 2, value=float("nan"))
    assert [p.name for p in ck.list()] == ["step-00000001"]
    drafter = build_drafter(load_target_config("tiny-qwen3-8l"), DrafterShape(num_layers=1, block_size=4, mask_token_id=511),
                            seed=0, device="cpu", dtype=torch.float32)
    state = drafter.state_dict()
    name = next(iter(state))
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("inf")
    with pytest.raises(CheckpointError, match=f"refusing to export the drafter to {tmp_path / 'export'}: weight {name}"):
        save_drafter(drafter, tmp_path / "export", state=state)
    assert not (tmp_path / "export" / "model.safetensors").exists()
    # A link planted at a final name is replaced, never written through.
    (tmp_path / "export").mkdir(exist_ok=True)
    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"precious")
    (tmp_path / "export" / "model.safetensors").symlink_to(victim)
    save_drafter(drafter, tmp_path / "export")
    assert victim.read_bytes() == b"precious"
    assert not (tmp_path / "export" / "model.safetensors").is_symlink()


def _trainer(on_nonfinite: str):
    from dflash_flow.model.head import load_shared_head
    from dflash_flow.model.target import load_target_config
    from dflash_flow.model.trainer import DrafterShape, DrafterTrainer, TrainerConfig, build_drafter

    tc = load_target_config("tiny-qwen3-8l")
    drafter = build_drafter(tc, DrafterShape(num_layers=1, block_size=4, mask_token_id=511), seed=0, device="cpu",
                            dtype=torch.float32)
    head = load_shared_head("tiny-qwen3-8l", "cpu", torch.float32)
    config = TrainerConfig(num_anchors=8, lr=1e-3, warmup_ratio=0.0, on_nonfinite=on_nonfinite)
    return DrafterTrainer(drafter, head, config, device="cpu", dtype=torch.float32)


def _batch(trainer, index: int, nan: bool):
    from dflash_flow.items import BatchMeta, TargetFeatures

    b, s = 2, 24
    g = torch.Generator().manual_seed(index)
    ids = torch.randint(0, 500, (b, s), generator=g)
    width = len(trainer.drafter.target_layer_ids) * trainer.drafter.config.hidden_size
    hidden = torch.randn(b, s, width, generator=g)
    if nan:
        hidden[0, 3, 0] = float("nan")
    meta = BatchMeta(epoch=0, index=index, bucket=0, lengths=[s] * b, real_tokens=b * s, padded_tokens=b * s,
                     num_samples=b, sample_ids=[10 + index, 20 + index], total_batches=4)
    mask = torch.ones(b, s, dtype=torch.long)
    mask[:, :4] = 0
    return TargetFeatures(input_ids=ids, loss_mask=mask, attention_mask=torch.ones(b, s, dtype=torch.long),
                          hidden_states=hidden, meta=meta, target_layer_ids=list(trainer.drafter.target_layer_ids))


def test_a_nonfinite_step_stops_naming_step_and_batch_with_the_weights_untouched():
    from dflash_flow.model.optim import NonFiniteError

    trainer = _trainer("stop")
    assert trainer.train_batch(_batch(trainer, 0, nan=False), anchor_seed=1) is not None
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    with pytest.raises(NonFiniteError) as info:
        trainer.train_batch(_batch(trainer, 1, nan=True), anchor_seed=2)
    msg = str(info.value)
    assert msg.startswith("non-finite loss (nan) at optimizer step 2 (batch 1 of epoch 0, samples [11, 21]): "
                          "the training diverged; the update was not applied"), msg
    after = trainer.drafter.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.step == 1


def test_on_nonfinite_skip_leaves_the_weights_finite_and_goes_on(caplog):
    trainer = _trainer("skip")
    trainer.train_batch(_batch(trainer, 0, nan=False), anchor_seed=1)
    with caplog.at_level(logging.WARNING, logger="dflash_flow"):
        metrics = trainer.train_batch(_batch(trainer, 1, nan=True), anchor_seed=2)
    assert "skipping the update of non-finite loss (nan) at optimizer step 2 (batch 1 of epoch 0" in caplog.text
    assert all(math.isfinite(v) for v in metrics.values()), metrics  # no NaN reaches the tracker or the report
    metrics = trainer.train_batch(_batch(trainer, 2, nan=False), anchor_seed=3)
    assert math.isfinite(metrics["loss"]) and trainer.step == 3
    assert all(bool(torch.isfinite(v).all()) for v in trainer.drafter.state_dict().values())


def test_uploads_never_follow_a_link_out_of_the_output_directory(tmp_path, caplog):
    from mlflow import MlflowClient

    from dflash_flow.app.endrun import ContainedUploads
    from dflash_flow.observe.tracking import Tracker

    out = tmp_path / "out"
    (out / "monitor").mkdir(parents=True)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    (out / "monitor" / "history.json").write_text("{}")
    (out / "monitor" / "leak.txt").symlink_to(secret)
    (out / "summary.json").write_text("{}")
    (out / "linked.json").symlink_to(secret)
    db = tmp_path / "mlflow.db"
    tracker = Tracker.start(tracking_uri=str(db), experiment="guards", system_metrics=False, spool_dir=out / "spool")
    uploads = ContainedUploads(tracker, out)
    with caplog.at_level(logging.WARNING, logger="dflash_flow"):
        uploads.log_artifact(out / "summary.json")
        uploads.log_artifact(out / "linked.json")
        uploads.log_artifact(out / "monitor", "monitor")
        uploads.log_artifact(secret)
    assert uploads.run_id == tracker.run_id  # everything else is the tracker's
    tracker.end("FINISHED")
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    assert [a.path for a in client.list_artifacts(tracker.run_id)] == ["summary.json"]
    assert caplog.text.count("not uploading") == 3
    assert f"not uploading {out / 'monitor'}: it leads outside output_dir {out} (to {secret})" in caplog.text


def test_the_run_lock_refuses_a_second_holder_and_is_released(tmp_path):
    import os

    from dflash_flow.app.exits import UserError
    from dflash_flow.app.prepare import OutputLock

    first = OutputLock.acquire(tmp_path)
    with pytest.raises(UserError, match=rf"output_dir {tmp_path} is in use by another run \(pid {os.getpid()} on "):
        OutputLock.acquire(tmp_path)
    first.release()
    OutputLock.acquire(tmp_path).release()
    # A link at the lock's name is never followed.
    (tmp_path / ".dflash-flow.lock").unlink()
    (tmp_path / ".dflash-flow.lock").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(UserError, match="cannot create the run lock"):
        OutputLock.acquire(tmp_path)
    assert not (tmp_path / "elsewhere").exists()


def test_the_batch_log_is_never_written_through_a_link(tmp_path):
    from dflash_flow.observe.record import BatchLog

    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "batches.jsonl").symlink_to(victim)
    with pytest.raises(PermissionError, match="refusing to follow a symbolic link in output_dir"):
        BatchLog(out, rank=0, world_size=1, append=False)  # OUTPUT/batches.jsonl
    assert victim.read_text() == "precious\n"


def test_the_export_is_never_written_through_a_link_out_of_the_output_directory(tmp_path):
    from dflash_flow.model.export import DrafterExporter

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    (out / "drafter").symlink_to(elsewhere, target_is_directory=True)  # made mid-run, after validate
    with pytest.raises(PermissionError, match="refusing to write outside output_dir"):
        DrafterExporter(out).export(None, {}, "drafter", target=None)  # refused before the weights are read
    assert list(elsewhere.iterdir()) == []


# -- readers ---------------------------------------------------------------------------------------------
def test_an_overlong_record_is_skipped_in_bounded_memory(tmp_path):
    import resource

    from dflash_flow.data.records import DataError, ReadOptions, read_records

    path = tmp_path / "big.jsonl"
    good = json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}).encode()
    with open(path, "wb") as f:
        f.write(good + b"\n")
        f.truncate(len(good) + 1 + 512 * 2**20)  # a 512 MiB line of NUL bytes (sparse)
        f.seek(0, 2)
        f.write(b"\n" + good + b"\n")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tf = read_records(path, kind="tokens", options=ReadOptions(on_bad_record="skip", max_record_bytes=2**20))
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert len(tf) == 2 and tf.report.bad == 1
    assert str(tf.report.bad_records[0]) == (f"{path}:2: record of {512 * 2**20} bytes is longer than "
                                             f"max_record_bytes={2**20} (1 MiB); raise max_record_bytes or split the record")
    assert [int(x) for x in tf.lines] == [1, 3]
    assert grown_mib < 64, f"reading grew the process by {grown_mib:.0f} MiB"
    with pytest.raises(DataError, match=r"big.jsonl:2: record of 536870912 bytes is longer"):
        read_records(path, kind="tokens", options=ReadOptions(on_bad_record="fail", max_record_bytes=2**20))


def test_arrow_ids_that_do_not_fit_int32_are_refused_not_wrapped(tmp_path):
    import pyarrow as pa

    from dflash_flow.data.records import ReadOptions, read_records

    table = pa.table({"input_ids": pa.array([[1, 2, 3], [4, 2**31 + 5, 6]], type=pa.list_(pa.int64())),
                      "loss_mask": pa.array([[0, 1, 1], [0, 1, 1]], type=pa.list_(pa.int8()))})
    path = tmp_path / "t.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    tf = read_records(path, kind="tokens", options=ReadOptions(on_bad_record="skip"))
    assert len(tf) == 1 and int(tf.ids.max()) == 3
    assert "input_ids[1] = 2147483653 is not a token id" in str(tf.report.bad_records[0])


# -- the watchdog's clock --------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(interval=st.floats(0.01, 5.0), ticks=st.lists(st.tuples(st.floats(0.0, 2.0), st.floats(0.0, 1e5)), min_size=1, max_size=50))
def test_suspended_time_never_counts_as_no_progress_time(interval, ticks):
    """Each tick is (scheduling delay as a share of the interval, seconds the process was stopped). However
    long the suspensions, they add at most a bounded allowance per tick; delays within it count in full."""
    from dflash_flow.core.replica import running_time

    allowance = max(0.5 * interval, 0.05)
    counted = ran = 0.0
    for delay_share, stopped in ticks:
        ran_here = interval * (1 + delay_share)
        gap = ran_here + stopped
        got = running_time(gap, interval)
        assert got <= interval + allowance + 1e-9
        if stopped == 0 and ran_here <= interval + allowance:
            assert got == pytest.approx(ran_here)
        counted += got
        ran += ran_here
    assert counted <= ran + len(ticks) * allowance + 1e-6
