"""Suite-wide checks. The reference packages the tests compare against must be installed (they are
never skipped: a missing oracle would turn the interop tests into no tests)."""

from __future__ import annotations

import importlib.util

import pytest


def pytest_configure(config):
    if importlib.util.find_spec("dflash") is None:
        raise pytest.UsageError(
            "the z-lab reference package `dflash` is missing; install it with "
            "`python -m pip install --no-deps -r requirements/reference.txt` (or run `just setup`)"
        )
