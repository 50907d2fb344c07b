"""Fixtures for the model tests (helpers live in model_testlib.py)."""

from __future__ import annotations

import pytest
import torch
from model_testlib import build_target


@pytest.fixture(scope="module")
def target():
    return build_target()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(1234)
    yield
