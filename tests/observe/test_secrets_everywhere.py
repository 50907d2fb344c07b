"""A password planted in the settings (a regeneration server's URL, the tracking URI) reaches no file, artifact,
param, tag or console line (issue 40.2): one redaction (``core.redact``) wherever a setting is written or
printed, strings inside lists and dicts too."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_flow.observe.spool import read_spool
from dflash_flow.observe.tracking import Tracker

TESTS = Path(__file__).resolve().parents[1]
for p in (TESTS / "reliability",):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

SERVER_PW = "SrvPassw0rd9"
TRACK_PW = "TrkPassw0rd7"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_spool_holds_no_credential_in_lists_dicts_or_text(tmp_path):
    """A store that refuses connections: everything is spooled. Params with the password inside a list and a
    dict, a tag: none of it reaches the spool unredacted."""
    uri = f"http://bob:{TRACK_PW}@127.0.0.1:{_closed_port()}"
    server = f"http://alice:{SERVER_PW}@127.0.0.1:8000"
    tr = Tracker.start(tracking_uri=uri, experiment="secrets", system_metrics=False, spool_dir=tmp_path / "spool",
                       params={"stages": {"source": {"regenerate": {"servers": [server], "extra": {"url": server}}}},
                               "servers_plain": [server, "x"]},
                       tags={"where": [server]})
    tr.log_metrics({"loss": 1.0}, step=0)
    tr.end("FINISHED")
    files = [p for p in (tmp_path / "spool").rglob("*") if p.is_file()]
    assert tr.spool_path in files
    for f in files:
        data = f.read_bytes()
        assert SERVER_PW.encode() not in data and TRACK_PW.encode() not in data, f
    params = {k: v for op in read_spool(tr.spool_path) if op["op"] == "params" for k, v in op["params"].items()}
    assert json.loads(params["servers_plain"]) == ["http://***@127.0.0.1:8000", "x"]
    assert json.loads(params["stages.source.regenerate.servers"]) == ["http://***@127.0.0.1:8000"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_real_run_writes_and_prints_no_planted_password(tmp_path, mlflow_servers):
    """A real short run (ChatSource regenerating through a real server process whose URL carries a password,
    checkpoints every step) tracked by a real `mlflow server` behind a URL with a password: every file the run
    and the server wrote (outputs, checkpoints' state.json, the regenerated files, the tracking database with
    its params and tags, the artifacts), and the console, are grepped for both passwords."""
    from mlflow import MlflowClient
    from reltools import cli_env, train_pipeline, write_yaml

    port = mlflow_servers.free_port()
    mlflow_servers.start(f"sqlite:///{tmp_path / 'server.db'}", port, timeout_s=300)  # a bound: a busy box is slow
    fake_dir = tmp_path / "fake"
    fake_dir.mkdir()
    fake = subprocess.Popen([sys.executable, str(TESTS / "embedded" / "fake_openai_server.py"), "--port-file",
                             str(fake_dir / "port"), "--log", str(fake_dir / "log")])
    try:
        deadline = time.monotonic() + 60  # a bound on start-up, not a measured duration
        while not (fake_dir / "port").exists():
            assert fake.poll() is None and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.05)
        server = f"http://alice:{SERVER_PW}@127.0.0.1:{(fake_dir / 'port').read_text()}"
        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": i, "prompt": f"What is {i} plus {i}?"}) + "\n"
                                   for i in range(12)))
        doc = train_pipeline(tmp_path, data=prompts, output_dir=tmp_path / "run", every_steps=1, epochs=1,
                             model={"target": "embedded"})
        doc["model"].pop("mask_token_id", None)
        doc["stages"][0] = {"name": "source", "type": "ChatSource", "config": {
            "paths": [str(prompts)], "max_length": 64, "cache_dir": None,
            "regenerate": {"servers": [server], "out_dir": str(tmp_path / "regen"), "max_new_tokens": 16}}}
        doc["tracking"]["tracking_uri"] = f"http://bob:{TRACK_PW}@127.0.0.1:{port}"
        yaml_path = write_yaml(tmp_path / "p.yaml", doc)
        res = subprocess.run([sys.executable, "-m", "dflash_flow.cli", "run", str(yaml_path)], cwd=tmp_path,
                             env=cli_env(), capture_output=True, text=True, timeout=600)
    finally:
        fake.kill()
        fake.wait(timeout=60)
    assert res.returncode == 0, res.stderr[-4000:]
    console = res.stdout + res.stderr
    assert SERVER_PW not in console and TRACK_PW not in console, console[-4000:]
    assert "mlflow run:" in console and f"http://***@127.0.0.1:{port}" in console
    assert list((tmp_path / "run" / "checkpoints").rglob("state.json"))
    hits = [str(p) for p in tmp_path.rglob("*") if p.is_file() and p != yaml_path
            and (SERVER_PW.encode() in p.read_bytes() or TRACK_PW.encode() in p.read_bytes())]
    assert not hits, hits
    # what the grep covered is there: the params, tags and artifacts of the run, redacted
    client = MlflowClient(f"http://127.0.0.1:{port}")
    (run,) = client.search_runs([client.get_experiment_by_name("reliability").experiment_id])
    assert json.loads(run.data.params["stages.source.regenerate.servers"]) == [redacted := server.replace(
        f"alice:{SERVER_PW}", "***")]
    assert run.data.params["tracking.tracking_uri"] == f"http://***@127.0.0.1:{port}"
    for value in list(run.data.params.values()) + list(run.data.tags.values()):
        assert SERVER_PW not in value and TRACK_PW not in value
    resolved = Path(client.download_artifacts(run.info.run_id, "config/pipeline.resolved.yaml", str(tmp_path / "dl")))
    assert redacted in resolved.read_text()
