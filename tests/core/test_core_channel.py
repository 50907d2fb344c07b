"""Channel: bounded FIFO, blocking put as backpressure, close as end-of-stream, errors as values, stats."""

from __future__ import annotations

import threading
import time

import pytest

from dflash_flow.core import Channel
from dflash_flow.core.channel import END_OF_STREAM, ChannelCancelled, ErrorItem


def _wait_until(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _thread(target, *args):
    t = threading.Thread(target=target, args=args)
    t.start()
    return t


def test_fifo_and_end_of_stream_after_buffered_items():
    ch = Channel(4, producers=1)
    for i in range(3):
        ch.put(i)
    ch.close()
    # Closing does not drop buffered items: they come first, then end-of-stream, forever.
    assert [ch.get() for _ in range(3)] == [0, 1, 2]
    assert ch.get() is END_OF_STREAM
    assert ch.get() is END_OF_STREAM


@pytest.mark.parametrize("bad", [0, -1])
def test_capacity_below_one_rejected(bad):
    with pytest.raises(ValueError, match="capacity"):
        Channel(bad)


def test_blocking_put_is_backpressure():
    ch = Channel(2, name="c")
    ch.put("a")
    ch.put("b")
    done = threading.Event()
    marks = {}

    def producer():
        marks["put"] = time.perf_counter()
        ch.put("c")  # full: must block until the consumer takes one
        done.set()

    t = _thread(producer)
    assert not done.wait(0.2), "put on a full channel returned without room"
    assert ch.depth == 2
    marks["get"] = time.perf_counter()
    assert ch.get() == "a"
    assert done.wait(5.0)
    t.join(5.0)
    assert not t.is_alive()
    assert [ch.get(), ch.get()] == ["b", "c"]
    st = ch.stats()
    assert st.capacity == 2
    assert st.items_in == 3 and st.items_out == 3 and st.depth == 0
    # the producer's blocked time covers (most of) the span from its put to our get
    assert st.blocked_put_s >= 0.5 * (marks["get"] - marks["put"]) > 0


def test_put_returns_blocked_seconds_and_get_accounts_waiting():
    ch = Channel(1)
    assert ch.put(1) == 0.0
    marks = {}

    def producer():
        marks["put"] = time.perf_counter()
        marks["blocked"] = ch.put(2)

    t = _thread(producer)
    assert _wait_until(lambda: "put" in marks)
    time.sleep(0.1)
    assert ch.waiting_s(t.ident) >= 0.05 and ch.waiting_s(threading.get_ident()) == 0.0  # the wait so far
    marks["get"] = time.perf_counter()
    assert ch.get() == 1
    t.join(5.0)
    assert marks["blocked"] >= 0.5 * (marks["get"] - marks["put"]) > 0
    assert ch.stats().blocked_put_s == marks["blocked"]
    assert ch.get() == 2
    # get on an empty channel blocks; the time shows up in blocked_get_s
    got = {}

    def consumer():
        got["start"] = time.perf_counter()
        got["v"] = ch.get()

    t = _thread(consumer)
    assert _wait_until(lambda: "start" in got)
    time.sleep(0.1)
    assert ch.waiting_s(t.ident) >= 0.05
    put_at = time.perf_counter()
    ch.put(3)
    t.join(5.0)
    assert got["v"] == 3
    assert ch.stats().blocked_get_s >= 0.5 * (put_at - got["start"]) > 0
    assert ch.waiting_s(t.ident) == 0.0  # over: counted in the total, no longer as a wait


def test_end_of_stream_only_after_every_producer_closed():
    ch = Channel(8, producers=3)
    got = []

    def consumer():
        while True:
            v = ch.get()
            if v is END_OF_STREAM:
                return
            got.append(v)

    t = _thread(consumer)
    ch.put(1)
    ch.close()
    ch.put(2)
    ch.close()
    time.sleep(0.1)
    assert t.is_alive(), "end-of-stream delivered while a producer was still open"
    ch.put(3)
    ch.close()
    t.join(5.0)
    assert not t.is_alive()
    assert got == [1, 2, 3]


def test_many_producers_merge_into_one_consumer():
    n_prod, per = 4, 300
    ch = Channel(3, producers=n_prod)

    def producer(p):
        for k in range(per):
            ch.put((p, k))
        ch.close()

    threads = [_thread(producer, p) for p in range(n_prod)]
    got = []
    while (v := ch.get()) is not END_OF_STREAM:
        got.append(v)
    for t in threads:
        t.join(5.0)
    assert sorted(got) == [(p, k) for p in range(n_prod) for k in range(per)]
    for p in range(n_prod):  # each producer's items keep their relative order
        assert [k for q, k in got if q == p] == list(range(per))
    assert ch.stats().items_in == ch.stats().items_out == n_prod * per


def test_error_travels_as_a_value_and_skips_capacity():
    ch = Channel(1)
    ch.put("x")  # full
    err = ValueError("upstream broke")
    t0 = time.monotonic()
    ch.put_error(ErrorItem("up", 2, err))  # must not block on a full channel
    assert time.monotonic() - t0 < 1.0
    assert ch.get() == "x"
    item = ch.get()
    assert isinstance(item, ErrorItem)
    assert (item.stage, item.replica, item.error) == ("up", 2, err)
    with pytest.raises(ValueError, match="upstream broke"):
        raise item.error


def test_cancel_wakes_blocked_put_and_get():
    full = Channel(1, name="full")
    full.put(0)
    empty = Channel(1, name="empty")
    outcomes = []

    def blocked_put():
        try:
            full.put(1)
        except ChannelCancelled:
            outcomes.append("put")

    def blocked_get():
        try:
            empty.get()
        except ChannelCancelled:
            outcomes.append("get")

    threads = [_thread(blocked_put), _thread(blocked_get)]
    time.sleep(0.1)
    assert outcomes == []
    full.cancel()
    empty.cancel()
    empty.cancel()  # idempotent
    for t in threads:
        t.join(5.0)
        assert not t.is_alive()
    assert sorted(outcomes) == ["get", "put"]
    assert full.cancelled and empty.cancelled
    with pytest.raises(ChannelCancelled):
        full.put(2)
    with pytest.raises(ChannelCancelled):
        full.get()  # buffered items are not delivered after a cancel


def test_stats_track_depth_in_out():
    ch = Channel(5)
    for i in range(4):
        ch.put(i)
    ch.get()
    st = ch.stats()
    assert (st.depth, st.items_in, st.items_out, st.capacity) == (3, 4, 1, 5)
    assert ch.depth == 3
    assert st.blocked_put_s == 0.0
