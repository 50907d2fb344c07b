"""The drafter's side of decoding: DraftSettings, draft_settings, features and BlockDrafter."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional as F

from .decoding import crop_cache, new_cache, target_device
from .dflash2 import is_dflash2_config, select_proposal
from .drafter_config import draft_value


def _draft_setting(drafter: nn.Module, name: str, default: Any = None) -> Any:
    """A DFlash setting from the drafter: attribute, then config.dflash_config, then config."""
    value = getattr(drafter, name, None)
    if value is not None:
        return value
    config = getattr(drafter, "config", None)
    return draft_value(config, name, default) if config is not None else default


def features(hidden_states: Sequence[torch.Tensor], layer_ids: Sequence[int]) -> torch.Tensor:
    """The drafter's context features from HF ``hidden_states``: the feature of target layer ``id`` is
    ``hidden_states[id + 1]`` (entry 0 is the embeddings), concatenated along the hidden dimension."""
    return torch.cat([hidden_states[i + 1] for i in layer_ids], dim=-1)


@attrs.frozen
class DraftSettings:
    """The DFlash settings a decoding loop needs (see :func:`draft_settings`)."""

    block_size: int
    mask_token_id: int | None
    layer_ids: list[int]
    embed_scale: float = 1.0


def draft_settings(drafter: nn.Module, *, block_size: int | None = None, mask_token_id: int | None = None,
                   target_layer_ids: Sequence[int] | None = None) -> DraftSettings:
    """Block size, mask token and target layers: the arguments where given, else the drafter's own
    (``drafter.block_size`` / ``config.dflash_config``). Raises ValueError when something is missing."""
    size = int(block_size if block_size is not None else _draft_setting(drafter, "block_size", 16))
    if size < 1:
        raise ValueError("block_size must be >= 1")
    mask = mask_token_id if mask_token_id is not None else _draft_setting(drafter, "mask_token_id")
    ids = target_layer_ids if target_layer_ids is not None else _draft_setting(drafter, "target_layer_ids")
    layer_ids = [int(i) for i in (ids or ())]
    if size > 1 and (mask is None or not layer_ids):
        raise ValueError("mask_token_id and target_layer_ids are needed (pass them or set them in the drafter config)")
    scale = float(_draft_setting(drafter, "input_embedding_scale", 1.0) or 1.0)
    return DraftSettings(size, None if mask is None else int(mask), layer_ids, scale)


class BlockDrafter:
    """The drafter's side of one decoding (real, and the teacher-forced walk, fed identically): its KV cache
    of context features (each enters once; cropped back to the block's start after every call), the embedding
    of each block, and the logits of the block's draft slots."""

    def __init__(self, target: nn.Module, drafter: nn.Module, settings: DraftSettings) -> None:
        self.drafter = drafter
        self.settings = settings
        p = next(drafter.parameters(), None)
        self.device = p.device if p is not None else target_device(target)
        self.embed_weight = target.get_input_embeddings().weight.to(self.device)
        head = target.get_output_embeddings()
        self.lm_head = head if head is not None else target.lm_head
        self.cache = new_cache(drafter.config) if hasattr(drafter, "config") else None
        #: A DFlash 2 drafter (ours or z-lab's, by its config): its drafts are its candidate selector's walk.
        self.selects = is_dflash2_config(getattr(drafter, "config", None))
        self.calls = 0

    def fork(self) -> BlockDrafter:
        """A copy that shares the models and owns a copy of the cache: driven from here on, it computes exactly
        what this one would (the teacher-forced walk forks where a shorter horizon starts to differ)."""
        twin = copy.copy(self)
        twin.cache = copy.deepcopy(self.cache)
        return twin

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hasattr(self.drafter, "compute_logits"):
            return self.drafter.compute_logits(hidden, self.lm_head)
        return self.lm_head(hidden)

    def propose(self, block: torch.Tensor, context: torch.Tensor, start: int, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts ``[1, v - 1]`` for the slots 1.. of ``block``, and at ``temperature > 0`` their proposal
        distribution ``[v - 1, V]`` (float32). A plain drafter proposes its argmax (sampling its logits is
        :func:`spec_generate`'s business); a DFlash 2 drafter its selector's walk (z-lab's ``propose``: greedy,
        or one draw per slot from the softmax of the candidate scores; zero outside the candidates)."""
        hidden = self.hidden(block, context, start)
        logits = self._logits(hidden)
        if not self.selects:
            return logits.argmax(dim=-1), None
        return select_proposal(self.drafter.candidate_selector, hidden, logits, block[:, 0].to(hidden.device),
                               temperature=temperature, generator=generator)

    def greedy_drafts(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        """The greedy drafts ``[v - 1]`` of ``block`` (argmax, or a DFlash 2 drafter's selector walk)."""
        return self.propose(block, context, start)[0][0]

    def hidden(self, block: torch.Tensor, context: torch.Tensor, start: int) -> torch.Tensor:
        """The drafter's normed hidden states ``[1, v - 1, H]`` of the slots 1.. of ``block`` ``[1, v]`` (its
        first token at position ``start``); ``context`` ``[1, c, F]``: the features of positions
        ``start - c .. start - 1`` not yet in the cache."""
        verify = block.shape[1]
        noise = F.embedding(block.to(self.device), self.embed_weight)
        if self.settings.embed_scale != 1.0:
            noise = noise * self.settings.embed_scale
        ctx_len = context.shape[1]
        positions = torch.arange(start - ctx_len, start + verify, device=self.device)[None]
        hidden = self.drafter(position_ids=positions, noise_embedding=noise, target_hidden=context.to(self.device),
                              attention_mask=None, past_key_values=self.cache, use_cache=True)
        if not isinstance(hidden, torch.Tensor):  # a ModelOutput-returning drafter
            hidden = hidden[0]
        self.calls += 1
        # The cache now holds context + block; the block part is stale once the target decides.
        if self.cache is not None:
            crop_cache(self.cache, start)
        return hidden[:, 1:verify, :]
