"""The epoch's plan and its dealing: EpochPlan, global steps of one batch per rank, order_packed, resume; and
DataPosition, the run's one typed data position (what a checkpoint stores as ``data_position``)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import numpy as np

from dflash_flow.core.stage import StateVersion
from dflash_flow.items import BatchMeta

from .packing import PackedEpoch, PlanConfig, epoch_rng, interleave_buckets

#: An ``EpochPlan.state_dict``: the plan's chain of world sizes and positions, its fingerprint.
PLAN_STATE = StateVersion("plan state", 2)

__all__ = ["FILLER", "MAX_POSITION", "DataPosition", "EpochPlan", "order_packed", "plan_state_problem", "resume_plan"]

# Salts that keep the generators of the plan's steps independent of each other (data.plan has the others).
_SALT_INTERLEAVE = 0x494E5452
_SALT_REDEAL = 0x5245444C
_DEFAULTS = PlanConfig()

FILLER = -1  # the position of a filler batch in a rank's schedule


@attrs.define(eq=False)
class EpochPlan:
    """The ordered batches of one epoch. ``order[offsets[i]:offsets[i+1]]`` are the sample positions of batch
    ``i``. With ``world_size`` W, global step s is positions ``s*W .. s*W+W-1``; the short ranks of a last partial
    step get filler batches (``FILLER``). ``chain``: the segments ``((W0, p0), ...)`` consumed before a re-deal."""

    epoch: int
    seed: int
    order: np.ndarray
    offsets: np.ndarray
    buckets: np.ndarray
    padded_lens: np.ndarray
    lengths: np.ndarray
    sample_ids: np.ndarray
    boundaries: np.ndarray
    max_run: int  # the cap that was enforced (on consecutive global steps of one bucket)
    run_cap_feasible: bool  # False when the configured cap was impossible for this bucket mix
    world_size: int = 1  # the world size the order was made for
    padded: np.ndarray | None = None  # padded length of every sample (for re-dealing)
    chain: tuple[tuple[int, int], ...] = ()
    interleave: tuple[int, float, float] = (3, 0.5, 3.0)  # max_run, repeat_penalty, evenness
    _fingerprint: str | None = attrs.field(default=None, init=False, repr=False)
    _longest: int | None = attrs.field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return int(self.buckets.size)

    @property
    def num_buckets(self) -> int:
        return int(self.boundaries.size) + 1

    def bucket_range(self, bucket: int) -> tuple[int, int]:
        """The sample lengths bucket ``bucket`` holds, ``(shortest, longest)``: above the previous boundary
        up to its own (``assign_buckets``); the last bucket up to the longest sample of the plan."""
        lo = int(self.boundaries[bucket - 1]) + 1 if bucket > 0 else 1
        if bucket < self.boundaries.size:
            return lo, max(lo, int(self.boundaries[bucket]))
        if self._longest is None:
            self._longest = int(self.lengths.max(initial=lo))
        return lo, max(lo, self._longest)

    def batch(self, position: int) -> np.ndarray:
        """Sample positions of the batch at ``position``."""
        if not 0 <= position < len(self):
            raise IndexError(f"batch position {position} outside the epoch's {len(self)} batches")
        return self.order[self.offsets[position] : self.offsets[position + 1]]

    def meta(self, position: int) -> BatchMeta:
        """What the batch at ``position`` is (``FILLER``: a filler batch with no samples)."""
        if position == FILLER:
            return BatchMeta(epoch=self.epoch, index=FILLER, bucket=-1, lengths=[], real_tokens=0, padded_tokens=0,
                             num_samples=0, filler=True)
        idx = self.batch(position)
        lens = self.lengths[idx]
        padded_len = int(self.padded_lens[position])
        bucket = int(self.buckets[position])
        return BatchMeta(epoch=self.epoch, index=position, bucket=bucket, bucket_range=self.bucket_range(bucket),
                         lengths=lens.tolist(), real_tokens=int(lens.sum()), padded_tokens=padded_len * int(idx.size),
                         num_samples=int(idx.size), sample_ids=self.sample_ids[idx].tolist(), padded_len=padded_len)

    def rank_positions(self, rank: int, world_size: int | None = None, *, start: int = 0,
                       tail: Literal["filler", "drop"] = "filler") -> np.ndarray:
        """Global positions ``rank`` consumes from ``start`` on (a step boundary): ``start + s*W + r`` at step
        s; ``tail="filler"`` gives the short ranks of the last step ``FILLER``, ``"drop"`` leaves it out."""
        world_size = self.world_size if world_size is None else world_size
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        if tail not in ("filler", "drop"):
            raise ValueError(f"tail must be 'filler' or 'drop', got {tail!r}")
        n = len(self)
        if not 0 <= start <= n:
            raise ValueError(f"start position {start} outside 0..{n}")
        left = n - start
        steps = -(-left // world_size) if tail == "filler" else left // world_size
        pos = start + rank + world_size * np.arange(steps, dtype=np.int64)
        return np.where(pos < n, pos, FILLER)

    def redeal(self, start: int, world_size: int) -> EpochPlan:
        """The rest of the epoch from ``start`` on (each batch not yet trained, once) in global steps of
        ``world_size``: an elastic resume. The result's ``chain`` records this plan's segment."""
        if not 0 <= start <= len(self):
            raise ValueError(f"re-deal position {start} outside 0..{len(self)}")
        if self.padded is None:
            raise ValueError("this plan cannot be re-dealt (it carries no padded lengths)")
        rest = list(range(start, len(self)))
        batches = [self.batch(p) for p in rest]
        labels = self.buckets[start:]
        max_run, repeat_penalty, evenness = self.interleave
        if world_size == 1 or not rest:
            perm, cap = np.arange(len(rest), dtype=np.int64), self.max_run
        else:
            rng = epoch_rng(self.seed, self.epoch, _SALT_REDEAL, len(self.chain), start, world_size)
            perm, cap = _step_groups(labels, world_size, rng, max_run=max_run, repeat_penalty=repeat_penalty,
                                     evenness=evenness)
        return _plan_from_batches(batches, labels, perm, like=self, cap=cap, interleave=self.interleave,
                                  world_size=world_size, chain=(*self.chain, (self.world_size, int(start))))

    def fingerprint(self) -> str:
        """Hash of the plan's content (equal on every rank and across resumes), computed once per plan."""
        if self._fingerprint is not None:
            return self._fingerprint
        h = hashlib.blake2b(digest_size=16)
        for arr in (self.order, self.offsets, self.buckets, self.padded_lens, self.sample_ids):
            h.update(np.ascontiguousarray(arr, dtype=np.int64).tobytes())
        h.update(f"{self.epoch}|{self.seed}|{self.world_size}|{list(self.chain)}".encode())
        self._fingerprint = h.hexdigest()
        return self._fingerprint

    def state_dict(self, position: int) -> dict:
        """Resume state after ``position`` global batches of this plan were consumed."""
        return PLAN_STATE.tag({
            "epoch": self.epoch,
            "chain": [list(c) for c in self.chain] + [[self.world_size, int(position)]],
            "fingerprint": self.fingerprint(),
        })

    def check_state(self, state: dict) -> int:
        """Validate a `state_dict` of this very plan; returns the position to resume from."""
        PLAN_STATE.check(state)
        if state.get("epoch") != self.epoch:
            raise ValueError(f"plan state is for epoch {state.get('epoch')}, this plan is epoch {self.epoch}")
        chain = [tuple(c) for c in state.get("chain") or [(self.world_size, 0)]]
        if tuple(chain[:-1]) != self.chain or chain[-1][0] != self.world_size:
            raise ValueError(f"plan state belongs to a plan dealt as {chain}, this one is "
                             f"{[*self.chain, (self.world_size, '?')]}: rebuild it with resume_plan()")
        fp = state.get("fingerprint")
        if fp is not None and fp != self.fingerprint():
            raise ValueError("the rebuilt epoch plan differs from the one the checkpoint was taken from "
                             "(data, plan config or seed changed); resuming would repeat or skip samples")
        pos = int(chain[-1][1])
        if not 0 <= pos <= len(self):
            raise ValueError(f"plan state position {pos} outside 0..{len(self)}")
        return pos


MAX_POSITION = 2**53  # no real plan holds more batches (or epochs, or ranks) than this


def _count(v: object, lo: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= MAX_POSITION


def plan_state_problem(state: object) -> str | None:
    """What is wrong with the types and ranges of an ``EpochPlan.state_dict`` read back from a file (None: nothing;
    whether it fits the rebuilt plan is ``check_state``'s question)."""
    if not isinstance(state, dict):
        return f"must be an object, got {type(state).__name__}"
    version = PLAN_STATE.problem(state)
    if version is not None:
        return version
    if not _count(state.get("epoch")):
        return f"'epoch' must be a non-negative integer, got {state.get('epoch')!r:.40}"
    chain = state.get("chain")
    if chain is not None:
        if not isinstance(chain, list) or not chain:
            return f"'chain' must be a non-empty list of [ranks, position] pairs, got {chain!r:.60}"
        for seg in chain:
            if not (isinstance(seg, list) and len(seg) == 2 and _count(seg[0], 1) and _count(seg[1])):
                return f"'chain' must hold [ranks >= 1, position >= 0] pairs of integers, got {seg!r:.60}"
    fp = state.get("fingerprint")
    if fp is not None and not isinstance(fp, str):
        return f"'fingerprint' must be a string, got {type(fp).__name__}"
    return None


def resume_plan(base: EpochPlan, state: dict, world_size: int) -> tuple[EpochPlan, int]:
    """The plan to continue an epoch with ``world_size`` ranks and the global position to start from: ``base``
    re-dealt along the ``chain`` of ``state``, so the number of ranks may change any number of times."""
    chain = [(int(w), int(p)) for w, p in state.get("chain") or []] or [(base.world_size, 0)]
    if chain[0][0] != base.world_size:
        raise ValueError(f"the epoch started with {chain[0][0]} ranks but the base plan is for {base.world_size}")
    plan = base
    for (_w, p), (w_next, _p) in zip(chain[:-1], chain[1:], strict=True):
        plan = plan.redeal(p, w_next)
    position = plan.check_state({**state, "version": PLAN_STATE.version, "epoch": plan.epoch, "chain": [list(c) for c in chain]})
    if plan.world_size == world_size:
        return plan, position
    return plan.redeal(position, world_size), 0


def _step_groups(labels: np.ndarray, world_size: int, rng: np.random.Generator, *, max_run: int,
                 repeat_penalty: float, evenness: float) -> tuple[np.ndarray, int]:
    """Order batches (of buckets ``labels``) into global steps of ``world_size``: (indices in order, cap).
    A step waits for its slowest rank, so each bucket makes steps of its own; leftovers, pooled in bucket
    order, make mixed steps; steps are interleaved under the run cap, the partial step last."""
    w = world_size
    n_labels = int(labels.max()) + 1 if labels.size else 0
    queues: list[list[list[int]]] = [[] for _ in range(n_labels)]  # the steps of each bucket, in order
    leftovers: list[int] = []
    for b in range(n_labels):
        items = np.flatnonzero(labels == b).tolist()
        full = len(items) // w
        queues[b] += [items[g * w : (g + 1) * w] for g in range(full)]
        leftovers += items[full * w :]
    partial: list[int] = []
    for j in range(0, len(leftovers), w):
        chunk = leftovers[j : j + w]
        if len(chunk) == w:
            queues[int(labels[chunk[0]])].append(chunk)
        else:
            partial = chunk
    seq, cap = interleave_buckets([len(q) for q in queues], max_run=max_run, rng=rng, repeat_penalty=repeat_penalty,
                                  evenness=evenness)
    steps = [iter(q) for q in queues]
    order: list[int] = [i for label in seq.tolist() for i in next(steps[label])]
    order += partial
    return np.asarray(order, dtype=np.int64), cap


def _plan_from_batches(batches: list[np.ndarray], buckets: np.ndarray, perm: np.ndarray, *,
                       like: PackedEpoch | EpochPlan, cap: int, interleave: tuple[int, float, float],
                       world_size: int, chain: tuple[tuple[int, int], ...] = ()) -> EpochPlan:
    ordered = [batches[i] for i in perm.tolist()]
    sizes = np.fromiter((a.size for a in ordered), dtype=np.int64, count=len(ordered))
    offsets = np.zeros(len(ordered) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    order = np.concatenate(ordered) if ordered else np.zeros(0, dtype=np.int64)
    padded = like.padded
    padded_max = np.maximum.reduceat(padded[order], offsets[:-1]) if ordered else np.zeros(0, dtype=np.int64)
    return EpochPlan(epoch=like.epoch, seed=like.seed, order=order, offsets=offsets,
                     buckets=np.asarray(buckets, dtype=np.int64)[perm] if perm.size else np.zeros(0, dtype=np.int64),
                     padded_lens=padded_max.astype(np.int64), lengths=like.lengths, sample_ids=like.sample_ids,
                     boundaries=like.boundaries, max_run=cap, run_cap_feasible=cap == interleave[0],
                     world_size=world_size, padded=padded, chain=chain, interleave=interleave)


def order_packed(packed: PackedEpoch, *, max_run: int = _DEFAULTS.max_run,
                 repeat_penalty: float = _DEFAULTS.repeat_penalty, evenness: float = _DEFAULTS.evenness,
                 world_size: int = 1) -> EpochPlan:
    """Interleave a packed epoch into its `EpochPlan` (the Interleaver's half of the plan): with ``world_size``
    ranks, global steps (``_step_groups``); the batches are the same for every world size, their order is not."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if max_run < 1:
        raise ValueError(f"max_run must be >= 1, got {max_run}")
    counts = packed.counts
    batches = [b for bucket in packed.per_bucket for b in bucket]
    buckets = np.repeat(np.arange(len(counts), dtype=np.int64), counts)
    # One rank: steps of one batch, the bucket interleaving itself (its generator salted without the world size).
    rng = epoch_rng(packed.seed, packed.epoch, _SALT_INTERLEAVE, *([world_size] if world_size > 1 else []))
    perm, cap = _step_groups(buckets, world_size, rng, max_run=max_run, repeat_penalty=repeat_penalty,
                             evenness=evenness)
    return _plan_from_batches(batches, buckets, perm, like=packed, cap=cap,
                              interleave=(max_run, repeat_penalty, evenness), world_size=world_size)


@attrs.frozen
class DataPosition:
    """Where the data stream has got to: the trainer advances it per batch (:meth:`after`), a checkpoint stores its
    :meth:`resume_point` as ``data_position``. ``epoch`` and ``plan`` (``EpochPlan.state_dict``, None at an epoch's
    start) of the last batch trained; ``total``: batches trained on this rank; ``epoch_done``: it ended its epoch."""

    epoch: int = 0
    plan: dict[str, Any] | None = None
    total: int = 0
    epoch_done: bool = False

    def after(self, meta: Any) -> DataPosition:
        """The position once the batch of ``meta`` (a ``BatchMeta``) is trained."""
        return DataPosition(epoch=meta.epoch, plan=meta.plan_state, total=self.total + 1,
                            epoch_done=bool(meta.last_of_epoch))

    def resume_point(self) -> DataPosition:
        """Where a resumed run continues (the next epoch's start after an epoch's last batch)."""
        if self.epoch_done:
            return DataPosition(epoch=self.epoch + 1, plan=None, total=self.total)
        return self

    def to_dict(self) -> dict[str, Any]:
        """A checkpoint's ``data_position`` (of :meth:`resume_point`)."""
        p = self.resume_point()
        return {"epoch": p.epoch, "plan": p.plan, "total": p.total}

    @staticmethod
    def problem(d: Any) -> str | None:
        """What is wrong with a ``data_position`` read back from a file (None: nothing), naming its key."""
        if not isinstance(d, Mapping):
            return f"'data_position' must be an object, got {type(d).__name__}"
        if not _count(d.get("epoch")):
            return f"'data_position.epoch' must be a non-negative integer, got {d.get('epoch')!r:.80}"
        if d.get("total") is not None and not _count(d["total"]):
            return f"'data_position.total' must be a non-negative integer, got {d.get('total')!r:.80}"
        if d.get("plan") is not None:
            problem = plan_state_problem(d["plan"])
            if problem is not None:
                return f"'data_position.plan': {problem}"
        return None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DataPosition:
        """A checkpoint's ``data_position``; ValueError naming the key when it is not one."""
        problem = cls.problem(d)
        if problem is not None:
            raise ValueError(problem)
        return cls(epoch=int(d["epoch"]), plan=d.get("plan"), total=int(d.get("total") or 0))

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> DataPosition:
        """The position a trainer stage keeps in its own state (the fields of :meth:`as_state`)."""
        return cls(epoch=int(state["epoch"]), plan=state.get("plan"), total=int(state.get("total_consumed", 0)),
                   epoch_done=bool(state.get("epoch_done", False)))

    def as_state(self) -> dict[str, Any]:
        """The fields of :meth:`from_state`."""
        return {"epoch": self.epoch, "epoch_done": self.epoch_done, "plan": self.plan, "total_consumed": self.total}
