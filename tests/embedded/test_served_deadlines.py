"""Hostile servers against `regenerate --server` (issue 40.1, 40.3, 40.16): a request has a deadline (a server
trickling bytes is cut off there), a reply has a size bound derived from max_tokens (an endless chunked body,
a 50 MB reply to a few tokens), a redirect is said to be one, a bad port names --server, and the servers' API
key comes from an environment variable (or the URL's credentials), never shown. Every server here is a real
process on 127.0.0.1 (tests/embedded/hostile_server.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_flow.embedded.served import regenerate_served
from dflash_flow.engine.http import ServerPool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FAST = dict(backoff_s=0.01, backoff_max_s=0.05, cooldown_s=0.05)


class Hostile:
    def __init__(self, tmp: Path, name: str, behaviour: str):
        port_file = tmp / f"{name}.port"
        self.log = tmp / f"{name}.log"
        self.proc = subprocess.Popen([sys.executable, str(HERE / "hostile_server.py"), "--port-file", str(port_file),
                                      "--behaviour", behaviour, "--log", str(self.log)])
        deadline = time.monotonic() + 60  # a bound on start-up, not a measured duration
        while not port_file.exists():
            assert self.proc.poll() is None, "hostile server died at start-up"
            assert time.monotonic() < deadline, "hostile server did not start"
            time.sleep(0.02)
        self.port = int(port_file.read_text())
        self.url = f"http://127.0.0.1:{self.port}"

    def authorizations(self) -> list:
        return [json.loads(x)["authorization"] for x in self.log.read_text().splitlines()] if self.log.exists() else []


@pytest.fixture
def hostile(tmp_path):
    started: list[Hostile] = []

    def start(behaviour: str) -> Hostile:
        s = Hostile(tmp_path, f"h{len(started)}", behaviour)
        started.append(s)
        return s

    yield start
    for s in started:
        s.proc.kill()
        s.proc.wait(timeout=60)


def _prompts(path: Path, n: int) -> None:
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))


def _rows(out: Path) -> dict:
    return {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}


@pytest.mark.timeout(120)  # without a deadline the request never ends: the test fails here instead of hanging
@pytest.mark.parametrize("behaviour", ["trickle-headers", "trickle-body"])
def test_a_server_trickling_its_answer_is_cut_off_at_the_requests_deadline(tmp_path, hostile, behaviour):
    """Every read gets a byte well within the timeout, so a per-read timeout never fires; the request's
    deadline does: each row is an error row naming the server, and the call returns."""
    slow = hostile(behaviour)
    _prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "out.jsonl"
    stats = regenerate_served(tmp_path / "p.jsonl", [slow.url], out, timeout_s=1.0, max_attempts=2, concurrency=2,
                              **FAST)
    rows = _rows(out)
    assert stats.reasons["error"] == 2 and stats.failures["timeout"] >= 2, stats
    for r in rows.values():
        assert r["finish_reason"] == "error"
        assert "no complete answer within 1 s" in r["error"] and slow.url in r["error"], r["error"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("behaviour", ["endless-chunked", "huge"])
def test_a_reply_larger_than_max_tokens_can_be_is_malformed_naming_the_server(tmp_path, hostile, behaviour):
    """max_new_tokens 16 bounds a reply to about a MiB: an endless chunked body is cut off there (not read
    until memory runs out), and a 50 MB reply claiming 3 tokens is no reply (not written as one)."""
    big = hostile(behaviour)
    _prompts(tmp_path / "p.jsonl", 2)
    out = tmp_path / "out.jsonl"
    stats = regenerate_served(tmp_path / "p.jsonl", [big.url], out, max_new_tokens=16, timeout_s=60, max_attempts=2,
                              **FAST)
    assert stats.reasons == {"error": 2} and stats.failures["malformed"] == 4, stats
    for r in _rows(out).values():
        assert "with a body over 1.0 MiB" in r["error"] and big.url in r["error"], r["error"]
        assert len(json.dumps(r)) < 10_000


def test_a_redirect_is_said_to_be_one_and_not_retried(tmp_path, hostile):
    moved = hostile("redirect")
    _prompts(tmp_path / "p.jsonl", 1)
    out = tmp_path / "out.jsonl"
    stats = regenerate_served(tmp_path / "p.jsonl", [moved.url], out, max_attempts=3, **FAST)
    (row,) = _rows(out).values()
    assert "HTTP 307: redirect to http://127.0.0.1:9/v1/chat/completions not followed" in row["error"], row["error"]
    assert "not JSON" not in row["error"] and stats.failures == {"client": 1}  # the request's fault: once


def test_a_bad_port_names_the_option_and_hides_the_password():
    for url in ("http://127.0.0.1:99999", "http://alice:PASSWORD@127.0.0.1:99999", "http://127.0.0.1:x"):
        with pytest.raises(ValueError) as err:
            ServerPool([url])
        msg = str(err.value)
        assert msg.startswith("--server http://") and "bad port" in msg and "PASSWORD" not in msg, msg
    with pytest.raises(ValueError, match="'regenerate.servers' http://127.0.0.1:99999: bad port"):
        ServerPool(["http://127.0.0.1:99999"], option="'regenerate.servers'")


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "dflash_flow", "regenerate", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)


def test_cli_a_bad_port_is_one_line_naming_server(tmp_path):
    _prompts(tmp_path / "p.jsonl", 1)
    res = _cli(tmp_path / "p.jsonl", "--server", "http://alice:PASSWORD@127.0.0.1:99999", "--out", tmp_path / "o.jsonl")
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("\n") == 1 and "--server http://***@127.0.0.1:99999: bad port" in res.stderr, res.stderr
    assert "PASSWORD" not in res.stderr + res.stdout


def test_cli_the_api_key_comes_from_the_environment_and_is_never_written(tmp_path, hostile):
    """A server that wants a key answers 401 without it; --api-key-env names the variable (and $OPENAI_API_KEY
    is read by default); credentials in the URL are sent as Basic authentication. The key is in no output."""
    key = "sk-SECRETKEY123"
    locked = hostile(f"auth:{key}")
    _prompts(tmp_path / "p.jsonl", 2)
    base = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    res = _cli(tmp_path / "p.jsonl", "--server", locked.url, "--out", tmp_path / "none.jsonl", "--max-attempts", "1",
               env=base)
    assert res.returncode == 0 and "error 2" in res.stdout and "HTTP 401" in res.stderr, res.stdout + res.stderr
    for name, args, env in [("named", ["--api-key-env", "MY_KEY"], {**base, "MY_KEY": key}),
                            ("default", [], {**base, "OPENAI_API_KEY": key})]:
        out = tmp_path / f"{name}.jsonl"
        res = _cli(tmp_path / "p.jsonl", "--server", locked.url, "--out", out, *args, env=env)
        assert res.returncode == 0 and "stop 2" in res.stdout, res.stdout + res.stderr
        assert key not in out.read_text() + res.stdout + res.stderr
    assert locked.authorizations()[-1] == f"Bearer {key}"
    # the URL's credentials, as Basic authentication; the password shown nowhere
    out = tmp_path / "basic.jsonl"
    url = f"http://user:{key}@127.0.0.1:{locked.port}"
    res = _cli(tmp_path / "p.jsonl", "--server", url, "--out", out, env=base)
    assert res.returncode == 0 and "stop 2" in res.stdout, res.stdout + res.stderr
    assert key not in out.read_text() + res.stdout + res.stderr and "http://***@127.0.0.1" in res.stdout
    assert locked.authorizations()[-1].startswith("Basic ")
    # a named variable that is unset: one line, before any request
    res = _cli(tmp_path / "p.jsonl", "--server", locked.url, "--out", tmp_path / "x.jsonl", "--api-key-env", "NOPE_KEY",
               env=base)
    assert res.returncode == 2 and "$NOPE_KEY is not set" in res.stderr and res.stderr.count("\n") == 1, res.stderr


def _source_graph(tmp_path: Path, target_dir, regen: dict, **runtime):
    from dflash_flow.core import Graph, RuntimeOptions
    from dflash_flow.stages.sources import ChatSource

    g = Graph(name="regen", seed=1, runtime=RuntimeOptions(**runtime))
    g.sections["model"] = {"tokenizer": str(target_dir)}
    g.add("src", ChatSource(paths=[str(tmp_path / "p.jsonl")], cache_dir=str(tmp_path / "cache"), regenerate=regen,
                            template_kwargs={"enable_thinking": False}))
    return g


@pytest.mark.timeout(180)
def test_in_a_pipeline_the_watchdog_names_the_server_a_stall_waits_on(tmp_path, hostile, target_dir):
    """A source regenerating through a server that trickles (a long timeout_s): the watchdog fires and names
    that server and how long its request has been in flight, not only "src[0] in setup"."""
    from dflash_flow.app import model_services
    from dflash_flow.core import Pipeline
    from dflash_flow.core.errors import PipelineStalled

    slow = hostile("trickle-body")
    _prompts(tmp_path / "p.jsonl", 1)
    regen = {"servers": [slow.url], "out_dir": str(tmp_path / "regen"), "timeout_s": 600, "max_attempts": 1}
    g = _source_graph(tmp_path, target_dir, regen, stall_timeout_s=2.0, watchdog_interval_s=0.2)
    pipe = Pipeline(g, collect=["src"], check_devices=False, output_dir=tmp_path / "run", services=model_services(g))
    with pytest.raises(PipelineStalled) as err:
        list(pipe.iterate("src"))
    msg = str(err.value)
    assert "stalled stage: src[0] (in setup for" in msg and f"waiting on {slow.url} (1 request in flight" in msg, msg


def test_a_pipelines_api_key_is_named_by_its_variable_and_checked(tmp_path, hostile, target_dir, monkeypatch):
    """regenerate.api_key_env names the variable (a value that is no variable name -- a key pasted there -- is
    refused without being repeated); validate says when it is unset; set, the key reaches the server."""
    from dflash_flow.app import model_services
    from dflash_flow.core import Pipeline
    from dflash_flow.core.validate import validate
    from dflash_flow.stages.sources import ChatSource

    key = "sk-PIPELINEKEY42"
    locked = hostile(f"auth:{key}")
    _prompts(tmp_path / "p.jsonl", 2)
    regen = {"servers": [locked.url], "out_dir": str(tmp_path / "regen"), "api_key_env": "REGEN_TEST_KEY",
             "max_attempts": 1}
    with pytest.raises(ValueError, match="never the key itself") as err:
        ChatSource(paths=[str(tmp_path / "p.jsonl")], regenerate={**regen, "api_key_env": key})
    assert key not in str(err.value)
    monkeypatch.delenv("REGEN_TEST_KEY", raising=False)
    problems = [str(p) for p in validate(_source_graph(tmp_path, target_dir, regen), check_devices=False)]
    assert any("$REGEN_TEST_KEY is not set" in p for p in problems), problems
    monkeypatch.setenv("REGEN_TEST_KEY", key)
    g = _source_graph(tmp_path, target_dir, regen)
    assert not [p for p in validate(g, check_devices=False) if "REGEN_TEST_KEY" in str(p)]
    pipe = Pipeline(g, collect=["src"], check_devices=False, output_dir=tmp_path / "run", services=model_services(g))
    [table] = list(pipe.iterate("src"))
    assert len(table) == 2 and locked.authorizations() == [f"Bearer {key}"] * 2
    assert key not in (tmp_path / "regen" / "p.jsonl").read_text()
