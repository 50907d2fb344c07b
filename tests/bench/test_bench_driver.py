"""`just bench` (bench/run_all.py, bench/peers.py): what the peer comparisons need is fetched by its pinned
hash or the command fails naming the one command that would; the default set fits about 15 minutes and
every README benchmark is in some set; each result file gets the command and the machine's load."""

from __future__ import annotations

import json
import time
import zipfile
from pathlib import Path

import pytest
from benchtools import BENCH, load_bench

REPO = Path(__file__).resolve().parents[2]


def test_a_wheel_that_does_not_match_the_pin_is_refused_with_the_command(tmp_path, monkeypatch):
    peers = load_bench("peers")
    monkeypatch.setenv("DFLASH_FLOW_CACHE", str(tmp_path))
    monkeypatch.delenv("DFLASH_SPECFORGE_DIR", raising=False)
    requirement, digest = peers.specforge_pin()
    assert requirement == "specforge==0.2.0" and len(digest) == 64
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "specforge-0.2.0-py3-none-any.whl", "w") as zf:  # a planted, other wheel
        zf.writestr(str(peers.MARKER), "raise SystemExit('must never be imported')\n")
    with pytest.raises(peers.Missing, match=r"does not match the sha256 pinned.*pip download --no-deps --require-hashes -r"):
        peers.ensure_specforge()
    assert not (tmp_path / "specforge-0.2.0").exists()  # nothing unpacked from it
    peer_step = load_bench("peer_step")
    classes, reason = peer_step.import_specforge(fetch=True)
    assert classes is None and "require-hashes" in reason


def test_a_named_specforge_dir_that_is_empty_says_so(tmp_path, monkeypatch):
    peers = load_bench("peers")
    monkeypatch.setenv("DFLASH_SPECFORGE_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(peers.Missing, match="no unpacked SpecForge wheel at .*nowhere"):
        peers.ensure_specforge()


def test_the_default_set_is_short_and_every_readme_benchmark_is_run(tmp_path):
    run_all = load_bench("run_all")
    default = run_all.selected(long=False, only=None)
    assert sum(b.minutes for b in default) <= 16
    assert {"peer_train", "variants"} <= {b.name for b in run_all.BENCHES if b.long}
    everything = run_all.selected(long=True, only=None)
    written = {r for b in everything for r in b.results}
    # Every result file the benchmarks keep is one a set writes (so every README figure is regenerated).
    kept = {p.name for p in (BENCH / "results").glob("*.json")} - {"bench_run.json"}
    assert kept <= written | set(run_all.WRITTEN_ELSEWHERE), sorted(kept - written)
    for name, writer in run_all.WRITTEN_ELSEWHERE.items():  # and those others do write them
        assert f'"{name}"' in (BENCH.parent / writer.split()[0]).read_text(), (name, writer)
    with pytest.raises(SystemExit, match="unknown benchmark"):
        run_all.selected(long=False, only="peer_stepp")


def test_each_result_file_gets_the_command_and_theload_bench(tmp_path):
    run_all = load_bench("run_all")
    out = tmp_path / "x.json"
    run = {"command": "python bench/x.py", "started_unix": int(time.time()), "load_avg_before": run_all.load_avg()}
    assert not run_all.stamp(out, run)  # not written: nothing to stamp
    out.write_text(json.dumps({"figure": 1.0}))
    assert run_all.stamp(out, run)
    data = json.loads(out.read_text())
    assert data["figure"] == 1.0 and data["run"]["command"] == "python bench/x.py"
    assert len(data["run"]["load_avg_before"]) == 3
    old = dict(run, started_unix=int(time.time()) + 3600)  # a file older than this run is not stamped
    assert not run_all.stamp(out, old)
