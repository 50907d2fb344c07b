"""Suite-wide checks. The reference packages the tests compare against must be installed (they are
never skipped: a missing oracle would turn the interop tests into no tests)."""

from __future__ import annotations

import importlib.util
import signal
from pathlib import Path

import pytest


def pytest_configure(config):
    # A shell starts a background job (`cmd &`, a CI runner's) with SIGINT ignored, and every process the
    # tests start would inherit that: the Ctrl-C tests would see their pipelines ignore Ctrl-C. The tests
    # play a user at a terminal, so they get Python's own Ctrl-C (the children then start with the default).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if importlib.util.find_spec("dflash") is None:
        raise pytest.UsageError(
            "the z-lab reference package `dflash` is missing; install it with "
            "`python -m pip install --no-deps -r requirements/reference.txt` (or run `just setup`)"
        )


@pytest.fixture(scope="session")
def tiny_export(tmp_path_factory) -> tuple[Path, Path, str]:
    """(drafter export, prompts file, target): an untrained one-layer drafter (block 4) of the embedded
    target, exported, and three of the embedded held-out prompts."""
    import torch

    from dflash_flow.embedded import embedded_target_path, write_eval_prompts
    from dflash_flow.model.drafter import DFlashDrafter
    from dflash_flow.model.drafter_config import make_drafter_config
    from dflash_flow.model.export import save_drafter
    from dflash_flow.model.target import load_target

    root = tmp_path_factory.mktemp("tiny-export")
    target = embedded_target_path()
    model = load_target(target, dtype=torch.float32)
    torch.manual_seed(0)
    save_drafter(DFlashDrafter(make_drafter_config(model.config, num_layers=1, block_size=4, mask_token_id=0)),
                 root / "drafter")
    return root / "drafter", write_eval_prompts(root / "prompts.jsonl", 3), target
