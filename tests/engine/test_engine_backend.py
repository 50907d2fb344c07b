"""EngineBackend against fake vLLM servers in real processes on real ports (tests/engine/fake_vllm_server.py
writes feature files with our connector's writer): the features equal what the servers computed, and every
fault -- a server killed mid-batch, wrong token ids, zeros, NaN, a slow server, a refused connection, a
wrong layer count, a server without our connector -- ends in the result or in one line naming server,
sample and layer."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from dflash_flow.engine.backend import EngineBackend, EngineUnavailable
from dflash_flow.engine.checks import FeatureFault
from dflash_flow.engine.config import engine_config_from
from dflash_flow.engine.launch import port_free

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from fake_vllm_server import synthetic_features  # noqa: E402

LAYERS = [1, 5]  # ours; the servers are told [2, 6]
HIDDEN = 16
FAST = {"backoff_s": 0.01, "backoff_max_s": 0.05, "cooldown_s": 60.0, "max_trials": 1}


class Fake:
    def __init__(self, tmp: Path, features_dir: Path, name: str, behaviour: str = "ok", extra=()):
        self.log = tmp / f"{name}.log"
        self.args = (tmp, features_dir, name, extra)
        port_file = tmp / f"{name}.port"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "fake_vllm_server.py"), "--port-file", str(port_file), "--dir",
             str(features_dir), "--layers", ",".join(str(i + 1) for i in LAYERS), "--hidden", str(HIDDEN),
             "--behaviour", behaviour, "--log", str(self.log), *extra])
        deadline = time.monotonic() + 120  # a bound on start-up, not a measured duration
        while not port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"fake server {name} did not start")
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"
        self.base = 0

    def set(self, behaviour: str, directory: Path | None = None) -> Fake:
        """Switch the running server's behaviour and directory (and count its requests from here)."""
        body = {"behaviour": behaviour, **({"dir": str(directory)} if directory is not None else {})}
        req = urllib.request.Request(self.url + "/control", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        self.base = self._lines()
        return self

    def _lines(self) -> int:
        return len(self.log.read_text().splitlines()) if self.log.exists() else 0

    def requests(self) -> int:
        return self._lines() - self.base

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)


class Farm:
    """Two synthetic fake servers for the whole module (a start costs seconds on a busy box); a test sets
    their behaviour and the farm restarts any that a test killed."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.round = 0
        self.features_dir = tmp / "features-0"
        self.features_dir.mkdir()
        self.fakes = [Fake(tmp, self.features_dir, f"s{i}") for i in range(2)]
        self.extra: list[Fake] = []

    def __call__(self, behaviour: str = "ok", extra=()) -> Fake:
        """The next free server set to ``behaviour`` (``extra`` arguments: a server of its own)."""
        if extra:
            f = Fake(self.tmp, self.features_dir, f"x{len(self.extra)}", behaviour, extra)
            self.extra.append(f)
            return f
        f = self.fakes[self._next]
        self._next += 1
        return f.set(behaviour, self.features_dir)

    def reset(self) -> None:
        """A fresh features directory for each test (a slow server of the last test may still write into its
        own), servers a test killed started again, the extra ones stopped."""
        self._next = 0
        self.round += 1
        self.features_dir = self.tmp / f"features-{self.round}"
        self.features_dir.mkdir()
        for i, f in enumerate(self.fakes):
            if f.proc.poll() is not None:
                self.fakes[i] = Fake(f.args[0], self.features_dir, f.args[2], "ok", f.args[3])
        for f in self.extra:
            f.stop()
        self.extra = []


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    f = Farm(tmp_path_factory.mktemp("fakes"))
    yield f
    for x in f.fakes + f.extra:
        x.stop()


@pytest.fixture
def servers(farm):
    farm.reset()
    yield farm
    farm.reset()


def backend(servers, urls, **over) -> EngineBackend:
    cfg = engine_config_from({"servers": urls, "features_dir": str(servers.features_dir), "timeout_s": 30,
                              "check_samples": 2, **FAST, **over})
    b = EngineBackend(cfg, layer_ids=LAYERS, hidden_size=HIDDEN, depth=8, log=lambda m: None)
    b.setup(devices=["cpu"], out_device="cpu", name="target")
    return b


def batch(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.zeros(len(lengths), s, dtype=torch.long)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(4, 500, (n,), generator=g)
        mask[i, :n] = 1
    return ids, mask, list(lengths), [f"s{i}" for i in range(len(lengths))]


def expected(ids, lengths):
    out = torch.zeros(ids.shape[0], ids.shape[1], len(LAYERS) * HIDDEN)
    for i, n in enumerate(lengths):
        out[i, :n] = synthetic_features(ids[i, :n].tolist(), [k + 1 for k in LAYERS], HIDDEN).reshape(n, -1)
    return out


def test_features_equal_the_servers_and_the_files_are_collected(servers):
    a, b = servers(), servers()
    be = backend(servers, [a.url, b.url], spread="round_robin", concurrency=2)
    try:
        ids, mask, lengths, sids = batch([7, 3, 12, 1, 9, 5, 11, 2])
        out = be.features(ids, mask, lengths, sids)
        assert out.shape == (8, 12, 2 * HIDDEN) and out.dtype == torch.float32
        torch.testing.assert_close(out, expected(ids, lengths), rtol=0, atol=0)  # padding zero, rows in place
        assert a.requests() > 0 and b.requests() > 0 and a.requests() + b.requests() == 8
        assert list(servers.features_dir.iterdir()) == []  # every file read once and deleted
        assert be.start_check.done and be.start_check.report["mode"] == "statistics"
    finally:
        be.close()


def test_a_server_killed_mid_batch_loses_nothing(servers):
    a, b = servers("die-after:2"), servers()
    be = backend(servers, [a.url, b.url], concurrency=2)
    try:
        ids, mask, lengths, sids = batch([5] * 10, seed=1)
        out = be.features(ids, mask, lengths, sids)
        torch.testing.assert_close(out, expected(ids, lengths), rtol=0, atol=0)
        assert a.proc.wait(timeout=60) == 3  # it did die, with requests in flight
        assert be._pool.describe().startswith(f"{a.url}: removed") or f"{a.url}: out" in be._pool.describe()
        out2 = be.features(*batch([4, 6], seed=2))  # the next batch goes to the survivor only
        assert out2.shape[0] == 2
    finally:
        be.close()


def test_every_server_gone_is_one_line_naming_each(servers, tmp_path):
    a = servers("die-after:0")
    closed = f"http://127.0.0.1:{_closed_port()}"
    be = backend(servers, [a.url, closed], cooldown_s=0.05)
    try:
        with pytest.raises(EngineUnavailable) as e:
            be.features(*batch([3, 4]))
        msg = str(e.value)
        assert "every engine server is gone" in msg and a.url in msg and closed in msg
        assert "\n" not in msg
    finally:
        be.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert port_free(port)
    return port


def test_a_refused_server_sends_its_samples_to_the_others(servers):
    b = servers()
    closed = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(ValueError, match="no server answered"):
        backend(servers, [closed])
    be = backend(servers, [closed, b.url])  # the closed one starts out of rotation
    try:
        ids, mask, lengths, sids = batch([6, 2, 8])
        torch.testing.assert_close(be.features(ids, mask, lengths, sids), expected(ids, lengths), rtol=0, atol=0)
        assert b.requests() == 3
    finally:
        be.close()


def test_a_slow_server_times_out_and_its_samples_are_retried_elsewhere(servers):
    slow, b = servers("slow:120"), servers()
    be = backend(servers, [slow.url, b.url], timeout_s=0.5, spread="round_robin", fail_threshold=1)
    try:
        ids, mask, lengths, sids = batch([4, 5, 6, 7])
        torch.testing.assert_close(be.features(ids, mask, lengths, sids), expected(ids, lengths), rtol=0, atol=0)
        assert be.stats["failed_timeout"] >= 1 and slow.requests() >= 1
    finally:
        be.close()


def test_a_file_that_never_appears_is_retried_elsewhere(servers):
    lost, b = servers("no-file"), servers()
    be = backend(servers, [lost.url, b.url], timeout_s=0.3, spread="round_robin")
    try:
        ids, mask, lengths, sids = batch([4, 5])
        torch.testing.assert_close(be.features(ids, mask, lengths, sids), expected(ids, lengths), rtol=0, atol=0)
        assert be.stats["failed_handover"] >= 1
    finally:
        be.close()


@pytest.mark.parametrize("behaviour, pattern", [
    ("wrong-ids", r"sample s\d: the features' token ids differ from those sent .*first at position \d+: sent \d+, got \d+"),
    ("zeros", r"sample s\d: \d+ of \d+ positions are all zero in layer 5 \(vLLM id 6\)"),
    ("nan", r"sample s\d: NaN/inf in layer 1 \(vLLM id 2\) at 1 position"),
    ("layer-count", r"sample s\d: 3 layers of hidden states, expected 2 \(ours \[1, 5\], vLLM \[2, 6\]\).*serve-target"),
    ("no-path", r"without kv_transfer_params.hidden_states_path.*serve-target"),
    ("outside", r"outside model.engine.features_dir"),
])
def test_bad_features_stop_the_run_naming_server_sample_and_layer(servers, behaviour, pattern):
    a = servers(behaviour)
    be = backend(servers, [a.url])
    try:
        with pytest.raises(FeatureFault, match=pattern) as e:
            be.features(*batch([5, 6, 7]))
        assert a.url in str(e.value) and "\n" not in str(e.value)
    finally:
        be.close()


def test_repeated_layers_fail_the_statistics_check_before_anything_is_returned(servers):
    a = servers("repeat")
    be = backend(servers, [a.url], check_reference="statistics")
    try:
        with pytest.raises(FeatureFault, match=r"layer 1 \(vLLM id 2\) and layer 5 \(vLLM id 6\) are equal"):
            be.features(*batch([5, 6]))
    finally:
        be.close()


def test_a_sample_longer_than_the_servers_context_is_named(servers):
    a = servers("ok", extra=("--max-model-len", "8"))
    be = backend(servers, [a.url])
    try:
        with pytest.raises(EngineUnavailable, match=r"sample s1 has 9 tokens; the servers hold at most 8"):
            be.features(*batch([3, 9]))
    finally:
        be.close()


def test_16_bit_features_come_back_as_served_unless_a_dtype_is_asked(servers):
    a = servers("bf16")
    be = backend(servers, [a.url])
    be32 = backend(servers, [a.url], dtype="float32")
    try:
        ids, mask, lengths, sids = batch([5, 3])
        out = be.features(ids, mask, lengths, sids)
        assert out.dtype == torch.bfloat16
        ref = expected(ids, lengths).to(torch.bfloat16)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        assert be32.features(ids, mask, lengths, sids).dtype == torch.float32
    finally:
        be.close()
        be32.close()


def test_the_start_check_compares_with_transformers_and_catches_an_unmapped_layer(servers):
    """The fake serves a real preset target's hidden states; switched to off-by-one (our ids used as vLLM's)
    it is caught by the nearest-layer comparison, whatever the tolerance."""
    fake = servers("ok", ("--target", "tiny-qwen3-8l"))
    cfg = dict(check_reference="transformers", check_samples=2)

    def make():
        b = EngineBackend(engine_config_from({"servers": [fake.url], "features_dir": str(servers.features_dir),
                                              **FAST, **cfg}), layer_ids=LAYERS, hidden_size=64, depth=8,
                          target="tiny-qwen3-8l", log=lambda m: None)
        b.setup(out_device="cpu", name="target")
        return b

    ok = make()
    try:
        ok.features(*batch([6, 9, 4]))
        rep = ok.start_check.report
        assert rep["mode"] == "transformers" and rep["samples"] == 2
        assert rep["max_abs_diff"] < 1e-5 and all(v["nearest_vllm_id"] == v["vllm_id"] for v in rep["layers"].values())
    finally:
        ok.close()
    fake.set("off-by-one")
    wrong = make()
    try:
        with pytest.raises(FeatureFault, match=r"layer 1 \(vLLM id 2\) is nearest to transformers' hidden_states\[1\]"):
            wrong.features(*batch([6, 9, 4]))
        with pytest.raises(FeatureFault):  # and it stays refused for the next batch
            wrong.features(*batch([5]))
    finally:
        wrong.close()


def test_the_last_layer_and_a_config_without_servers_are_refused_up_front(servers):
    with pytest.raises(ValueError, match="last layer"):
        EngineBackend(engine_config_from({"servers": ["http://127.0.0.1:1"]}), layer_ids=[1, 7], hidden_size=16, depth=8)
    with pytest.raises(ValueError, match="needs servers"):
        engine_config_from({})
