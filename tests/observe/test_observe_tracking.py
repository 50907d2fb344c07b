"""Tracker against a real sqlite MLflow store, read back with MlflowClient (no mocks)."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_flow.cli import app
from dflash_flow.observe.spool import SpoolError, import_spool, read_spool
from dflash_flow.observe.store import (
    MAX_PARAM_VAL_LENGTH,
    check_tracking_uri,
    flatten_params,
    redact_uri,
    resolve_tracking_uri,
    run_tags,
)
from dflash_flow.observe.tracking import Tracker, TrackingError

REPO = Path(__file__).resolve().parents[2]

CONFIG = {
    "run": {"experiment": "exp", "seed": 7},
    "stages": [
        {"name": "bucketer", "type": "Bucketer", "replicas": 1, "boundaries": [128, 256, 512]},
        {"name": "padder", "type": "Padder", "replicas": 3},
    ],
    "train": {"lr": 3e-4, "optimizer": {"name": "adamw", "betas": [0.9, 0.95]}},
    "long": "x" * (MAX_PARAM_VAL_LENGTH + 500),
}


def client_for(uri):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ------------------------------------------------------------------ pure helpers


def test_flatten_params_dotted_keys_lists_and_truncation():
    flat = flatten_params(CONFIG)
    assert flat["run.seed"] == "7"
    assert flat["stages.0.name"] == "bucketer"
    assert flat["stages.0.boundaries"] == "[128, 256, 512]"
    assert flat["stages.1.replicas"] == "3"
    assert flat["train.optimizer.betas"] == "[0.9, 0.95]"
    assert flat["train.lr"] == "0.0003"
    assert len(flat["long"]) == MAX_PARAM_VAL_LENGTH and flat["long"].endswith("[truncated]")
    assert flatten_params({"bad key!": {"é": 1}}) == {"bad key_.é": "1"}
    uri = "http://alice:s3cret@mlflow.example:5000/api?token=abc&x=1"
    assert flatten_params({"tracking": {"tracking_uri": uri}}) == {
        "tracking.tracking_uri": "http://***@mlflow.example:5000/api?token=***&x=***"
    }


def test_resolve_tracking_uri_plain_path_and_passthrough(tmp_path):
    assert resolve_tracking_uri(tmp_path / "x" / "store.db") == f"sqlite:///{tmp_path}/x/store.db"
    assert resolve_tracking_uri(tmp_path) == f"sqlite:///{tmp_path}/mlflow.db"  # a directory
    assert resolve_tracking_uri("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert resolve_tracking_uri("sqlite:///a.db") == "sqlite:///a.db"


def test_run_tags():
    tags = run_tags(CONFIG, world_size=2, device_summary="cpu x2", cwd=REPO)
    assert tags["world_size"] == "2" and tags["device_summary"] == "cpu x2"
    assert len(tags["config_hash"]) == 16
    assert tags["config_hash"] == run_tags(json.loads(json.dumps(CONFIG)), cwd=REPO)["config_hash"]
    assert tags["git_commit"].split("-")[0].isalnum()


# ------------------------------------------------------------------ real sqlite store


def test_finished_run_params_metrics_artifacts(sqlite_uri, tmp_path):
    png = tmp_path / "loss.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + b"0" * 16)
    tags = {"git_commit": "abc123", "config_hash": "deadbeef", "world_size": 1, "device_summary": "cpu"}
    tr = Tracker.start(
        tracking_uri=sqlite_uri,
        experiment="observe-tests",
        run_name="finished",
        params=CONFIG,
        tags=tags,
        spool_dir=tmp_path / "spool",
    )
    # 40 steps x 40 metrics, flushed every 10 steps -> 1600 metrics per flush: more than one log_batch.
    for step in range(40):
        metrics = {f"stage/padder/{i % 3}/q{i}": float(i + step) for i in range(38)}
        metrics.update({"loss": 10.0 - step * 0.1, "train/accuracy": step / 40})
        tr.log_metrics(metrics, step=step)
        if step % 10 == 9:
            tr.flush()
    (tmp_path / "resolved.yaml").write_text("run:\n  seed: 7\n")
    tr.log_artifact(tmp_path / "resolved.yaml", "config")
    tr.log_artifact(png, "plots")
    tr.end("FINISHED")
    assert tr.spool_path is None, "nothing should be spooled against a healthy store"

    c = client_for(sqlite_uri)
    run = c.get_run(tr.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "finished"
    assert c.get_experiment(run.info.experiment_id).name == "observe-tests"
    assert run.data.params == flatten_params(CONFIG)
    assert run.data.params["stages.1.replicas"] == "3"
    for k, v in tags.items():
        assert run.data.tags[k] == str(v)
    loss = c.get_metric_history(tr.run_id, "loss")
    assert [m.step for m in sorted(loss, key=lambda m: m.step)] == list(range(40))
    assert {m.step: m.value for m in loss}[39] == pytest.approx(6.1)
    q = c.get_metric_history(tr.run_id, "stage/padder/2/q5")
    assert sorted(m.step for m in q) == list(range(40))
    assert any(k.startswith("system/") for k in run.data.metrics), "psutil system metrics expected"
    top = {a.path for a in c.list_artifacts(tr.run_id)}
    assert {"config", "plots"} <= top
    assert [a.path for a in c.list_artifacts(tr.run_id, "config")] == ["config/resolved.yaml"]
    assert (
        Path(c.download_artifacts(tr.run_id, "plots/loss.png", str(tmp_path / "dl"))).read_bytes()
        == png.read_bytes()
    )


def test_failed_run(sqlite_uri, tmp_path):
    tr = Tracker.start(
        tracking_uri=sqlite_uri,
        experiment="observe-tests",
        run_name="failed",
        spool_dir=tmp_path,
        system_metrics=False,
    )
    tr.log_metrics({"loss": 1.0}, step=0)
    tr.end("FAILED")
    run = client_for(sqlite_uri).get_run(tr.run_id)
    assert run.info.status == "FAILED"
    assert [m.step for m in client_for(sqlite_uri).get_metric_history(tr.run_id, "loss")] == [0]


@pytest.mark.slow
def test_interrupted_process_is_killed(sqlite_uri, tmp_path):
    """A real child process gets SIGINT mid-run; the run ends KILLED with the metrics it logged."""
    script = textwrap.dedent(f"""
        import sys, time
        from dflash_flow.observe.tracking import Tracker
        tr = Tracker.start(tracking_uri={sqlite_uri!r}, experiment="observe-tests", run_name="interrupted",
                           spool_dir={str(tmp_path)!r}, system_metrics=False)
        print("READY", tr.run_id, flush=True)
        step = 0
        try:
            while True:
                tr.log_metrics({{"loss": 1.0 / (step + 1)}}, step=step)
                if step % 5 == 4:
                    tr.flush()
                step += 1
                time.sleep(0.01)
        except KeyboardInterrupt:
            tr.end("KILLED")
            raise
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("READY") and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert line.startswith("READY"), proc.stderr.read() if proc.poll() is not None else "no READY line"
        run_id = line.split()[1]
        time.sleep(1.0)  # let it log some steps
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode != 0  # KeyboardInterrupt propagated after the tracker closed the run
    c = client_for(sqlite_uri)
    assert c.get_run(run_id).info.status == "KILLED"
    steps = sorted(m.step for m in c.get_metric_history(run_id, "loss"))
    assert len(steps) >= 5 and steps == list(range(len(steps)))


def test_resume_continues_the_same_run(sqlite_uri, tmp_path):
    first = Tracker.start(
        tracking_uri=sqlite_uri,
        experiment="observe-tests",
        run_name="resumable",
        params={"lr": 1},
        spool_dir=tmp_path,
        system_metrics=False,
    )
    for s in range(5):
        first.log_metrics({"loss": float(s)}, step=s)
    first.end("KILLED")
    c = client_for(sqlite_uri)
    assert c.get_run(first.run_id).info.status == "KILLED"
    second = Tracker.start(
        tracking_uri=sqlite_uri,
        experiment="observe-tests",
        resume_run_id=first.run_id,
        params={"lr": 1},
        spool_dir=tmp_path,
        system_metrics=False,
    )
    assert second.run_id == first.run_id
    assert c.get_run(first.run_id).info.status == "RUNNING"
    for s in range(5, 9):
        second.log_metrics({"loss": float(s)}, step=s)
    second.end("FINISHED")
    assert c.get_run(first.run_id).info.status == "FINISHED"
    assert sorted(m.step for m in c.get_metric_history(first.run_id, "loss")) == list(range(9))


def test_a_resume_with_a_changed_setting_keeps_every_param_and_tags_the_change(sqlite_uri, tmp_path, caplog):
    """A resume may change a setting that cannot change the result (the Monitor's interval): MLflow refuses
    to change a param, which used to drop the whole batch with a warning; now the new keys are logged and
    the changed value is a tag ``resumed_with/<param>``."""
    params = {"stages": {"monitor": {"interval_s": 5}, "drafter": {"lr": 0.001}}}
    first = Tracker.start(tracking_uri=sqlite_uri, experiment="observe-tests", params=params, spool_dir=tmp_path,
                          system_metrics=False)
    first.end("KILLED")
    changed = {"stages": {"monitor": {"interval_s": 30}, "drafter": {"lr": 0.001, "grad_accum": 1}}}
    second = Tracker.start(tracking_uri=sqlite_uri, experiment="observe-tests", resume_run_id=first.run_id,
                           params=changed, spool_dir=tmp_path, system_metrics=False)
    second.end("FINISHED")
    run = client_for(sqlite_uri).get_run(first.run_id)
    assert run.data.params == {"stages.monitor.interval_s": "5", "stages.drafter.lr": "0.001",
                               "stages.drafter.grad_accum": "1"}
    assert run.data.tags["resumed_with/stages.monitor.interval_s"] == "30"
    assert not [r for r in caplog.records if "rejected" in r.getMessage()]


def test_each_metric_step_reaches_the_store_once_across_a_resume(sqlite_uri, tmp_path):
    """A resumed run trains again the steps between its checkpoint and the kill: the store keeps the
    first copy of each (metric, step), as it keeps one of a second sample at one step (issue 23.6)."""
    first = Tracker.start(tracking_uri=sqlite_uri, experiment="observe-tests", spool_dir=tmp_path, system_metrics=False)
    for s in range(1, 7):
        first.log_metrics({"loss": float(s), "eval/tau": 2.0}, step=s)
        first.flush()
    first.log_metrics({"loss": 99.0}, step=6)  # a second sample at one step: not a second point
    first.end("KILLED")
    # Resumed from a checkpoint at step 4: steps 5 and 6 come again, then new ones.
    second = Tracker.start(tracking_uri=sqlite_uri, experiment="observe-tests", resume_run_id=first.run_id,
                           spool_dir=tmp_path, system_metrics=False)
    for s in range(5, 9):
        second.log_metrics({"loss": float(s) + 0.5, "eval/tau": 3.0}, step=s)
        second.log_metrics({"loss": float(s) + 0.25}, step=s)  # within one flush the last value wins
        second.flush()
    second.end("FINISHED")
    history = client_for(sqlite_uri).get_metric_history(first.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 9))
    assert {m.step: m.value for m in history}[6] == 6.0 and {m.step: m.value for m in history}[7] == 7.25
    assert sorted(m.step for m in client_for(sqlite_uri).get_metric_history(first.run_id, "eval/tau")) == list(range(1, 9))


def test_resume_unknown_run_raises(sqlite_uri, tmp_path):
    from mlflow.exceptions import MlflowException

    with pytest.raises(MlflowException):
        Tracker.start(
            tracking_uri=sqlite_uri,
            experiment="observe-tests",
            resume_run_id="0" * 32,
            spool_dir=tmp_path,
            system_metrics=False,
        )


def test_unreachable_store_spools_with_one_warning_then_import(sqlite_uri, tmp_path, caplog):
    """Nothing listens on the port: training goes on, one warning, and the spool file left behind
    imports into a real store as a complete run (params, metrics, artifact, status)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: connections to it are refused
    caplog.set_level(logging.INFO)
    spool = tmp_path / "spool"
    art = tmp_path / "note.txt"
    art.write_text("kept")
    t0 = time.monotonic()
    tr = Tracker.start(
        tracking_uri=f"http://127.0.0.1:{port}",
        experiment="observe-offline",
        run_name="offline",
        params={"a": {"b": 2}},
        tags={"world_size": 1},
        spool_dir=spool,
        system_metrics=False,
    )
    assert tr.run_id is None and tr.spooling
    for s in range(30):
        tr.log_metrics({"loss": 100.0 - s}, step=s)
        tr.flush()
    tr.log_artifact(art, "notes")
    art.write_text("changed after logging")  # the spool holds the file as it was when logged
    tr.end("FINISHED")
    assert time.monotonic() - t0 < 30, "an unreachable store must not stall the run"
    ours = [
        r for r in caplog.records if r.name == "dflash_flow.observe.tracking" and r.levelno >= logging.WARNING
    ]
    assert len(ours) == 2, [r.getMessage() for r in ours]  # outage + "still unreachable at the end"
    path = tr.spool_path
    assert path is not None and path.exists()
    ops = [o["op"] for o in read_spool(path)]
    assert ops[:2] == ["meta", "create_run"] and ops[-1] == "end" and ops.count("metrics") == 30

    result = CliRunner().invoke(app, ["import-spool", str(path), "--tracking-uri", sqlite_uri])
    assert result.exit_code == 0, result.output
    assert f"imported {path} into run" in result.output
    assert not path.exists() and not (path.parent / f"{path.stem}-artifacts").exists()
    c = client_for(sqlite_uri)
    exp = c.get_experiment_by_name("observe-offline")
    (run,) = c.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and run.info.run_name == "offline"
    assert run.data.params == {"a.b": "2"} and run.data.tags["world_size"] == "1"
    assert sorted(m.step for m in c.get_metric_history(run.info.run_id, "loss")) == list(range(30))
    got = c.download_artifacts(run.info.run_id, "notes/note.txt", str(tmp_path / "dl"))
    assert Path(got).read_text() == "kept"
    db_dir = Path(sqlite_uri[len("sqlite:///") :]).parent
    assert exp.artifact_location == (db_dir / "mlartifacts" / "observe-offline").as_uri()  # not ./mlruns
    with pytest.raises(SpoolError, match="no such spool file"):
        import_spool(path, sqlite_uri)  # already imported and removed


def test_default_uri_is_mlflow_sqlite_in_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tr = Tracker.start(experiment="defaults", system_metrics=False)
    tr.log_metrics({"loss": 1.0}, step=3)
    tr.end()
    assert tr.tracking_uri == f"sqlite:///{tmp_path}/mlflow.db"
    assert (tmp_path / "mlflow.db").exists()
    assert not (tmp_path / "mlflow-spool").exists()
    hist = client_for(tr.tracking_uri).get_metric_history(tr.run_id, "loss")
    assert [(m.step, m.value) for m in hist] == [(3, 1.0)]


def test_disabled_tracking_is_a_noop_and_imports_nothing(tmp_path):
    """In a fresh process: no mlflow import, no store, no spool, every call a no-op."""
    script = textwrap.dedent("""
        import os, sys
        from dflash_flow.observe.tracking import Tracker
        tr = Tracker.start(experiment="off", enabled=False, params={"a": 1}, tags={"t": 1})
        tr.log_metrics({"loss": 1.0}, step=0); tr.flush()
        tr.log_artifact("missing.png")
        tr.end("FINISHED")
        t2 = Tracker(enabled=False)
        t2.log_metrics({"x": 1}, step=1); t2.end()
        print("RESULT", tr.run_id, "mlflow" in sys.modules, "psutil" in sys.modules, sorted(os.listdir(".")))
    """)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "RESULT None False False []"


# ------------------------------------------------------------------ reliability: redaction, pre-flight, import


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connections to it are refused


def test_redact_uri():
    assert redact_uri("http://user:pass@host:5000/x") == "http://***@host:5000/x"
    assert redact_uri("https://tok3n@host/") == "https://***@host/"
    assert redact_uri("https://host/api?token=abc&sig=1") == "https://host/api?token=***&sig=***"
    assert redact_uri("postgresql://u:p@db/mlflow") == "postgresql://***@db/mlflow"
    for plain in ("sqlite:///tmp/a.db", "http://127.0.0.1:5000", "/tmp/mlflow.db", "databricks"):
        assert redact_uri(plain) == plain


def test_check_tracking_uri_names_the_unusable_path(tmp_path):
    assert check_tracking_uri(tmp_path / "new" / "deeper" / "mlflow.db") is None  # creatable, nothing created
    assert not (tmp_path / "new").exists()
    assert check_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db") is None
    assert check_tracking_uri("sqlite:///:memory:") is None
    assert check_tracking_uri("http://127.0.0.1:5000") is None
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    reason = check_tracking_uri(f"sqlite:///{blocker}/sub/mlflow.db")
    assert reason == f"cannot create tracking database {blocker}/sub/mlflow.db: {blocker} is not a directory"
    assert "is a directory" in check_tracking_uri(f"sqlite:///{tmp_path}")
    # /sys refuses new files even to root (os.access says yes there; the probe file does not lie).
    reason = check_tracking_uri("/sys/dflash-flow-test/mlflow.db")
    assert reason is not None and reason.startswith("cannot write /sys/dflash-flow-test/mlflow.db: /sys is not writable")
    assert check_tracking_uri("http://") == "tracking_uri http:// has no host"
    assert "port" in check_tracking_uri("http://user:pw@host:99999")
    assert "pw" not in check_tracking_uri("http://user:pw@host:99999")
    assert check_tracking_uri("") == "tracking_uri is empty"


def test_tracker_start_refuses_an_unusable_store_at_once(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(TrackingError, match="is not a directory"):
        Tracker.start(tracking_uri=f"sqlite:///{blocker}/mlflow.db", experiment="x", spool_dir=tmp_path / "spool")
    assert not (tmp_path / "spool").exists()


def test_credentials_never_reach_warnings_params_or_the_spool(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    uri = f"http://alice:s3cret@127.0.0.1:{closed_port()}/?token=t0ken"
    tr = Tracker.start(
        tracking_uri=uri,
        experiment="secrets",
        params={"tracking": {"tracking_uri": uri}},
        tags={"source": uri},
        spool_dir=tmp_path / "spool",
        system_metrics=False,
    )
    tr.log_metrics({"loss": 1.0}, step=0)
    tr.end("FINISHED")
    assert tr.display_uri.startswith("http://***@127.0.0.1:")
    text = tr.spool_path.read_text() + "\n".join(r.getMessage() for r in caplog.records)
    assert "s3cret" not in text and "t0ken" not in text
    assert "dflash-flow import-spool" in text and "python -m" not in text
    ops = read_spool(tr.spool_path)
    assert ops[0]["tracking_uri"] == redact_uri(uri)
    with pytest.raises(SpoolError, match="had credentials, which spools do not keep; pass --tracking-uri"):
        import_spool(tr.spool_path)


def _offline_spool(tmp_path, **start) -> Path:
    """A real spool: a tracker whose store refuses connections (optionally resuming a run)."""
    tr = Tracker.start(
        tracking_uri=f"http://127.0.0.1:{closed_port()}",
        experiment="observe-import",
        spool_dir=tmp_path / "spool",
        system_metrics=False,
        **start,
    )
    tr.log_metrics({"loss": 1.0}, step=1)
    tr.flush()
    return tr, tr.spool_path


def test_import_spool_after_the_database_was_deleted_is_one_line(sqlite_uri, tmp_path):
    first = Tracker.start(tracking_uri=sqlite_uri, experiment="observe-import", spool_dir=tmp_path, system_metrics=False)
    first.end("KILLED")
    tr, spool = _offline_spool(tmp_path, resume_run_id=first.run_id)  # the resumed run went offline
    tr.end("FINISHED")
    gone = tmp_path / "deleted" / "mlflow.db"  # the database the run lived in, deleted since
    result = CliRunner().invoke(app, ["import-spool", str(spool), "--tracking-uri", f"sqlite:///{gone}"])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith(f"error: {spool}: tracking database {gone} does not exist (deleted?)")
    assert first.run_id in lines[0] and not gone.exists()
    # Another database, where the run never was: still one line, naming the run.
    other = tmp_path / "other.db"
    client_for(f"sqlite:///{other}").search_experiments()  # creates the (empty) store
    result = CliRunner().invoke(app, ["import-spool", str(spool), "--tracking-uri", f"sqlite:///{other}"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert f"run {first.run_id} does not exist" in result.output
    assert spool.exists(), "a failed import keeps the spool"


def test_import_spool_uploads_only_files_inside_its_stash(sqlite_uri, tmp_path):
    tr, spool = _offline_spool(tmp_path, run_name="hostile")
    secret = tmp_path / "secret.txt"
    secret.write_text("private")
    tr.log_artifact(secret, "notes")  # stashed: a copy inside the spool's artifact directory
    tr.end("FINISHED")
    ops = read_spool(spool)
    stashed = next(o for o in ops if o["op"] == "artifact")
    assert stashed["stashed"] and not Path(stashed["path"]).is_absolute()  # relative to the stash

    def with_artifact(name: str, path: str) -> Path:
        """A copy of the spool whose only artifact record names ``path``."""
        hostile = tmp_path / f"{name}.jsonl"
        others = [o for o in ops if o["op"] != "artifact"]
        lines = [json.dumps(o) for o in others[:-1]] + [json.dumps({"op": "artifact", "path": path, "artifact_path": "x"})]
        hostile.write_text("\n".join(lines + [json.dumps(others[-1])]) + "\n")
        return hostile

    client = client_for(sqlite_uri)
    before = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    hostile = with_artifact("outside", str(secret))
    result = CliRunner().invoke(app, ["import-spool", str(hostile), "--tracking-uri", sqlite_uri])
    assert result.exit_code == 2 and f"refusing to upload {secret}" in result.output
    assert len(result.output.strip().splitlines()) == 1
    # A symlink inside the stash that points out of it is not followed.
    stash = tmp_path / "linked-artifacts"
    (stash / "9").mkdir(parents=True)
    (stash / "9" / "link.txt").symlink_to(secret)
    with pytest.raises(SpoolError, match="refusing to upload 9/link.txt"):
        import_spool(with_artifact("linked", "9/link.txt"), sqlite_uri)
    # Nor one inside a directory artifact.
    (stash / "8" / "sub").mkdir(parents=True)
    (stash / "8" / "sub" / "inner").symlink_to(tmp_path)
    with pytest.raises(SpoolError, match="inner: it links outside the spool's artifact directory"):
        import_spool(with_artifact("linked", "8"), sqlite_uri)
    with pytest.raises(SpoolError, match="refusing to upload ../secret.txt"):
        import_spool(with_artifact("linked", "../secret.txt"), sqlite_uri)
    after = len(client.search_runs([e.experiment_id for e in client.search_experiments()]))
    assert after == before, "a refused spool sends nothing"
    # The genuine spool imports, with its stashed copy.
    run_id = import_spool(spool, sqlite_uri)
    got = client.download_artifacts(run_id, "notes/secret.txt", str(tmp_path / "dl"))
    assert Path(got).read_text() == "private"


def test_import_failing_midway_keeps_the_rest_and_the_run(sqlite_uri, tmp_path):
    tr, spool = _offline_spool(tmp_path, run_name="midway", params={"a": 1})
    tr._submit([{"op": "params", "params": {"a": "2"}}])  # MLflow refuses to change a param: the import stops there
    tr.log_metrics({"loss": 0.5}, step=2)
    tr.end("FINISHED")
    with pytest.raises(SpoolError, match="failed at the params op"):
        import_spool(spool, sqlite_uri)
    kept = read_spool(spool)
    assert [o["op"] for o in kept][:3] == ["meta", "run", "params"] and kept[2]["params"] == {"a": "2"}
    c = client_for(sqlite_uri)
    run = c.get_run(kept[1]["run_id"])
    assert run.data.params == {"a": "1"} and run.info.run_name == "midway"


def test_import_into_a_server_that_is_down_is_one_line_without_credentials(tmp_path):
    tr, spool = _offline_spool(tmp_path, run_name="down")
    tr.end("FINISHED")
    uri = f"http://bob:hunter22@127.0.0.1:{closed_port()}/?token=t0ken"
    result = CliRunner().invoke(app, ["import-spool", str(spool), "--tracking-uri", uri])
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith(f"error: {spool}: importing into http://***@127.0.0.1:") and "create_run op" in line
    assert "hunter22" not in line and "t0ken" not in line
    assert spool.exists()


def test_ctrl_c_waits_for_the_store_write_in_progress():
    """Ctrl-C inside a store write is held until the write is done (a KeyboardInterrupt inside a sqlite
    transaction left the database locked and the run RUNNING), then raised."""
    from dflash_flow.core.stopping import controller

    done = []
    with pytest.raises(KeyboardInterrupt):
        with controller().hold():  # what every store write of the tracker is wrapped in (observe.spool)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)  # the handler has run by now: a plain KeyboardInterrupt would have come here
            done.append("write finished")
    assert done == ["write finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
