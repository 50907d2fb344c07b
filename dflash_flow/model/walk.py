"""The teacher-forced walk: a held-out acceptance length that predicts real greedy decoding at a fraction of
its cost. One target forward over prompt + reply gives every position's features; the drafter then drafts each
block as :func:`generation.spec_generate` does, committing its longest prefix equal to the reference plus the
bonus. It equals real decoding when the reply is the target's greedy output (up to near-tie argmaxes).
:class:`HeldoutProbe`: the walk on a fixed held-out sample while the drafter trains.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from dflash_flow.items import EvalReport

from .batched import SMALL_ROWS, BatchDrafter, RowExact, RowPlan, batchable
from .block_drafter import BlockDrafter, draft_settings, features
from .decoding import eval_mode, reply_until_stop, target_device
from .features import TargetFeatureExtractor

WALK = "walk"

#: Conversations per batched target forward of :func:`walk_inputs` (sorted by length).
WALK_INPUT_ROWS = 8

__all__ = ["WALK", "HeldoutProbe", "ProbeResult", "WalkInput", "WalkResult", "batched_walk_settings", "evaluate_walk",
           "reply_until_stop", "teacher_forced_walk", "walk_batch", "walk_features", "walk_input", "walk_inputs"]


@attrs.frozen
class WalkResult:
    """One walk: ``accept_lengths[i]`` tokens committed by block ``i`` (bonus included); ``tokens`` reply tokens
    covered (the prefill's included); ``complete``: it ended at the horizon or a stop, not a truncated reply."""

    accept_lengths: list[int]
    tokens: int
    complete: bool

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


@attrs.define
class _Position:
    """Where a walk stands: the next block's ``start``, the ``pending`` features, each block's ``lengths``."""

    start: int
    pending: torch.Tensor
    lengths: list[int]

    def copy(self) -> _Position:
        return _Position(self.start, self.pending, list(self.lengths))

    def settle(self, inp: WalkInput, horizon: int, block_size: int, forks: Any,
               hand_over: Callable[[int], None]) -> int | None:
        """Advance to the next drafter call and return its block's size; None at the walk's end. A shorter horizon
        ``h`` in ``forks`` takes the same steps while ``start + block_size + 1 <= n_in + h``: ``hand_over(h)``
        (which removes it) runs before, or at the end for those still there (a stop, the reply's end)."""
        max_length, end = inp.n_in + horizon, inp.n_in + inp.reply_len - 1
        while True:
            for h in [h for h in forks if self.start + block_size + 1 > inp.n_in + h]:
                hand_over(h)
            if not (self.start + 1 < max_length and self.start < end):
                for h in list(forks):
                    hand_over(h)
                return None
            verify = min(block_size, max_length - self.start)
            if verify > 1:
                return verify
            self.advance(inp, horizon, None)

    def advance(self, inp: WalkInput, horizon: int, drafts: torch.Tensor | None) -> None:
        """Commit the longest prefix of ``drafts`` equal to the reference, plus the bonus (real decoding's ends)."""
        start, end = self.start, inp.n_in + inp.reply_len - 1  # end: the last reference position
        accepted = 0
        if drafts is not None:
            ref = inp.seq[start + 1 : min(start + drafts.numel() + 1, end + 1)]
            accepted = int((drafts.to(ref.device)[: ref.numel()] == ref).int().cumprod(0).sum())
        produced = min(accepted + 1, inp.n_in + horizon - start - 1, end - start)
        self.pending = inp.feats[:, start : start + produced]
        self.start = start + produced
        self.lengths.append(produced)

    def result(self, inp: WalkInput, horizon: int) -> tuple[list[int], int, bool]:
        """:class:`WalkResult`'s fields."""
        max_length = inp.n_in + horizon
        complete = self.start + 1 >= max_length or (self.start == inp.n_in + inp.reply_len - 1 and inp.stopped)
        return self.lengths, min(self.start + 1, max_length) - inp.n_in, complete


@torch.inference_mode()
def walk_features(proposer: BlockDrafter, inp: WalkInput, horizon: int, at: _Position | None = None,
                  forks: dict[int, Callable[[BlockDrafter, _Position], None]] | None = None) -> WalkResult:
    """Walk one prepared conversation at ``horizon`` with a fresh ``proposer``, from the start or ``at``. ``forks``:
    shorter horizons, each called once with a proposer fork where its walk first differs (:func:`_walk_horizons`)."""
    settings, seq, horizon = proposer.settings, inp.seq, int(horizon)
    pos = at or _Position(inp.n_in, inp.feats[:, : inp.n_in], [])
    pending = dict(forks or {})
    mask = settings.mask_token_id if settings.mask_token_id is not None else 0

    def hand_over(h: int) -> None:
        pending.pop(h)(proposer.fork(), pos.copy())

    while (verify := pos.settle(inp, horizon, settings.block_size, pending, hand_over)) is not None:
        block = torch.full((1, verify), mask, dtype=torch.long, device=seq.device)
        block[0, 0] = seq[pos.start]
        # The drafts real greedy decoding would verify: the argmax, or a DFlash 2 selector's walk.
        pos.advance(inp, horizon, proposer.greedy_drafts(block, pos.pending, pos.start))
    return WalkResult(*pos.result(inp, horizon))


@attrs.define
class _WalkRow(_Position):
    """One walk (a conversation at one horizon) of :func:`walk_batch`."""

    conv: int = 0
    horizon: int = 0
    forks: list[int] = attrs.field(factory=list)
    draft_row: int = 0
    calls: int = 0


@torch.inference_mode()
def walk_batch(target: nn.Module, drafter: nn.Module, inputs: Sequence[WalkInput], horizons: Sequence[int],
               settings: Any) -> list[tuple[dict[int, Any], int]]:
    """:func:`_walk_horizons` of every prepared conversation, all drafting together (``batched.BatchDrafter``):
    per conversation :class:`WalkResult`'s fields per horizon and its drafter calls, each the one-conversation
    result (shorter horizons fork rows from the longest's at the same step)."""
    longest, *shorter = sorted({int(h) for h in horizons}, reverse=True)
    mask = settings.mask_token_id if settings.mask_token_id is not None else 0
    drafts = BatchDrafter(target, drafter, settings)
    results: list[dict[int, Any]] = [{} for _ in inputs]
    calls = [0] * len(inputs)
    live = [_WalkRow(inp.n_in, inp.feats[:, : inp.n_in], [], conv=c, horizon=longest, forks=list(shorter),
                     draft_row=drafts.cache.add_row()) for c, inp in enumerate(inputs)]
    work: list[_WalkRow] = []
    while live:
        waiting: dict[int, list[_WalkRow]] = {}
        work.extend(live)
        while work:
            r = work.pop(0)

            def hand_over(h: int, r: _WalkRow = r) -> None:
                r.forks.remove(h)
                work.append(_WalkRow(r.start, r.pending, list(r.lengths), conv=r.conv, horizon=h,
                                     draft_row=drafts.cache.fork_row(r.draft_row)))

            verify = r.settle(inputs[r.conv], r.horizon, settings.block_size, r.forks, hand_over)
            if verify is None:
                results[r.conv][r.horizon] = r.result(inputs[r.conv], r.horizon)
                calls[r.conv] += r.calls
            else:
                waiting.setdefault(verify, []).append(r)
        live = [r for group in waiting.values() for r in group]
        for verify, group in waiting.items():
            blocks = torch.full((len(group), verify), mask, dtype=torch.long)
            for g, r in enumerate(group):
                blocks[g, 0] = inputs[r.conv].seq[r.start]
            proposed = drafts.greedy_drafts([r.draft_row for r in group], blocks, [r.pending for r in group],
                                            [r.start for r in group])
            for g, r in enumerate(group):
                r.calls += 1
                r.advance(inputs[r.conv], r.horizon, proposed[g])
    return [(results[c], calls[c]) for c in range(len(inputs))]


def _walk_horizons(proposer: BlockDrafter, inp: WalkInput, horizons: Sequence[int]) -> tuple[dict[int, WalkResult], int]:
    """The walk at every horizon and the drafter calls it took: each shorter horizon forks from the longest
    where its first step would differ, so shared blocks are drafted once; each result equals a walk alone."""
    longest, *shorter = sorted({int(h) for h in horizons}, reverse=True)
    results: dict[int, WalkResult] = {}
    calls = [0]

    def walk(h: int, prop: BlockDrafter, at: _Position | None, forks=None) -> None:
        before = prop.calls
        results[h] = walk_features(prop, inp, h, at, forks)
        calls[0] += prop.calls - before

    walk(longest, proposer, None, {h: (lambda p, at, h=h: walk(h, p, at)) for h in shorter})
    return results, calls[0]


@attrs.frozen
class WalkInput:
    """One conversation ready to walk (:func:`walk_input`): prompt + reply (cut after the first stop token) and
    the target's features over them; walking it again needs only drafter calls."""

    seq: torch.Tensor
    feats: torch.Tensor
    n_in: int
    reply_len: int
    stopped: bool


def _walk_sequence(prompt_ids, reply_ids, longest: int, stop_token_ids, device) -> tuple[torch.Tensor, int, int, bool]:
    """(prompt + reply cut after its first stop, target forward width, reply length, whether it stopped)."""
    if not len(prompt_ids) or not len(reply_ids):
        raise ValueError("the walk needs a non-empty prompt and reply")
    reply, stopped = reply_until_stop(reply_ids, stop_token_ids)
    n_in = len(prompt_ids)
    longest = min(int(longest), len(reply))
    seq = torch.tensor([*map(int, prompt_ids), *reply], dtype=torch.long, device=device)
    # Features up to the last position a block can start at (the reply's last token is only ever a bonus).
    return seq, n_in + max(longest - 1, 0), len(reply), stopped


@torch.inference_mode()
def walk_input(target: nn.Module, prompt_ids: Sequence[int], reply_ids: Sequence[int], *, longest: int,
               layer_ids: Sequence[int], stop_token_ids: Sequence[int] | None = None) -> WalkInput:
    """The target's side of a walk up to ``longest`` new tokens: one forward over prompt + reply."""
    seq, width, reply_len, stopped = _walk_sequence(prompt_ids, reply_ids, longest, stop_token_ids,
                                                    target_device(target))
    out = target(input_ids=seq[None, :width], output_hidden_states=True, use_cache=False)
    return WalkInput(seq, features(out.hidden_states, layer_ids), len(prompt_ids), reply_len, stopped)


@torch.inference_mode()
def walk_inputs(target: nn.Module, conversations: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                longest: int, layer_ids: Sequence[int],
                stop_token_ids: Sequence[int] | None = None) -> list[WalkInput]:
    """:func:`walk_input` of each ``(prompt, reply)``, bit for bit, run no deeper than the deepest feature layer.
    For models ``batched.batchable`` accepts, ``WALK_INPUT_ROWS`` of like length go together, right-padded, under
    ``batched.RowExact`` (each row's attention as the one-row call's); other models one conversation a call."""
    device = target_device(target)
    prepared = [_walk_sequence(p, r, longest, stop_token_ids, device) for p, r in conversations]
    widths = [w for _, w, _, _ in prepared]
    extract = TargetFeatureExtractor(target, layer_ids, zero_padding=False)
    feats: list[torch.Tensor] = [torch.empty(0)] * len(prepared)
    together = batchable(target)
    for g, (seq, width, _, _) in enumerate(prepared):
        if not together or width < SMALL_ROWS:  # the one-row call (1-3 tokens: the linear rule's small rows)
            feats[g] = extract(seq[None, :width])
    order = sorted((g for g in range(len(prepared)) if together and widths[g] >= SMALL_ROWS), key=widths.__getitem__)
    for part in (order[lo : lo + WALK_INPUT_ROWS] for lo in range(0, len(order), WALK_INPUT_ROWS)):
        lens = [widths[g] for g in part]
        ids = torch.zeros(len(part), max(lens), dtype=torch.long, device=device)
        for i, g in enumerate(part):
            ids[i, : lens[i]] = prepared[g][0][: lens[i]]
        plan = RowPlan(rows=list(range(len(part))), q_lens=lens, kv_lens=lens, causal=False,
                       axes={ids.shape[1]: lens})
        with RowExact(plan, None):  # no mask: the one-row call's causal SDPA, row by row
            out = extract(ids)
        for i, g in enumerate(part):
            feats[g] = out[i : i + 1, : lens[i]].clone()
    return [WalkInput(seq, feats[g], len(prompt), reply_len, stopped)
            for g, ((prompt, _), (seq, _, reply_len, stopped)) in enumerate(zip(conversations, prepared, strict=True))]


def teacher_forced_walk(target: nn.Module, drafter: nn.Module, prompt_ids: Sequence[int],
                        reply_ids: Sequence[int], *, horizons: Sequence[int],
                        stop_token_ids: Sequence[int] | None = None, block_size: int | None = None,
                        mask_token_id: int | None = None,
                        target_layer_ids: Sequence[int] | None = None) -> dict[int, WalkResult]:
    """Walk the reference ``reply_ids`` (cut after its first stop token) after ``prompt_ids`` at each horizon
    (``max_new_tokens`` of real decoding): one target forward, the shared blocks drafted once. Greedy only."""
    settings = dict(block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=target_layer_ids)
    return next(_walks(target, drafter, [(prompt_ids, reply_ids)], horizons, stop_token_ids, 1, settings))[0]


def batched_walk_settings(target: nn.Module, drafter: nn.Module, conversations: int, batch_size: int,
                          **settings: Any) -> Any:
    """The draft settings (``block_drafter.DraftSettings``) when a walk of ``conversations`` at ``batch_size``
    drafts in batches (the models allow it: ``batched.batchable``), else None (one conversation at a time)."""
    resolved = draft_settings(drafter, **settings)
    if batch_size <= 1 or conversations < 2 or resolved.block_size < 2 or not batchable(target, drafter):
        return None
    return resolved


def _walks(target, drafter, conversations, horizons, stop_token_ids, batch_size: int, settings: dict,
           prepared: Sequence[WalkInput] = ()):
    """Per conversation: ``(results by horizon, drafter calls, reply ids)``, ``batch_size`` at a time."""
    if not horizons or min(horizons) < 1:
        raise ValueError("horizons must be a non-empty list of integers >= 1")
    resolved = batched_walk_settings(target, drafter, len(conversations), batch_size, **settings)
    if resolved is None:  # one conversation at a time
        for prompt, reply in conversations:
            if not len(prompt) or not len(reply):
                raise ValueError("the walk needs a non-empty prompt and reply")
            alone = draft_settings(drafter, **settings)
            if alone.block_size < 2:
                raise ValueError("the walk needs block_size >= 2 (a drafter that proposes)")
            inp = walk_input(target, prompt, reply, longest=max(horizons), layer_ids=alone.layer_ids,
                             stop_token_ids=stop_token_ids)
            with eval_mode(drafter), torch.inference_mode():
                results, calls = _walk_horizons(BlockDrafter(target, drafter, alone), inp, horizons)
            yield {int(h): results[int(h)] for h in horizons}, calls, reply
        return
    with eval_mode(drafter):
        for lo in range(0, len(conversations), batch_size):
            part = conversations[lo : lo + batch_size]
            inputs = list(prepared[lo : lo + batch_size])
            inputs += walk_inputs(target, part[len(inputs) :], longest=max(horizons), layer_ids=resolved.layer_ids,
                                  stop_token_ids=stop_token_ids) if len(inputs) < len(part) else []
            for (results, n_calls), (_, reply) in zip(walk_batch(target, drafter, inputs, horizons, resolved), part,
                                                      strict=True):
                yield {int(h): WalkResult(*results[int(h)]) for h in horizons}, n_calls, reply


def evaluate_walk(target: nn.Module, drafter: nn.Module,
                  conversations: Sequence[tuple[Sequence[int], Sequence[int]]], *, horizons: Sequence[int],
                  stop_token_ids: Sequence[int] | None = None, on_unit: Callable[[int], None] | None = None,
                  batch_size: int = 1, prepared: Sequence[WalkInput] = (), **settings: Any) -> EvalReport:
    """The walk over held-out ``(prompt ids, reply ids)`` pairs, as the typed report ``walk``. ``on_unit(tokens)``
    follows each conversation (it may raise to abandon). ``batch_size`` > 1 drafts that many together
    (:func:`walk_batch`, same figures) where the models allow; ``prepared``: the first conversations'
    :func:`walk_inputs`, already computed. ``by_horizon``: ``tau`` (tokens per block), ``verify_steps``,
    ``tokens_walked``, ``complete_frac``; ``metrics``: ``tau`` at the first horizon and ``drafter_forwards``.
    """
    if not conversations:
        raise ValueError("no conversations to walk")
    sums = {int(h): (0, 0, 0, 0) for h in horizons}  # blocks, tokens committed, tokens walked, complete
    calls = 0
    for results, n_calls, reply in _walks(target, drafter, conversations, horizons, stop_token_ids, batch_size,
                                          settings, prepared):
        for h, r in results.items():
            got = (len(r.accept_lengths), sum(r.accept_lengths), r.tokens, int(r.complete))
            sums[h] = tuple(a + b for a, b in zip(sums[h], got, strict=True))
        calls += n_calls
        if on_unit is not None:
            on_unit(len(reply))
    n = len(conversations)
    first = int(horizons[0])
    by_horizon = {h: {"tau": c / s if s else 1.0, "verify_steps": float(s), "tokens_walked": float(t),
                      "complete_frac": k / n} for h, (s, c, t, k) in sums.items()}
    metrics = {"tau": by_horizon[first]["tau"], "drafter_forwards": float(calls)}
    return EvalReport(name=WALK, metrics=metrics, by_horizon=by_horizon, num_conversations=n)


@attrs.frozen
class ProbeResult:
    """One measurement: ``tau`` (the walk's, over all blocks of the sample), the blocks walked, the seconds."""

    tau: float
    blocks: int
    seconds: float


class HeldoutProbe:
    """A fixed held-out sample, ready to walk any number of times; a measurement draws no random numbers and
    leaves the drafter's weights, mode and gradients as they were."""

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
