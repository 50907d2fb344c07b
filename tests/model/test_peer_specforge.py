"""Same loss and gradients as SpecForge 0.2's ``OnlineDFlashModel`` on identical inputs and anchors.

SpecForge cannot be installed beside our torch; ``bench/peer_step.py`` imports its DFlash modules from
an unpacked wheel (``DFLASH_SPECFORGE_DIR``, default ``~/.cache/dflash-flow/specforge-0.2.0``). Without
it this test is skipped; ``test_objective.py::test_fast_path_equals_dense_reference`` pins our loss to
the dense-mask reference either way.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

PEER = Path(__file__).resolve().parents[2] / "bench" / "peer_step.py"


def load_peer():
    spec = importlib.util.spec_from_file_location("peer_step", PEER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("case", ["peer", "embedded_8x256"])
def test_loss_and_gradients_equal_specforge(case):
    peer = load_peer()
    classes, reason = peer.import_specforge()
    if classes is None:
        pytest.skip(reason)
    # Ragged rows: ours gets the attention mask, SpecForge has none; right padding lies after every
    # anchor (context is c < anchor), so the two must still agree.
    c = peer.build_case(peer.CASES[case])
    ours, our_step = peer.make_ours(c)
    theirs, their_step = peer.make_specforge(c, classes)
    anchors = peer.draw_anchors(c, seed=0)
    a, b = our_step(anchors), their_step(anchors)
    assert abs(a.item() - b.item()) <= 1e-5
    mine = dict(ours.named_parameters())
    for name, p in theirs.named_parameters():
        torch.testing.assert_close(mine[name].grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
