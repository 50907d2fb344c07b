"""Fixtures for the embedded default: the shipped target, loaded once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def target_dir():
    from dflash_flow.embedded.train_target import ASSET_DIR, ensure_target, is_complete

    # The target is committed with the repository: the tests check the shipped asset, not a fresh build.
    assert is_complete(ASSET_DIR), f"shipped target missing under {ASSET_DIR}"
    path = ensure_target()
    assert path == ASSET_DIR
    return path


@pytest.fixture(scope="session")
def target(target_dir):
    """(model, tokenizer) of the shipped target, float32, eval mode, one thread (shared CI cores)."""
    import torch

    from dflash_flow.embedded.train_target import load_model_and_tokenizer

    torch.set_num_threads(1)
    return load_model_and_tokenizer(target_dir)
