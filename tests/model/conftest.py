"""Fixtures for the model tests (helpers live in model_testlib.py)."""

from __future__ import annotations

import pytest
import torch
from model_testlib import build_target


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module's tests (tiny models on a shared 2-core machine run many
    times faster than with two contended threads), restored after it; ``usefixtures("one_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target():
    return build_target()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield
