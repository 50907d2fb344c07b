"""Issue 23.11: runs that start at once on one fresh sqlite store all work (a sweep launched from one
directory): the store's tables are created under a file lock, never by two processes together."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

WORKER = textwrap.dedent(
    """\
    import sys, time
    from pathlib import Path
    from dflash_flow.observe.tracking import Tracker
    go = Path(sys.argv[2])
    while not go.exists():
        time.sleep(0.002)
    t = Tracker.start(tracking_uri=sys.argv[1], experiment="sweep", run_name=sys.argv[3], system_metrics=False,
                      spool_dir=sys.argv[4], params={"i": sys.argv[3]})
    t.log_metrics({"x": 1.0}, step=1)
    t.end("FINISHED")
    print(t.run_id)
    """
)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_runs_starting_together_on_a_fresh_sqlite_store_all_succeed(tmp_path):
    from mlflow import MlflowClient

    db = tmp_path / "mlflow.db"
    go = tmp_path / "go"
    n = 3
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(db), str(go), f"run{i}", str(tmp_path / f"spool{i}")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(n)]
    time.sleep(4.0)  # every process has imported mlflow and waits at the barrier
    go.touch()
    results = [p.communicate(timeout=180) for p in procs]
    for p, (_out, err) in zip(procs, results, strict=True):
        assert p.returncode == 0, err[-3000:]
        assert "Traceback" not in err, err[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    exp = client.get_experiment_by_name("sweep")
    runs = client.search_runs([exp.experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"run{i}" for i in range(n)]
    assert {r.info.status for r in runs} == {"FINISHED"}
    assert all(r.data.metrics.get("x") == 1.0 for r in runs)
