"""The token store: entries are memory-mapped, damaged or half-written ones are rebuilt and never
trusted, and processes sharing a cold cache tokenize an input once (the others wait and map it)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_flow.data.records import ReadOptions, read_records
from dflash_flow.data.store import EntryWriter

HERE = Path(__file__).parent


def _tokens_jsonl(f: Path, rows: int) -> Path:
    rng = np.random.default_rng(1)
    with f.open("w") as out:
        for i in range(rows):
            n = int(rng.integers(8, 60))
            out.write(json.dumps({"input_ids": rng.integers(0, 1000, n).tolist(), "loss_mask": [0, 1] * (n // 2) + [1] * (n % 2)}) + "\n")
            if i == 17:
                out.write("{broken\n")
    return f


@pytest.fixture(scope="module")
def token_input(tmp_path_factory):
    """Pre-tokenized JSONL big enough that reading it takes a moment (~1 s), so a second process overlaps."""
    return _tokens_jsonl(tmp_path_factory.mktemp("store") / "tokens.jsonl", 20_000)


@pytest.fixture(scope="module")
def small_input(tmp_path_factory):
    return _tokens_jsonl(tmp_path_factory.mktemp("store") / "small.jsonl", 2_000)


def _read(path, cache):
    return read_records(path, options=ReadOptions(cache_dir=cache, num_workers=0), kind="tokens")


def _entry(cache: Path) -> Path:
    (entry,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return entry


def _same(a, b) -> None:
    for k in ("ids", "mask", "offsets", "lines"):
        assert np.array_equal(np.asarray(getattr(a, k)), np.asarray(getattr(b, k))), k
    assert a.report.bad_records == b.report.bad_records


def _in_memory(tf):
    import attrs

    return attrs.evolve(tf, **{k: np.array(getattr(tf, k)) for k in ("ids", "mask", "offsets", "lines")})


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("damage", ["truncate_ids", "flip_mask_byte", "garbage_manifest", "edit_report", "delete_lines"])
def test_a_damaged_entry_is_rebuilt_never_trusted(small_input, tmp_path, damage):
    token_input = small_input
    cache = tmp_path / "cache"
    first = _read(token_input, cache)
    assert not first.report.from_cache and first.report.bad_by_reason == {"invalid_json": 1}
    first = _in_memory(first)  # the damage below is done to the very files it maps
    entry = _entry(cache)
    if damage == "truncate_ids":
        os.truncate(entry / "ids.i32", (entry / "ids.i32").stat().st_size - 4)
    elif damage == "flip_mask_byte":  # same size, one byte in the middle: only the digest can tell
        _flip(entry / "mask.u8", (entry / "mask.u8").stat().st_size // 2)
    elif damage == "garbage_manifest":
        (entry / "manifest.json").write_text("{not json")
    elif damage == "edit_report":
        (entry / "report.json").write_text((entry / "report.json").read_text().replace('"bad": 1', '"bad": 0'))
    else:
        (entry / "lines.i64").unlink()
    again = _read(token_input, cache)
    assert not again.report.from_cache  # rebuilt
    _same(again, first)
    assert _read(token_input, cache).report.from_cache  # and trusted again once rebuilt
    assert [p.name for p in cache.iterdir() if ".trash-" in p.name or ".tmp-" in p.name] == []


def test_warm_entries_are_memory_maps(small_input, tmp_path):
    token_input = small_input
    _read(token_input, tmp_path / "c")
    warm = _read(token_input, tmp_path / "c")
    assert warm.report.from_cache
    for k in ("ids", "mask", "offsets", "lines"):
        assert isinstance(getattr(warm, k), np.memmap), k


def _rank(path, cache, start_at):
    return subprocess.Popen([sys.executable, str(HERE / "rank_reader.py"), str(path), str(cache), str(start_at)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=HERE)


def test_two_processes_on_one_cold_cache_tokenize_once(token_input, tmp_path):
    cache = tmp_path / "shared"
    start = time.time() + 2.0  # both import first, then start together
    procs = [_rank(token_input, cache, start) for _ in range(2)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(o["built"] for o in outs) == [False, True]  # exactly one tokenized
    waiter = next(o for o in outs if not o["built"])
    assert "waiting" in waiter["states"] and "cached" in waiter["states"]
    assert outs[0]["digest"] == outs[1]["digest"]


def test_a_builder_killed_mid_write_leaves_nothing_trusted(token_input, tmp_path):
    cache = tmp_path / "killed"
    p = _rank(token_input, cache, 0)
    deadline = time.time() + 60
    while not list(cache.glob(".*.progress")) and time.time() < deadline:  # it has written part of the entry
        time.sleep(0.02)
    assert list(cache.glob(".*.tmp-*")), "the builder should be writing its temporary entry"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert [q for q in cache.iterdir() if q.is_dir() and not q.name.startswith(".")] == []  # nothing published
    tf = _read(token_input, cache)  # the kernel released the dead builder's lock: we build
    assert not tf.report.from_cache
    assert not list(cache.glob(".*.tmp-*"))  # its leftovers are gone
    _same(tf, _read(token_input, tmp_path / "fresh"))


def test_two_unlocked_builders_publishing_one_entry_keep_one_whole_copy(tmp_path):
    final = tmp_path / "entry"
    writers = [EntryWriter(final) for _ in range(2)]
    for k, w in enumerate(writers):
        w.append(np.arange(6, dtype=np.int32) + k, np.ones(6, np.uint8), np.array([2, 4]), np.array([1, 2]))
    assert writers[0].finish({"n": 0}, {}) == final
    assert writers[1].finish({"n": 1}, {}) == final  # the second rename loses; the first copy stays whole
    assert np.fromfile(final / "ids.i32", dtype="<i4").tolist() == list(range(6))
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
