"""A checkpoint's state.json read for its run id costs its own size, not the 256 MiB limit (issue 40.16)."""

from __future__ import annotations

import json
import tracemalloc

from dflash_flow.app.checkpoint import _run_uid_of


def test_reading_a_small_state_json_allocates_about_its_size(tmp_path):
    (tmp_path / "state.json").write_text(json.dumps({"run_uid": "abc", "step": 3}))
    tracemalloc.start()
    try:
        assert _run_uid_of(tmp_path) == "abc"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, f"{peak} bytes allocated to read a {(tmp_path / 'state.json').stat().st_size}-byte file"
