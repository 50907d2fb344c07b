"""A real `mlflow server` is SIGKILLed mid-run and brought back: training never stops, no metric is lost
or duplicated, and the tracker warns exactly once."""

from __future__ import annotations

import logging
import time

import pytest

from dflash_flow.observe.tracking import Tracker

pytestmark = pytest.mark.slow


def test_server_killed_mid_run_and_restarted_loses_nothing(tmp_path, caplog, mlflow_servers):
    from mlflow import MlflowClient

    caplog.set_level(logging.INFO)
    db_uri = f"sqlite:///{tmp_path / 'server.db'}"
    port = mlflow_servers.free_port()
    uri = f"http://127.0.0.1:{port}"
    server = mlflow_servers.start(db_uri, port)
    # servers are killed by the fixture teardown, whatever happens here
    tr = Tracker.start(
        tracking_uri=uri,
        experiment="server-outage",
        run_name="outage",
        params={"train": {"lr": 1e-3, "steps": 60}},
        tags={"world_size": 1},
        spool_dir=tmp_path / "spool",
        retry_initial_s=0.2,
        retry_max_s=1.0,
    )
    run_id = tr.run_id
    assert run_id

    step = 0

    def train_steps(n):
        nonlocal step
        worst = 0.0
        for _ in range(n):
            tr.log_metrics({"loss": 1.0 / (step + 1), "tokens_per_s": 1000.0 + step}, step=step)
            t0 = time.monotonic()
            tr.flush()  # the Monitor's once-per-sample flush
            worst = max(worst, time.monotonic() - t0)
            step += 1
        return worst

    train_steps(15)
    assert not tr.spooling

    mlflow_servers.kill(server)
    worst_down = train_steps(20)
    (tmp_path / "outage.txt").write_text("written while the server was down")
    tr.log_artifact(tmp_path / "outage.txt", "notes")
    assert tr.spooling, "metrics logged while the server is dead must be spooled"
    assert tr.spool_path is not None and tr.spool_path.exists()
    # Flushing against a dead server must not stall training (connection refused, 0 retries).
    assert worst_down < 3.0, f"a flush blocked {worst_down:.1f}s while the server was down"

    server = mlflow_servers.start(db_uri, port)
    train_steps(10)
    deadline = time.monotonic() + 30
    while tr.spooling and time.monotonic() < deadline:
        time.sleep(0.2)
        tr.flush()
    assert not tr.spooling, "the spool was not replayed after the server came back"
    assert not tr.spool_path.exists(), "a fully replayed spool file should be removed"
    assert list(tr.spool_path.parent.iterdir()) == [], "stashed artifact copies should be cleaned up"
    train_steps(5)
    tr.end("FINISHED")

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"train.lr": "0.001", "train.steps": "60"}
    for key in ("loss", "tokens_per_s"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        assert sorted(steps) == list(range(50)), f"{key}: steps lost or duplicated: {sorted(steps)}"
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "loss")}
    assert loss[20] == pytest.approx(1.0 / 21)
    assert [a.path for a in client.list_artifacts(run_id, "notes")] == ["notes/outage.txt"]

    ours = [
        r for r in caplog.records if r.name == "dflash_flow.observe.tracking" and r.levelno >= logging.WARNING
    ]
    assert len(ours) == 1, [r.getMessage() for r in ours]
    assert "unreachable" in ours[0].getMessage()
    retries = [r for r in caplog.records if r.name.startswith("urllib3") and r.levelno >= logging.WARNING]
    assert retries == [], "urllib3 retry warnings would spam the console once per step"
