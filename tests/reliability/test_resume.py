"""Exactly-once resume of a real `dflash-flow run` process after SIGKILL, SIGINT and SIGTERM.

The pipeline is the real training pipeline (TokenizedSource -> Bucketer -> Interleaver -> Padder x2 ->
TargetForward x2 -> DrafterStep (ordered) -> Monitor) on the tiny-qwen3-8l preset, checkpointing every
2 steps. DrafterStep (`record_batches: true`) appends one line per batch it trains on to
OUTPUT/batches.jsonl, right after the batch's backward pass.

The splice rule after a SIGKILL. A checkpoint's ``state.json`` holds ``data_position.total``: the number
of batches the drafter had trained on (grad_accum 1: one line each, in order) when it was written. Lines
written after that checkpoint and before the kill were trained on, but their weight updates died with the
process, so the resumed run trains on them again and appends them again. Hence, with ``before`` the
file's lines at the moment of the kill and ``after`` the lines the resumed run appended:

    reference == before[:total] + after

(nothing skipped, nothing repeated), and the final weights equal the uninterrupted run's. After a
graceful stop (SIGINT/SIGTERM) the pipeline drains and saves a checkpoint of everything trained, so
``total == len(before)`` and the file is simply continued.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from pathlib import Path

import pytest
from reltools import (
    cli,
    count_complete_lines,
    finish,
    kill_hard,
    load_weights,
    mlflow_run,
    read_lines,
    start_cli,
    summary,
    train_pipeline,
    wait_for_lines,
    write_tokenized,
    write_yaml,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N_SAMPLES = 32  # 8-9 batches per epoch, 2 epochs: about 17 steps


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted run: its batch sequence, final weights and MLflow store."""
    root = tmp_path_factory.mktemp("resume")
    data = write_tokenized(root / "data.jsonl", N_SAMPLES, seed=3)
    out = root / "reference"
    path = write_yaml(root / "reference.yaml", train_pipeline(root, data=data, output_dir=out))
    res = cli(["run", path], cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    batches = read_lines(out / "batches.jsonl")
    assert len(batches) >= 14, "the reference run should train two epochs"
    seen = [json.loads(b) for b in batches]
    assert [b["epoch"] for b in seen] == sorted(b["epoch"] for b in seen)
    return {
        "root": root,
        "data": data,
        "batches": batches,
        "weights": load_weights(out / "drafter" / "model.safetensors"),
        "run_id": summary(out)["mlflow_run_id"],
    }


def _checkpoint(out: Path) -> dict:
    ckdir = out / "checkpoints"
    latest = ckdir / (ckdir / "latest").read_text().strip()
    state = json.loads((latest / "state.json").read_text())
    state["path"] = latest
    return state


def _assert_same_weights(ref: dict, path: Path) -> None:
    import torch

    got = load_weights(path)
    assert set(got) == set(ref)
    for k in ref:
        # CPU runs are deterministic here; allclose only guards against a platform's kernel choices.
        assert torch.allclose(got[k], ref[k], atol=1e-5, rtol=0), f"weight {k} differs after resume"


def _trial_root(reference, name: str, tracking: bool = True, **runtime) -> tuple[Path, Path, Path]:
    root = reference["root"] / name
    root.mkdir()
    out = root / "out"
    # Neither the runtime nor the tracking section is part of the resume config hash: queue sizes change
    # timing, not batches.
    doc = train_pipeline(reference["root"], data=reference["data"], output_dir=out, runtime=runtime, tracking=tracking)
    return root, out, write_yaml(root / "pipeline.yaml", doc)


def _kill_when(trials: list[dict], due, timeout_s: float = 180) -> None:
    """SIGKILL each trial's run once ``due(trial)`` holds; every run must still be running then."""
    try:
        deadline = time.monotonic() + timeout_s
        pending = list(trials)
        while pending and time.monotonic() < deadline:
            for t in list(pending):
                if due(t) or t["proc"].poll() is not None:
                    kill_hard(t["proc"])
                    pending.remove(t)
            time.sleep(0.005)
        assert not pending, "runs did not reach their kill points in time"
    finally:
        for t in trials:
            if t["proc"].returncode is None:
                kill_hard(t["proc"])
    for t in trials:
        assert t["proc"].returncode == -signal.SIGKILL, f"the run ended before the kill {t['where']}: " + (
            t["root"] / "first.log").read_text()[-2000:]


def test_uninterrupted_run_is_deterministic_in_its_batches(reference):
    # Every batch once per epoch: the recorded sample ids of an epoch are a partition of the data.
    per_epoch: dict[int, list[int]] = {}
    for line in reference["batches"]:
        rec = json.loads(line)
        per_epoch.setdefault(rec["epoch"], []).extend(rec["sample_ids"])
    assert sorted(per_epoch) == [0, 1]
    for epoch, ids in per_epoch.items():
        assert sorted(ids) == list(range(N_SAMPLES)), f"epoch {epoch} does not cover every sample once"
    run = mlflow_run(reference["root"] / "mlflow.db", reference["run_id"])
    assert run.info.status == "FINISHED"


def test_sigkill_at_random_steps_then_resume_is_exactly_once(reference):
    seed = int(os.environ.get("DFLASH_RELIABILITY_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    n = len(reference["batches"])
    # One kill point in each third of the run (early, around the epoch boundary, late), at random. The
    # three trials run side by side (separate processes and directories) to keep the suite short.
    windows = [(4, n // 3), (n // 3 + 1, 2 * n // 3), (2 * n // 3 + 1, n - 2)]
    trials = []
    for trial, (lo, hi) in enumerate(windows):
        kill_at = rng.randint(lo, max(lo, hi))
        # MLflow continuity is checked in the first trial (and the graceful test); the others skip the
        # tracking store's start-up cost.
        tracked = trial == 0
        root, out, path = _trial_root(reference, f"kill{trial}", tracking=tracked)
        proc = start_cli(["run", path], cwd=root, log=root / "first.log")
        trials.append({"where": f"(seed {seed}, trial {trial}, kill after {kill_at} batches)", "kill_at": kill_at,
                       "root": root, "out": out, "path": path, "proc": proc, "tracked": tracked})
    _kill_when(trials, lambda t: count_complete_lines(t["out"] / "batches.jsonl") >= t["kill_at"])
    for t in trials:
        where, out = t["where"], t["out"]
        raw = (out / "batches.jsonl").read_bytes()
        assert raw.endswith(b"\n"), f"a batch line was cut by the kill {where}"
        t["before"] = before = raw.decode().splitlines()
        t["ck"] = ck = _checkpoint(out)
        total = ck["data_position"]["total"]
        assert ck["step"] == total, "grad_accum 1: one optimizer step per batch"
        assert 2 <= total <= len(before), where
        assert before[:total] == reference["batches"][:total], f"the killed run diverged before the checkpoint {where}"
        assert bool(ck["mlflow_run_id"]) == t["tracked"], where
        # Every stage's state is in the checkpoint; only the last K (keep_last: 2) complete ones are kept.
        assert set(ck["stage_states"]) == {"source", "bucketer", "interleaver", "padder", "target", "drafter", "monitor"}
        assert len(list((out / "checkpoints").glob("step-*"))) <= 2
        assert (ck["path"] / "model.safetensors").is_file() and (ck["path"] / "optimizer.pt").is_file()
        t["proc"] = start_cli(["run", t["path"], "--resume", "latest"], cwd=t["root"], log=t["root"] / "resume.log")

    for t in trials:
        code = finish(t["proc"], 240)
        where, out, ck, before = t["where"], t["out"], t["ck"], t["before"]
        log = (t["root"] / "resume.log").read_text()
        assert code == 0, f"{where}\n{log[-3000:]}"
        assert f"resuming from {ck['path']}" in log
        total = ck["data_position"]["total"]
        after = read_lines(out / "batches.jsonl")[len(before):]
        spliced = before[:total] + after
        assert spliced == reference["batches"], (
            f"batch sequence after resume differs {where}: checkpoint total {total}, lines before the kill "
            f"{len(before)}, appended {len(after)}, reference {len(reference['batches'])}"
        )
        _assert_same_weights(reference["weights"], out / "drafter" / "model.safetensors")
        if not t["tracked"]:
            continue
        # The resumed run continues the same MLflow run, and finishes it.
        assert summary(out)["mlflow_run_id"] == ck["mlflow_run_id"], where
        run = mlflow_run(reference["root"] / "mlflow.db", ck["mlflow_run_id"])
        assert run.info.status == "FINISHED", where
        assert run.data.metrics["train/loss"] > 0


def _metric_steps(db: Path, run_id: str) -> dict[str, list[int]]:
    """Every metric of the run with the steps it was logged at, one entry per logged point."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    keys = client.get_run(run_id).data.metrics
    return {k: sorted(m.step for m in client.get_metric_history(run_id, k)) for k in keys}


def test_sigkill_with_grad_accum_3_and_tracking_logs_every_metric_step_exactly_once(reference):
    """The matrix with gradient accumulation (3 micro-batches an optimizer step, so a checkpoint falls
    between accumulations' ends only) and tracking on: two runs SIGKILLed (right after the epoch-end
    checkpoint, and at a random batch), each resumed
    with `--resume latest`, side by side with an uninterrupted run of the same pipeline. The batches splice
    exactly, the weights equal the uninterrupted run's, and in MLflow every (metric, step) of the run is
    there exactly once: no step logged twice (the steps between the checkpoint and the kill are trained
    again), none of the uninterrupted run's training steps missing (buffered metrics were flushed before
    each checkpoint committed)."""
    seed = int(os.environ.get("DFLASH_RELIABILITY_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    n = len(reference["batches"])  # grad_accum does not change the plan: the same batches, in the same order
    db = reference["root"] / "mlflow.db"

    def start(name: str):
        root = reference["root"] / name
        root.mkdir()
        doc = train_pipeline(reference["root"], data=reference["data"], output_dir=root / "out",
                             overrides={"drafter": {"grad_accum": 3}})
        path = write_yaml(root / "pipeline.yaml", doc)
        return {"root": root, "out": root / "out", "path": path,
                "proc": start_cli(["run", path], cwd=root, log=root / "first.log")}

    ref = start("accum3-reference")
    # Trial 0 is killed as soon as the checkpoint of epoch 0's last step is there (the resumed run starts in
    # epoch 1: epoch 0's means must already be in MLflow); trial 1 at a random batch of the second half.
    trials = [start("accum3-kill0"), start("accum3-kill1")]
    trials[0]["kill_at"] = None
    trials[0]["where"] = f"(seed {seed}, trial 0, kill right after the epoch-end checkpoint)"
    trials[1]["kill_at"] = rng.randint(n // 2 + 1, n - 2)
    trials[1]["where"] = f"(seed {seed}, trial 1, kill after {trials[1]['kill_at']} batches)"

    def due(t) -> bool:
        if t["kill_at"] is not None:
            return count_complete_lines(t["out"] / "batches.jsonl") >= t["kill_at"]
        try:
            return _checkpoint(t["out"])["stage_states"]["drafter"][0]["epoch_done"] is True
        except (OSError, ValueError, KeyError):
            return False

    _kill_when(trials, due)
    for t in trials:
        t["before"] = read_lines(t["out"] / "batches.jsonl")
        t["ck"] = ck = _checkpoint(t["out"])
        assert ck["data_position"]["total"] == 3 * ck["step"], f"grad_accum 3: three batches a step {t['where']}"
        t["proc"] = start_cli(["run", t["path"], "--resume", "latest"], cwd=t["root"], log=t["root"] / "resume.log")
    code = finish(ref["proc"], 240)
    assert code == 0, (ref["root"] / "first.log").read_text()[-3000:]
    ref_batches = read_lines(ref["out"] / "batches.jsonl")
    assert ref_batches == reference["batches"]
    ref_steps = _metric_steps(db, summary(ref["out"])["mlflow_run_id"])
    assert all(len(v) == len(set(v)) for v in ref_steps.values()), "the uninterrupted run logs each step once"
    # The trainer's metrics of each step (not the per-position accuracies: a mean over each Monitor sample
    # window, logged when the Monitor samples, so at steps that depend on timing).
    trained = {k: v for k, v in ref_steps.items() if k.startswith(("train/", "train_epoch/")) and "accuracy_pos" not in k}
    assert "train/loss" in trained and len(trained["train/loss"]) >= 5

    for t in trials:
        code = finish(t["proc"], 240)
        where, out, ck, before = t["where"], t["out"], t["ck"], t["before"]
        assert code == 0, f"{where}\n{(t['root'] / 'resume.log').read_text()[-3000:]}"
        total = ck["data_position"]["total"]
        after = read_lines(out / "batches.jsonl")[len(before):]
        assert before[:total] + after == ref_batches, f"batch sequence after resume differs {where}"
        _assert_same_weights(load_weights(ref["out"] / "drafter" / "model.safetensors"), out / "drafter" / "model.safetensors")
        run_id = summary(out)["mlflow_run_id"]
        assert run_id == ck["mlflow_run_id"] and mlflow_run(db, run_id).info.status == "FINISHED", where
        steps = _metric_steps(db, run_id)
        twice = {k: sorted({s for s in v if v.count(s) > 1}) for k, v in steps.items() if len(v) != len(set(v))}
        assert not twice, f"(metric, step) logged more than once {where}: {dict(list(twice.items())[:5])}"
        missing = {k: sorted(set(v) - set(steps.get(k, []))) for k, v in trained.items() if set(v) - set(steps.get(k, []))}
        assert not missing, f"training steps never reached MLflow {where}: {dict(list(missing.items())[:5])}"


def _stop_with(proc, sig: int, out: Path, at: int) -> int:
    wait_for_lines(out / "batches.jsonl", at, proc)
    assert proc.poll() is None, "the run ended before the signal"
    os.kill(proc.pid, sig)
    return finish(proc, 120)


def test_sigint_then_sigterm_stop_gracefully_and_resume_identically(reference):
    # Queues of one: a graceful stop drains what is in flight, which should leave room for a second stop.
    root, out, path = _trial_root(reference, "graceful", capacity=1)
    db = reference["root"] / "mlflow.db"
    n = len(reference["batches"])
    # The output directory still holds an earlier, finished run of the same pipeline: its batch log and
    # its (higher-step) checkpoints. A fresh run there is refused (it would mix its checkpoints with the
    # earlier run's), naming the directory; once they are gone it starts its own log.
    import shutil

    shutil.copytree(reference["root"] / "reference" / "checkpoints", out / "checkpoints")
    (out / "batches.jsonl").write_text('{"stale": "line from an earlier run"}\n')
    res = cli(["run", path], cwd=root, timeout=60)
    assert res.returncode == 2, res.stderr[-3000:]
    assert f"{out / 'checkpoints'} holds the checkpoints of an earlier run" in res.stderr and "Traceback" not in res.stderr
    assert read_lines(out / "batches.jsonl") == ['{"stale": "line from an earlier run"}']
    shutil.rmtree(out / "checkpoints")

    # 1. Ctrl-C mid-epoch 0: drain, checkpoint of everything trained, exit 130, MLflow KILLED.
    proc = start_cli(["run", path], cwd=root, log=root / "sigint.log")
    code = _stop_with(proc, signal.SIGINT, out, 2)
    log = (root / "sigint.log").read_text()
    assert code == 130, log[-3000:]
    assert "checkpoint saved to" in log and "Traceback" not in log, log[-3000:]
    # Said at once, before the drain and the checkpoint (issue 40.23).
    notice = "stopping after the batch in flight (Ctrl-C again to force)"
    assert notice in log and log.index(notice) < log.index("checkpoint saved to"), log[-3000:]
    ck = _checkpoint(out)
    # The run's clock is in the checkpoint; summary.json's goes a little further (the end of the drain).
    elapsed1 = ck["extra"]["elapsed_s"]
    assert 0 < elapsed1 <= summary(out)["elapsed_s"] and summary(out)["elapsed_resumed_s"] == 0
    lines1 = read_lines(out / "batches.jsonl")
    assert ck["data_position"]["total"] == len(lines1), "a graceful stop checkpoints every trained batch"
    assert lines1 == reference["batches"][: len(lines1)]
    assert len(lines1) < n - 1, f"the drain trained {len(lines1)} of {n} batches: no room for a second stop"
    run_id = ck["mlflow_run_id"]
    assert mlflow_run(db, run_id).info.status == "KILLED"
    assert summary(out)["status"] == "KILLED"

    # 2. Resume, then SIGTERM further on: same handling.
    proc = start_cli(["run", path, "--resume", "latest"], cwd=root, log=root / "sigterm.log")
    code = _stop_with(proc, signal.SIGTERM, out, len(lines1) + 1)
    log = (root / "sigterm.log").read_text()
    assert code == 130, log[-3000:]
    assert "checkpoint saved to" in log and "Traceback" not in log, log[-3000:]
    assert "SIGTERM: stopping after the batch in flight (SIGTERM again to force)" in log, log[-3000:]
    ck2 = _checkpoint(out)
    # The clock went on from the first checkpoint's, across the resume.
    assert summary(out)["elapsed_resumed_s"] == elapsed1 < ck2["extra"]["elapsed_s"] <= summary(out)["elapsed_s"]
    lines2 = read_lines(out / "batches.jsonl")
    assert ck2["data_position"]["total"] == len(lines2)
    assert ck2["mlflow_run_id"] == run_id
    assert mlflow_run(db, run_id).info.status == "KILLED"

    # 3. Resume to the end: the file is the reference's, the weights too, one MLflow run FINISHED.
    res = cli(["run", path, "--resume", "latest"], cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    assert read_lines(out / "batches.jsonl") == reference["batches"]
    _assert_same_weights(reference["weights"], out / "drafter" / "model.safetensors")
    assert summary(out)["mlflow_run_id"] == run_id
    assert summary(out)["elapsed_resumed_s"] == ck2["extra"]["elapsed_s"] < summary(out)["elapsed_s"]
    assert mlflow_run(db, run_id).info.status == "FINISHED"


def test_resume_without_a_checkpoint_is_a_clear_error(reference):
    root, out, path = _trial_root(reference, "nockpt")
    res = cli(["run", path, "--resume", "latest"], cwd=root, timeout=60)
    assert res.returncode == 2, res.stderr
    assert "no checkpoint" in res.stderr and "Traceback" not in res.stderr
    assert count_complete_lines(out / "batches.jsonl") == 0


def test_resume_from_a_real_checkpoint_of_another_config_or_corrupted_is_refused(reference):
    import shutil

    ref_ckpts = reference["root"] / "reference" / "checkpoints"
    root = reference["root"] / "refused"
    root.mkdir()
    # Another configuration: same pipeline, another learning rate.
    doc = train_pipeline(reference["root"], data=reference["data"], output_dir=root / "out",
                         overrides={"drafter": {"lr": 1e-3}})
    res = cli(["run", write_yaml(root / "other.yaml", doc), "--resume", ref_ckpts], cwd=root, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "checkpoint was written by another configuration" in res.stderr and "Traceback" not in res.stderr
    # Corrupted: a copy of the real latest checkpoint with one byte of the optimizer state flipped.
    latest = ref_ckpts / (ref_ckpts / "latest").read_text().strip()
    bad = root / "corrupted" / latest.name
    shutil.copytree(latest, bad)
    raw = bytearray((bad / "optimizer.pt").read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (bad / "optimizer.pt").write_bytes(bytes(raw))
    doc = train_pipeline(reference["root"], data=reference["data"], output_dir=root / "out2")
    res = cli(["run", write_yaml(root / "same.yaml", doc), "--resume", bad], cwd=root, timeout=60)
    assert res.returncode == 2, res.stderr[-2000:]
    assert "optimizer.pt is corrupted (checksum mismatch)" in res.stderr and "Traceback" not in res.stderr
    assert not (root / "out2" / "batches.jsonl").exists(), "nothing may run from a corrupted checkpoint"


def test_checkpoints_of_an_earlier_run_do_not_shadow_a_fresh_runs(tmp_path):
    """In-process check of the rule the graceful test relies on: the last K *written* are kept and
    `latest` is the newest written, even when an earlier run left higher steps in the directory -- and the
    fresh run prunes only its own checkpoints, never the earlier run's."""
    import torch

    from dflash_flow.app.checkpoint import Checkpointer

    def save(ck, step):
        return ck.save(step=step, epoch=0, model_state={"w": torch.full((2,), float(step))},
                       optimizer_state={"step": step}, data_position={"epoch": 0, "consumed": step, "total": step})

    earlier = Checkpointer(tmp_path, keep_last=2, config_hash="h")
    for step in (16, 17):
        save(earlier, step)
    fresh = Checkpointer(tmp_path, keep_last=2, config_hash="h")
    save(fresh, 2)
    (tmp_path / "latest").unlink()  # even without the marker (e.g. killed between the two writes)
    assert fresh.load("latest").step == 2
    save(fresh, 4)
    save(fresh, 6)
    assert sorted(p.name for p in fresh.list()) == ["step-00000004", "step-00000006", "step-00000016", "step-00000017"]
    assert fresh.load("latest").step == 6
    assert float(fresh.load("latest").model_state()["w"][0]) == 6.0
    # A run resumed from the fresh run's checkpoint continues its lineage: it prunes the fresh run's old ones.
    resumed = Checkpointer(tmp_path, keep_last=2, config_hash="h", run_uid=fresh.load("latest").run_uid)
    save(resumed, 8)
    assert sorted(p.name for p in resumed.list()) == ["step-00000006", "step-00000008", "step-00000016", "step-00000017"]
