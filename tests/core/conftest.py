"""Fixtures for the core runtime tests: test stages registered, no thread left behind."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from stages_for_tests import runtime_threads  # noqa: E402 - also registers the Test* stages


@pytest.fixture(autouse=True)
def _no_runtime_threads_left(tmp_path, monkeypatch):
    """Every test in this directory must leave no runtime thread behind (and no `runs/` in the tree)."""
    monkeypatch.chdir(tmp_path)  # pipelines create ./runs/NAME by default
    yield
    deadline = time.monotonic() + 5.0
    while runtime_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = runtime_threads()
    assert not left, f"runtime threads left behind: {[t.name for t in left]}"


@pytest.fixture
def thread_baseline():
    """The set of live threads before the test; compare with ``wait_threads_back``."""
    return set(threading.enumerate())
