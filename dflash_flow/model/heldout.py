"""Acceptance over time: the teacher-forced walk (``model.walk``) on a fixed held-out sample, measured while
the drafter trains. :meth:`HeldoutProbe.prepare` runs the target once and keeps the features; a measurement is
drafter calls only, draws no random numbers and leaves the drafter's weights, mode and gradients as they were
(a run with the probe trains exactly as one without it).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

from .block_drafter import BlockDrafter, draft_settings
from .decoding import eval_mode
from .walk import WalkInput, walk_features, walk_inputs

__all__ = ["HeldoutProbe", "ProbeResult", "prepare_probe"]


@attrs.frozen
class ProbeResult:
    """One measurement: ``tau`` (the walk's, over all blocks of the sample), the blocks walked, the seconds."""

    tau: float
    blocks: int
    seconds: float


class HeldoutProbe:
    """A fixed held-out sample, ready to walk any number of times."""

    def __init__(self, inputs: Sequence[WalkInput], *, horizon: int, layer_ids: Sequence[int]) -> None:
        if not inputs:
            raise ValueError("the held-out probe needs at least one conversation")
        if horizon < 1:
            raise ValueError(f"heldout horizon must be >= 1, got {horizon}")
        self.inputs = list(inputs)
        self.horizon = int(horizon)
        self.layer_ids = [int(i) for i in layer_ids]

    @classmethod
    def prepare(cls, target: nn.Module, conversations: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                horizon: int, layer_ids: Sequence[int], stop_token_ids: Sequence[int] | None = None,
                device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> HeldoutProbe:
        """Run ``target`` once over each ``(prompt ids, reply ids)`` (``walk.walk_inputs``) and keep what the walks
        need on ``device`` in ``dtype`` (the drafter's); the target can be freed afterwards."""
        dev = torch.device(device)
        inputs = [attrs.evolve(inp, seq=inp.seq.to(dev), feats=inp.feats.to(device=dev, dtype=dtype))
                  for inp in walk_inputs(target, conversations, longest=horizon, layer_ids=layer_ids,
                                         stop_token_ids=stop_token_ids)]
        return cls(inputs, horizon=horizon, layer_ids=layer_ids)

    def measure(self, drafter: nn.Module, head: Any) -> ProbeResult:
        """Walk the sample with ``drafter`` (in eval mode for the walk, restored after) and ``head`` (the
        target's embedding and LM head: a ``model.head.SharedHead`` or the target itself)."""
        t0 = time.perf_counter()
        settings = draft_settings(drafter, target_layer_ids=self.layer_ids)
        committed = blocks = 0
        with eval_mode(drafter):
            for inp in self.inputs:
                r = walk_features(BlockDrafter(head, drafter, settings), inp, self.horizon)
                committed += sum(r.accept_lengths)
                blocks += len(r.accept_lengths)
        return ProbeResult(committed / blocks if blocks else 1.0, blocks, time.perf_counter() - t0)


def prepare_probe(knobs: Any, path: str | Path, *, target: Any, tokenizer_path: str | None, trust_remote_code: bool,
                  layer_ids: Sequence[int], device: str, dtype: torch.dtype) -> HeldoutProbe:
    """The probe over the first ``knobs.heldout_limit`` conversations of ``path`` (the target loaded for it,
    under the model-load lock, and freed)."""
    from transformers import AutoTokenizer

    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.model import MODEL_LOAD_LOCK
    from dflash_flow.model.evaluation import read_walk_conversations
    from dflash_flow.model.target import load_target

    if tokenizer_path is None:
        raise ValueError("heldout_data needs a tokenizer (set model.tokenizer)")
    with MODEL_LOAD_LOCK:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, local_files_only=True)
        stops = stop_token_ids(tokenizer)
        conversations = read_walk_conversations(Path(path), tokenizer, knobs.heldout_limit, stops)
        # only as deep as the deepest feature layer: the layers above and the LM head are never read
        model = load_target(target, device=device, dtype=dtype, trust_remote_code=trust_remote_code,
                            num_layers=max(layer_ids) + 1)
        try:
            return HeldoutProbe.prepare(model, conversations, horizon=knobs.heldout_horizon, layer_ids=layer_ids,
                                        stop_token_ids=stops, device=device, dtype=dtype)
        finally:
            del model
