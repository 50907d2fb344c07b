"""The server pool's two spreads and what it shows of a URL (engine.http; the pool's fault handling is tested
through regenerate --server in tests/embedded and through the engine backend here)."""

from __future__ import annotations

import threading

import pytest

from dflash_flow.engine.http import AllServersDown, RequestFailed, ServerPool, redact_url

URLS = ["http://a:1", "http://b:2", "http://c:3"]


def _take(pool, n):
    stop = threading.Event()
    return [pool.acquire(set(), stop) for _ in range(n)]


def test_round_robin_deals_in_turn_whatever_is_in_flight():
    pool = ServerPool(URLS, per_server=8, spread="round_robin")
    leases = _take(pool, 4)
    assert [lease.server.url for lease in leases] == ["http://a:1", "http://b:2", "http://c:3", "http://a:1"]
    for lease in leases[1:3]:
        pool.release(lease, None)  # b and c are idle again; a still has two in flight
    assert [lease.server.url for lease in _take(pool, 2)] == ["http://b:2", "http://c:3"]


def test_least_loaded_fills_the_idle_servers_first():
    pool = ServerPool(URLS, per_server=8, spread="least_loaded")
    leases = _take(pool, 3)
    pool.release(leases[1], None)  # b is idle, a and c have one each
    assert [lease.server.url for lease in _take(pool, 2)] == ["http://b:2", "http://c:3"]  # then in turn


def test_a_refusing_server_leaves_the_rotation_and_the_last_one_gone_names_each():
    pool = ServerPool(URLS[:2], per_server=1, spread="round_robin", max_trials=1, cooldown_s=0.0)
    stop = threading.Event()
    for _ in range(2):  # each is taken out, then fails its one trial: removed
        for lease in [pool.acquire(set(), stop) for _ in range(2)]:
            pool.release(lease, RequestFailed("refused", "connection refused"))
    with pytest.raises(AllServersDown, match=r"http://a:1: removed \(connection refused\); http://b:2: removed"):
        pool.acquire(set(), stop)


def test_an_unknown_spread_is_refused():
    with pytest.raises(ValueError, match="least_loaded, round_robin"):
        ServerPool(URLS, spread="random")


def test_passwords_never_show():
    assert redact_url("http://user:s3cret@host:8000/v1") == "http://***@host:8000/v1"  # the one redaction
    assert redact_url("user:s3cret@host:8000") == "http://***@host:8000"
    assert redact_url("http://host:8000") == "http://host:8000"
    assert "s3cret" not in ServerPool(["http://u:s3cret@h:1"]).describe()
