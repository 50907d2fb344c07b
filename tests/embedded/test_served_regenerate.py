"""Regeneration through OpenAI-compatible servers (issue 24.3), against real local server processes
(tests/embedded/fake_openai_server.py): 500s, hangs, malformed JSON, servers killed mid-run, a client
killed mid-run and resumed. Every row is written exactly once with the right finish reason."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from dflash_flow.embedded.regen_io import journal_path
from dflash_flow.embedded.served import (
    AllServersDown,
    backoff_delay,
    parse_reply,
    regenerate_served,
    sampling_params,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FAST = dict(backoff_s=0.01, backoff_max_s=0.05, cooldown_s=60.0)  # a server taken out stays out in a test


class FakeServer:
    def __init__(self, tmp: Path, name: str, behaviour: str = "ok", model: str = "fake-target",
                 answer_model: str | None = None):
        self.log = tmp / f"{name}.log"
        port_file = tmp / f"{name}.port"
        self.proc = subprocess.Popen([sys.executable, str(HERE / "fake_openai_server.py"), "--port-file",
                                      str(port_file), "--log", str(self.log), "--model", model, "--behaviour",
                                      behaviour, *(["--answer-model", answer_model] if answer_model else [])])
        deadline = time.monotonic() + 60  # a bound on start-up, not a measured duration
        while not port_file.exists():
            assert self.proc.poll() is None, "fake server died at start-up"
            assert time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def requests(self) -> list[dict]:
        """Every chat request received, in order of arrival."""
        if not self.log.exists():
            return []
        return [r for r in map(json.loads, self.log.read_text().splitlines()) if "sent" not in r]

    def answered(self) -> list[dict]:
        """Every answer sent (complete), in order."""
        return [r for r in map(json.loads, self.log.read_text().splitlines()) if "sent" in r]

    def users(self) -> Counter:
        return Counter(r["user"] for r in self.requests())

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=60)


@pytest.fixture
def servers(tmp_path):
    started: list[FakeServer] = []

    def start(behaviour: str = "ok", **kw) -> FakeServer:
        s = FakeServer(tmp_path, f"s{len(started)}", behaviour, **kw)
        started.append(s)
        return s

    yield start
    for s in started:
        s.kill()


def _prompts(path: Path, n: int, special: dict[int, str] | None = None) -> list[str]:
    special = special or {}
    users = [f"question {i} {special.get(i, '')}".strip() for i in range(n)]
    with open(path, "w") as f:
        for i, u in enumerate(users):
            f.write(json.dumps({"id": f"p{i}", "conversations": [{"role": "user", "content": u},
                                                                  {"role": "assistant", "content": "old"}]}) + "\n")
    return users


def _rows(out: Path) -> dict:
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    ids = [r["id"] for r in recs]
    assert len(ids) == len(set(ids)), f"an id written twice: {Counter(ids).most_common(3)}"
    return {r["id"]: r for r in recs}


def test_every_row_written_once_with_its_finish_reason(tmp_path, servers):
    a, b = servers(), servers()
    users = _prompts(tmp_path / "p.jsonl", 24, {3: "[EMPTY]", 5: "[LONG]", 7: "[POISON]", 9: "[BAD]", 11: "[THINK]"})
    out = tmp_path / "out.jsonl"
    stats = regenerate_served(tmp_path / "p.jsonl", [a.url, b.url], out, max_new_tokens=64, concurrency=3,
                              max_attempts=3, timeout_s=30, **FAST)
    rows = _rows(out)
    assert set(rows) == {f"p{i}" for i in range(24)}
    assert stats.reasons == Counter(stop=20, length=1, empty=1, error=2)
    assert (stats.total, stats.skipped, stats.generated) == (24, 0, 24)
    assert rows["p3"]["finish_reason"] == "empty" and rows["p3"]["conversations"][-1]["content"] == ""
    assert rows["p5"]["finish_reason"] == "length"
    assert rows["p11"]["conversations"][-1]["content"] == f"<think>\nlet me think\n</think>\n\nreply to: {users[11]}"
    for rid in ("p7", "p9"):  # no reply turn; the error says what and where
        assert rows[rid]["finish_reason"] == "error" and rows[rid]["conversations"][-1]["role"] == "user"
    assert "HTTP 500" in rows["p7"]["error"] and "after 3 attempts" in rows["p7"]["error"]
    assert "HTTP 400" in rows["p9"]["error"] and "after 1 attempt," in rows["p9"]["error"]
    assert {rid for rid, _ in stats.errors} == {"p7", "p9"}
    for i in (0, 1, 2, 4, 6):
        r = rows[f"p{i}"]
        assert r["finish_reason"] == "stop"
        assert r["conversations"] == [{"role": "user", "content": users[i]},
                                      {"role": "assistant", "content": f"reply to: {users[i]}"}]
    # requests: once per row, the poisoned row max_attempts times (on both servers), the rejected one once
    sent = a.users() + b.users()
    assert sent == Counter({u: 1 for u in users} | {users[7]: 3})
    assert users[7] in a.users() and users[7] in b.users()
    assert a.requests() and b.requests()  # spread over both
    payload = a.requests()[0]["payload"]
    assert payload["temperature"] == 0.0 and payload["max_tokens"] == 64 and payload["model"] == "fake-target"
    assert "chat_template_kwargs" not in payload and "seed" not in payload
    # tokens: the servers' usage counts (one per word of the fake server's reply)
    assert stats.new_tokens == sum(len(f"reply to: {u}".split()) for i, u in enumerate(users) if i not in (3, 7, 9))
    assert not journal_path(out).exists()

    # resume: nothing left to do, no request sent
    before = out.read_bytes()
    n_sent = len(a.requests()) + len(b.requests())
    again = regenerate_served(tmp_path / "p.jsonl", [a.url, b.url], out, max_new_tokens=64, **FAST)
    assert (again.skipped, again.generated) == (24, 0) and out.read_bytes() == before
    assert len(a.requests()) + len(b.requests()) == n_sent
    # --retry-errors: the two error rows are dropped and tried again (they fail again): still once each
    retried = regenerate_served(tmp_path / "p.jsonl", [a.url, b.url], out, max_new_tokens=64, max_attempts=2,
                                retry_errors=True, **FAST)
    assert retried.dropped_errors == 2 and retried.generated == 2 and retried.reasons == Counter(error=2)
    assert set(_rows(out)) == set(rows)


def test_failing_servers_are_taken_out_and_every_row_still_answered(tmp_path, servers):
    """A server answering 500, one answering malformed JSON, one that hangs (timeout), one that refuses
    connections (killed before the run): each is taken out; the healthy one answers every row once."""
    good, e500, bad_json, hang, dead = (servers(), servers("500"), servers("malformed"), servers("hang"),
                                        servers())
    dead.kill()
    users = _prompts(tmp_path / "p.jsonl", 20)
    out = tmp_path / "out.jsonl"
    messages = []
    stats = regenerate_served(tmp_path / "p.jsonl", [e500.url, bad_json.url, hang.url, dead.url, good.url], out,
                              concurrency=2, max_attempts=6, timeout_s=0.5, fail_threshold=1, log=messages.append,
                              **FAST)
    rows = _rows(out)
    assert set(rows) == {f"p{i}" for i in range(20)} and stats.reasons == Counter(stop=20)
    assert good.users() == Counter(users)  # every row, once, from the healthy server
    report = {s["url"]: s for s in stats.servers}
    for s in (e500, bad_json, hang, dead):
        assert report[s.url]["taken_out"] >= 1 and report[s.url]["state"] == "out" and report[s.url]["ok"] == 0
    assert report[good.url]["state"] == "up" and report[good.url]["ok"] == 20
    assert {"server", "malformed", "timeout"} <= set(stats.failures)
    assert report[e500.url]["failures"].get("server") and report[bad_json.url]["failures"].get("malformed")
    assert report[hang.url]["failures"].get("timeout")
    assert any(dead.url in m and "GET /v1/models" in m for m in messages)
    assert any("taken out of rotation" in m for m in messages)


def test_a_server_killed_mid_run_has_its_requests_sent_elsewhere(tmp_path, servers):
    """The server process exits in the middle of a request after answering 4: the requests it had in
    flight are re-sent to the other server; every row is written once, none as an error."""
    dying, good = servers("die-after:4"), servers()
    users = _prompts(tmp_path / "p.jsonl", 30)
    out = tmp_path / "out.jsonl"
    stats = regenerate_served(tmp_path / "p.jsonl", [dying.url, good.url], out, concurrency=3, max_attempts=3,
                              timeout_s=30, **FAST)
    assert dying.proc.wait(timeout=60) == 1  # it really died
    rows = _rows(out)
    assert set(rows) == {f"p{i}" for i in range(30)} and stats.reasons == Counter(stop=30)
    answered_by_dying = [r["user"] for r in dying.answered()]
    lost = [r["user"] for r in dying.requests() if r["n"] > 4]  # reached it, never answered
    assert len(answered_by_dying) == 4 and lost and not set(lost) & set(answered_by_dying)
    assert Counter(answered_by_dying) + good.users() == Counter(users)  # each row answered exactly once
    assert all(good.users()[u] == 1 for u in lost)
    report = {s["url"]: s for s in stats.servers}
    assert report[dying.url]["taken_out"] == 1 and report[dying.url]["ok"] == 4


def test_when_every_server_is_gone_the_run_stops_and_a_resume_finishes(tmp_path, servers):
    dying = servers("die-after:3")
    users = _prompts(tmp_path / "p.jsonl", 10)
    out = tmp_path / "out.jsonl"
    with pytest.raises(AllServersDown, match="every server is out of rotation"):
        regenerate_served(tmp_path / "p.jsonl", [dying.url], out, concurrency=1, timeout_s=30, backoff_s=0.01,
                          cooldown_s=0.01, max_trials=2)
    done = _rows(out)
    assert len(done) == 3 and all(r["finish_reason"] == "stop" for r in done.values())
    good = servers()
    stats = regenerate_served(tmp_path / "p.jsonl", [good.url], out, **FAST)
    assert stats.skipped == 3 and stats.generated == 7
    assert set(_rows(out)) == {f"p{i}" for i in range(10)}
    assert good.users() == Counter(u for i, u in enumerate(users) if f"p{i}" not in done)


def _cli(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "dflash_flow", "regenerate", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_cli_killed_mid_run_resumes_skipping_the_written_ids(tmp_path, servers):
    """The client is SIGKILLed with requests in flight (the server holds them), and the server too; the
    same command with another server sends only the rows not written, and the output has each id once."""
    held = servers("hold-after:5")
    users = _prompts(tmp_path / "p.jsonl", 16)
    out = tmp_path / "out.jsonl"
    proc = _cli(str(tmp_path / "p.jsonl"), "--server", held.url, "--out", str(out), "--concurrency", "3",
                "--timeout", "120")
    deadline = time.monotonic() + 120  # bound on the wait, not a measured duration
    while not (out.exists() and len(out.read_text().splitlines()) == 5 and len(held.requests()) >= 6):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the client never wrote 5 rows"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    held.kill()
    assert journal_path(out).exists()  # the killed client was appending
    written = set(_rows(out))
    assert len(written) == 5

    good = servers()
    resumed = _cli(str(tmp_path / "p.jsonl"), "--server", held.url, "--server", good.url, "--out", str(out))
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert set(_rows(out)) == {f"p{i}" for i in range(16)}
    assert good.users() == Counter(u for i, u in enumerate(users) if f"p{i}" not in written)
    assert "5 already there, 11 now: stop 11, length 0, empty 0, error 0" in stdout
    assert f"{held.url}: 0 answered" in stdout and "does not answer GET /v1/models" in stderr
    assert not journal_path(out).exists()


def test_cli_reports_error_rows_and_a_missing_server_in_one_line(tmp_path, servers):
    a = servers()
    _prompts(tmp_path / "p.jsonl", 4, {1: "[POISON]"})
    out = tmp_path / "out.jsonl"
    proc = _cli(str(tmp_path / "p.jsonl"), "--server", a.url, "--out", str(out), "--max-attempts", "2")
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr
    assert "stop 3, length 0, empty 0, error 1" in stdout
    assert "1 rows failed" in stderr and "'p1': HTTP 500" in stderr and "--retry-errors" in stderr
    assert _rows(out)["p1"]["finish_reason"] == "error"
    a.kill()
    proc = _cli(str(tmp_path / "p.jsonl"), "--server", a.url, "--out", str(tmp_path / "o2.jsonl"))
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "no server answered GET /v1/models" in stderr.splitlines()[-1]
    assert "Traceback" not in stderr
    proc = _cli(str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o3.jsonl"))  # neither --target nor --server
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and stderr.count("\n") == 1 and "--server" in stderr
    # options of the server path without --server are refused, not ignored
    proc = _cli(str(tmp_path / "p.jsonl"), "--target", "embedded", "--out", str(tmp_path / "o3.jsonl"), "--no-thinking",
                "--sampling", "target")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and stderr.count("\n") == 1
    assert "--sampling, --thinking/--no-thinking only apply with --server" in stderr
    assert not (tmp_path / "o3.jsonl").exists()
    proc = _cli(str(tmp_path / "p.jsonl"), "--server", "http://127.0.0.1:1", "--out", str(tmp_path / "o3.jsonl"),
                "--batch-size", "32")
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "--batch-size only applies in process" in stderr


def test_sampling_thinking_and_model_fields(tmp_path, servers):
    a = servers(model="org/target-8b")
    _prompts(tmp_path / "p.jsonl", 4)
    gen = tmp_path / "target"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                                            "top_k": 20}))
    regenerate_served(tmp_path / "p.jsonl", [a.url], tmp_path / "o.jsonl", sampling="target", target=gen,
                      enable_thinking=False, seed=7, **FAST)
    regenerate_served(tmp_path / "p.jsonl", [a.url], tmp_path / "o2.jsonl", sampling="target", target=gen,
                      enable_thinking=True, seed=7, **FAST)
    first, second = a.requests()[:4], a.requests()[4:]
    for r in first + second:
        p = r["payload"]
        assert (p["model"], p["temperature"], p["top_p"], p["top_k"]) == ("org/target-8b", 0.6, 0.95, 20)
    assert all(r["payload"]["chat_template_kwargs"] == {"enable_thinking": False} for r in first)
    assert all(r["payload"]["chat_template_kwargs"] == {"enable_thinking": True} for r in second)
    seeds = lambda rs: {r["user"]: r["payload"]["seed"] for r in rs}  # noqa: E731
    assert seeds(first) == seeds(second) and len(set(seeds(first).values())) == 4  # per row, reproducible
    with pytest.raises(ValueError, match="--served-model other is not served"):
        regenerate_served(tmp_path / "p.jsonl", [a.url], tmp_path / "o3.jsonl", model="other", **FAST)
    b = servers(model="another-model")
    with pytest.raises(ValueError, match="do not serve one and the same model"):
        regenerate_served(tmp_path / "p.jsonl", [a.url, b.url], tmp_path / "o4.jsonl", **FAST)
    with pytest.raises(ValueError, match="is the input file"):
        regenerate_served(tmp_path / "p.jsonl", [a.url], tmp_path / "p.jsonl", **FAST)
    (tmp_path / "bad.jsonl").write_text('{"id": "x1", "conversations": [{"role": "assistant", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="record 'x1': conversation has no user turn"):
        regenerate_served(tmp_path / "bad.jsonl", [a.url], tmp_path / "o5.jsonl", **FAST)


def test_sampling_params_and_backoff_are_deterministic(target_dir):
    assert sampling_params("greedy") == {"temperature": 0.0}
    assert sampling_params("target", target_dir) == {"temperature": 0.0}  # the shipped target: do_sample false
    assert sampling_params("target") == {}  # the server's defaults
    with pytest.raises(ValueError, match="'greedy' or 'target'"):
        sampling_params("nucleus")
    delays = [backoff_delay("row-1", k, 0.5, 8.0) for k in range(1, 8)]
    assert delays == [backoff_delay("row-1", k, 0.5, 8.0) for k in range(1, 8)]
    for k, d in enumerate(delays, 1):
        cap = min(8.0, 0.5 * 2 ** (k - 1))
        assert cap * 0.5 <= d < cap
    assert backoff_delay("row-1", 1, 0.5, 8.0) != backoff_delay("row-2", 1, 0.5, 8.0)


def test_parse_chat_completion_kinds():
    from dflash_flow.embedded.served import RequestFailed

    ok = {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 2}}
    assert parse_reply(ok) == ({"role": "assistant", "content": "hi"}, "stop", 2)
    reasoning = {"choices": [{"message": {"content": "4", "reasoning": " 2+2 "}, "finish_reason": "length"}]}
    assert parse_reply(reasoning) == ({"role": "assistant", "content": "<think>\n2+2\n</think>\n\n4"}, "length", 0)
    for bad, kind in [({"choices": []}, "malformed"), ({"choices": [{"message": None}]}, "malformed"),
                      ({"choices": [{"message": {"content": "x"}, "finish_reason": "abort"}]}, "server")]:
        with pytest.raises(RequestFailed) as e:
            parse_reply(bad)
        assert e.value.kind == kind
    assert os.path.exists(HERE / "fake_openai_server.py")


def test_pool_health_threshold_cooldown_trials_and_removal():
    import threading

    from dflash_flow.embedded.served import RequestFailed, ServerPool

    now = [0.0]
    pool = ServerPool(["http://a:1", "http://b:2/v1"], per_server=2, fail_threshold=3, cooldown_s=1.0,
                      max_trials=2, clock=lambda: now[0])
    a, b = pool.servers
    assert (b.host, b.port, b.base) == ("b", 2, "")
    stop = threading.Event()
    boom = RequestFailed("server", "HTTP 500")
    # two failures, a success, two failures: never three in a row, a stays in rotation
    for fail in (boom, boom, None, boom, boom):
        lease = pool.acquire({"http://b:2/v1"}, stop)
        assert lease.server is a
        pool.release(lease, fail)
    assert not a.down
    lease = pool.acquire({"http://b:2/v1"}, stop)
    pool.release(lease, boom)  # the third in a row
    assert a.down and a.taken_out == 1
    # while a cools down, everything goes to b, even a retry that would rather avoid b
    assert pool.acquire({"http://b:2/v1"}, stop).server is b
    pool.release(pool.acquire(set(), stop), None)  # b
    a_4xx = RequestFailed("client", "HTTP 400")
    lease = pool.acquire(set(), stop)
    pool.release(lease, a_4xx)  # a 4xx never counts against a server
    assert b.consecutive == 0 and not b.failures
    now[0] = 1.0  # cool-down over: a gets one trial request
    lease = pool.acquire({"http://b:2/v1"}, stop)
    assert lease.server is a and lease.trial
    pool.release(lease, RequestFailed("refused", "connection refused"))
    assert a.down and a.out_until == 1.0 + 2.0 and not a.removed  # cool-down doubled
    now[0] = 3.0
    lease = pool.acquire({"http://b:2/v1"}, stop)
    assert lease.trial
    pool.release(lease, boom)
    assert a.removed  # max_trials failed trials
    b.removed = True
    with pytest.raises(AllServersDown):
        pool.acquire(set(), stop)
    with pytest.raises(ValueError, match="not an http"):
        ServerPool(["ftp://x"])


def test_a_chat_source_regenerates_through_servers_on_first_use(tmp_path, servers, target_dir):
    """ChatSource(regenerate={servers, out_dir}) in a real pipeline: the first run has the servers answer
    every prompt (one of them dies after 3) and trains on the replies, read in input order; the second run
    finds them written and sends no request."""
    from dflash_flow.app import model_services
    from dflash_flow.core import Graph, Pipeline, RuntimeOptions
    from dflash_flow.stages.sources import ChatSource

    dying, good = servers("die-after:3"), servers()
    users = _prompts(tmp_path / "prompts.jsonl", 12, {4: "[POISON]"})
    regen = {"servers": [dying.url, good.url], "out_dir": str(tmp_path / "regen"), "max_new_tokens": 32,
             "concurrency": 2, "max_attempts": 2, "timeout_s": 30}
    for attempt in range(2):
        g = Graph(name="regen", seed=1, runtime=RuntimeOptions(stall_timeout_s=600))
        g.sections["model"] = {"tokenizer": str(target_dir)}
        g.add("src", ChatSource(paths=[str(tmp_path / "prompts.jsonl")], cache_dir=str(tmp_path / "cache"),
                                regenerate=regen, template_kwargs={"enable_thinking": False}))
        pipe = Pipeline(g, collect=["src"], check_devices=False, output_dir=tmp_path / f"r{attempt}",
                        services=model_services(g))
        [table] = list(pipe.iterate("src"))
        assert len(table) == 11  # the poisoned row is an error row: a bad record, not a sample
        metrics = pipe.snapshot().stages["src"].replicas[0].metrics
        assert metrics["records"] == 12
        final = [json.loads(x) for x in (tmp_path / "regen" / "prompts.jsonl").read_text().splitlines()]
        assert [r["id"] for r in final] == [f"p{i}" for i in range(12)]  # input order, whatever the timing
        assert final[4]["finish_reason"] == "error"
        assert all(r["conversations"][-1] == {"role": "assistant", "content": f"reply to: {users[i]}"}
                   for i, r in enumerate(final) if i != 4)
        if attempt == 0:
            sent = len(dying.requests()) + len(good.requests())
            assert all(r["payload"]["chat_template_kwargs"] == {"enable_thinking": False}
                       for r in good.requests())
    assert len(dying.requests()) + len(good.requests()) == sent  # the second run sent nothing
    assert (tmp_path / "prompts.jsonl").read_text().count("old") == 12  # the input is untouched


def test_chat_source_regenerate_config_is_checked(tmp_path):
    from dflash_flow.stages.sources import ChatSource

    p = str(tmp_path / "a.jsonl")
    for bad, match in [({"out_dir": "x"}, "servers"), ({"servers": ["http://h:1"]}, "out_dir"),
                       ({"servers": ["http://h:1"], "out_dir": "x", "tempreature": 0}, "unknown keys"),
                       ({"servers": ["http://h:1"], "out_dir": str(tmp_path)}, "holds the input")]:
        with pytest.raises(ValueError, match=match):
            ChatSource(paths=[p], regenerate=bad)
    # an out_dir holding a file of the input's name that regenerate did not write: never replaced
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"id": 1, "prompt": "x"}\n')
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.jsonl").write_text('{"mine": true}\n')
    with pytest.raises(ValueError, match="not a record written by dflash-flow regenerate"):
        regenerate_served(tmp_path / "in" / "a.jsonl", ["http://127.0.0.1:1"], tmp_path / "out" / "a.jsonl.regen.jsonl",
                          ordered_out=tmp_path / "out" / "a.jsonl", **FAST)
    assert (tmp_path / "out" / "a.jsonl").read_text() == '{"mine": true}\n'
    with pytest.raises(ValueError, match="not a .jsonl"):
        ChatSource(paths=[str(tmp_path / "a.parquet")], regenerate={"servers": ["http://h:1"], "out_dir": "x"})


def test_a_second_process_waits_for_the_writer_and_then_finds_its_rows(tmp_path, servers):
    """Two ranks of a node regenerate into one out_dir: the second waits on the first's lock (its wait
    callback is told), then continues from what the first wrote."""
    from dflash_flow.embedded.regen_io import OutputWriter

    a = servers()
    _prompts(tmp_path / "p.jsonl", 5)
    out = tmp_path / "o.jsonl"
    first = regenerate_served(tmp_path / "p.jsonl", [a.url], out, limit=3, **FAST)
    assert first.generated == 3
    holder = OutputWriter(out).__enter__()  # "another process" is writing
    calls = []

    def wait() -> None:
        calls.append(1)
        if len(calls) == 2:
            holder.__exit__(None, None, None)

    with pytest.raises(ValueError, match="being written by another"):
        regenerate_served(tmp_path / "p.jsonl", [a.url], out, **FAST)  # no wait: refused at once
    stats = regenerate_served(tmp_path / "p.jsonl", [a.url], out, wait=wait, ordered_out=tmp_path / "final.jsonl",
                              **FAST)
    assert len(calls) == 2 and (stats.skipped, stats.generated) == (3, 2)
    assert [json.loads(x)["id"] for x in (tmp_path / "final.jsonl").read_text().splitlines()] == \
        [f"p{i}" for i in range(5)]
    assert len(a.requests()) == 5
