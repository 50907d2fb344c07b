"""Fixtures of the reliability tests (helpers live in reltools.py; test-only stages in faulty_stages.py
and rel_stages.py)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from reltools import runtime_threads  # noqa: E402


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """These cores are shared: one intra-op thread (two are far slower under contention)."""
    try:
        import torch
    except ImportError:  # pragma: no cover
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _no_runtime_threads_left(tmp_path, monkeypatch):
    """Each test leaves no runtime thread behind and writes nothing into the source tree."""
    monkeypatch.chdir(tmp_path)
    yield
    deadline = time.monotonic() + 10.0
    while runtime_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    left = runtime_threads()
    assert not left, f"runtime threads left behind: {[t.name for t in left]}"
