"""The epoch batch plan (BatchPlanner, its corpus and source mixture, batch-quality figures, `pad_samples`): a
pure function of (sample lengths, `PlanConfig`, seed, epoch), so every rank builds the same plan and a resume
rebuilds it; the corpus is indexed in a fixed order (tables by source, then loose samples by id)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from dflash_flow.items import BatchMeta, PaddedBatch, PlannedBatch, Sample, SampleTable

from .epoch import EpochPlan, order_packed
from .packing import (
    PackedEpoch,
    PlanConfig,
    assign_buckets,
    bucket_boundaries,
    epoch_rng,
    pack_bucket,
    padded_lengths,
)
from .reports import TokenizedFile

__all__ = ["BatchPlanner", "Corpus", "EpochView", "describe_mixture", "draw_epoch", "file_table", "max_same_bucket_run",
           "mixture_counts", "pad_arrays", "pad_batch", "pad_samples", "padding_efficiency", "window_mix_max_deviation"]

# Salts that keep the generators of the plan's steps independent of each other (data.epoch has the others).
_SALT_PACK = 0x5041434B
_SALT_SHUFFLE = 0x53485546
_SALT_MIX = 0x4D495845


@attrs.define(eq=False)
class BatchPlanner:
    """Plans epochs for a fixed set of samples: ``BatchPlanner(lengths, config, seed).plan(epoch)``."""

    lengths: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64))
    config: PlanConfig = attrs.field(factory=PlanConfig)
    seed: int = 0
    sample_ids: np.ndarray | None = attrs.field(default=None,
                                                converter=lambda v: None if v is None else np.asarray(v, dtype=np.int64))
    boundaries: np.ndarray = attrs.field(init=False)
    bucket_of: np.ndarray = attrs.field(init=False)
    _padded: np.ndarray = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if self.lengths.ndim != 1:
            raise ValueError("lengths must be one-dimensional")
        if self.lengths.size and self.lengths.min() < 1:
            raise ValueError(f"sample lengths must be >= 1, found {int(self.lengths.min())}")
        if self.sample_ids is None:
            self.sample_ids = np.arange(self.lengths.size, dtype=np.int64)
        elif self.sample_ids.shape != self.lengths.shape:
            raise ValueError("sample_ids and lengths must have the same length")
        self.boundaries = bucket_boundaries(self.lengths, self.config)
        self.bucket_of = assign_buckets(self.lengths, self.boundaries)
        self._padded = padded_lengths(self.lengths, self.config.pad_to_multiple)

    @property
    def num_buckets(self) -> int:
        return int(self.boundaries.size) + 1

    def pack(self, epoch: int) -> PackedEpoch:
        """The epoch's batches per bucket (the Bucketer's half of the plan), not yet interleaved."""
        cfg = self.config
        pack_rng = epoch_rng(self.seed, epoch, _SALT_PACK)
        shuffle_rng = epoch_rng(self.seed, epoch, _SALT_SHUFFLE)
        per_bucket: list[list[np.ndarray]] = []
        # One stable sort groups positions by bucket instead of one mask pass per bucket.
        by_bucket = np.argsort(self.bucket_of, kind="stable")
        cuts = np.searchsorted(self.bucket_of[by_bucket], np.arange(self.num_buckets + 1), side="left")
        for b in range(self.num_buckets):
            idx = by_bucket[cuts[b] : cuts[b + 1]]
            batches = pack_bucket(idx, self._padded[idx], max_tokens=cfg.max_tokens, max_batch_size=cfg.max_batch_size,
                                  rng=pack_rng, length_jitter=cfg.length_jitter)
            # Packing runs short to long; draw each bucket's batches in random order so lengths do not
            # drift monotonically through the epoch.
            perm = shuffle_rng.permutation(len(batches))
            per_bucket.append([batches[i] for i in perm])
        return PackedEpoch(epoch=epoch, seed=self.seed, per_bucket=per_bucket, lengths=self.lengths, padded=self._padded,
                           sample_ids=self.sample_ids, boundaries=self.boundaries)

    def plan(self, epoch: int, world_size: int = 1) -> EpochPlan:
        """The epoch's plan: `pack` then `order_packed` with this planner's interleaving settings."""
        cfg = self.config
        return order_packed(self.pack(epoch), max_run=cfg.max_run, repeat_penalty=cfg.repeat_penalty,
                            evenness=cfg.evenness, world_size=world_size)


def padding_efficiency(metas: Iterable[BatchMeta]) -> float:
    """Real tokens / padded tokens over all batches (1.0 = no padding)."""
    real = padded = 0
    for m in metas:
        real += m.real_tokens
        padded += m.padded_tokens
    return real / padded if padded else 1.0


def max_same_bucket_run(buckets: Sequence[int] | np.ndarray) -> int:
    """Length of the longest run of consecutive batches from one bucket."""
    b = np.asarray(buckets)
    if b.size == 0:
        return 0
    change = np.flatnonzero(b[1:] != b[:-1]) + 1
    edges = np.concatenate(([0], change, [b.size]))
    return int(np.diff(edges).max())


def window_mix_max_deviation(buckets: Sequence[int] | np.ndarray, window: int = 32) -> float:
    """Largest |share of a bucket in a window - its share in the whole sequence|, over all windows of
    ``window`` consecutive batches and all buckets. A short sequence counts as one window."""
    b = np.asarray(buckets, dtype=np.int64)
    if b.size == 0:
        return 0.0
    w = min(window, b.size)
    n_buckets = int(b.max()) + 1
    onehot = np.zeros((b.size + 1, n_buckets), dtype=np.int64)
    onehot[np.arange(1, b.size + 1), b] = 1
    cum = np.cumsum(onehot, axis=0)
    in_window = (cum[w:] - cum[:-w]) / w
    overall = cum[-1] / b.size
    return float(np.abs(in_window - overall).max())


def file_table(name: str, files: Sequence[TokenizedFile], *, digests: Sequence[str] = (), first_id: int = 0) -> SampleTable:
    """One table over the kept samples of ``files`` (ids ``first_id``.. in file order, then line order).
    Holds per sample only its length and id; a sample's arrays are slices of the files' memory maps."""
    counts = np.asarray([len(f) for f in files], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    lengths = np.concatenate([np.diff(np.asarray(f.offsets)) for f in files]) if files else np.zeros(0, np.int64)
    n = int(starts[-1])

    def fetch(i: int):
        if not 0 <= i < n:
            raise IndexError(f"sample {i} outside the table's {n}")
        k = int(np.searchsorted(starts, i, side="right") - 1)
        f, j = files[k], i - int(starts[k])
        a, b = int(f.offsets[j]), int(f.offsets[j + 1])
        return f.ids[a:b], f.mask[a:b], f"{f.path}:{int(f.lines[j])}"

    return SampleTable(name=name, lengths=lengths.astype(np.int64, copy=False),
                       sample_ids=np.arange(first_id, first_id + n, dtype=np.int64), fetch=fetch,
                       tokens=int(lengths.sum()), digests=list(digests), inputs=[f.path for f in files])


class Corpus:
    """Tables and loose samples as one indexable corpus (see the module doc for the order)."""

    def __init__(self, tables: Sequence[SampleTable], samples: Sequence[Sample]):
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"two sample tables carry the same source name: {sorted(names)}")
        self.tables = sorted(tables, key=lambda t: t.name)
        self.loose = sorted(samples, key=lambda s: s.sample_id)
        sizes = [len(t) for t in self.tables] + ([len(self.loose)] if self.loose else [])
        self.starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64) if sizes else np.zeros(1, np.int64)
        loose_len = np.fromiter((len(s) for s in self.loose), dtype=np.int64, count=len(self.loose))
        loose_ids = np.fromiter((s.sample_id for s in self.loose), dtype=np.int64, count=len(self.loose))
        self.lengths = np.concatenate([t.lengths for t in self.tables] + [loose_len]).astype(np.int64)
        # One table keeps its source's ids; several are numbered one after another (in name order).
        ids, nxt = [], 0
        for t in self.tables:
            ids.append(np.asarray(t.sample_ids, dtype=np.int64) + (nxt if len(self.tables) > 1 else 0))
            nxt += len(t)
        self.sample_ids = np.concatenate(ids + [loose_ids + (nxt if self.tables else 0)]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.lengths.size)

    @property
    def groups(self) -> list[tuple[str, int, int]]:
        """(source name, first index, end) of each table."""
        return [(t.name, int(self.starts[k]), int(self.starts[k + 1])) for k, t in enumerate(self.tables)]

    def __getitem__(self, i: int) -> Sample:
        i = int(i)
        k = int(np.searchsorted(self.starts, i, side="right") - 1)
        sid = int(self.sample_ids[i])
        if k < len(self.tables):
            ids, mask, source = self.tables[k].fetch(i - int(self.starts[k]))
            return Sample(sample_id=sid, input_ids=ids, loss_mask=mask, source=source)
        s = self.loose[i - int(self.starts[k])]
        return s if s.sample_id == sid else Sample(sample_id=sid, input_ids=s.input_ids, loss_mask=s.loss_mask, source=s.source)


class EpochView:
    """An epoch's samples: position p of the epoch's plan is corpus sample ``positions[p]``."""

    def __init__(self, corpus: Corpus, positions: np.ndarray):
        self.corpus = corpus
        self.positions = positions

    def __len__(self) -> int:
        return int(self.positions.size)

    def __getitem__(self, p: int) -> Sample:
        return self.corpus[int(self.positions[p])]


def mixture_counts(weights: Sequence[float], total: int) -> list[int]:
    """``total`` split in proportion to ``weights`` (largest remainder: the counts sum to ``total``). The
    weights are scaled by their largest first, so that huge ones (1e308) cannot overflow their sum."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w)) or (w < 0).any() or w.max() <= 0:
        raise ValueError(f"mixture weights must be finite, >= 0 and not all 0, got {list(weights)}")
    w = w / w.max()
    exact = w / w.sum() * total
    base = np.floor(exact).astype(np.int64)
    rest = total - int(base.sum())
    order = np.argsort(-(exact - base), kind="stable")
    base[order[:rest]] += 1
    return base.tolist()


def draw_epoch(groups: Sequence[tuple[str, int, int]], weights: Mapping[str, float], *, samples_per_epoch: int | None,
               replacement: bool, seed: int, epoch: int) -> tuple[np.ndarray, dict[str, int]]:
    """Corpus indices of one epoch's samples (sorted) and how many each source contributed. Without replacement a
    source's draws are whole passes over it in a fresh random order, then a random subset."""
    missing = [g for g, _a, _b in groups if g not in weights]
    unknown = sorted(set(weights) - {g for g, _a, _b in groups})
    if missing or unknown:
        raise ValueError(f"mixture weights name the sources {sorted(weights)}, but the inputs are "
                         f"{[g for g, _a, _b in groups]}: give every source a weight (0 leaves it out)"
                         + (f"; no input is called {unknown}" if unknown else ""))
    total = samples_per_epoch if samples_per_epoch is not None else sum(b - a for _g, a, b in groups)
    counts = mixture_counts([weights[g] for g, _a, _b in groups], total)
    out, drawn = [], {}
    for k, ((name, a, b), c) in enumerate(zip(groups, counts, strict=True)):
        size = b - a
        drawn[name] = c
        if c == 0:
            continue
        if size == 0:
            raise ValueError(f"mixture: source '{name}' has no samples but weight {weights[name]}")
        rng = epoch_rng(seed, epoch, _SALT_MIX, k)
        if replacement:
            idx = rng.integers(0, size, size=c)
        else:
            full, part = divmod(c, size)
            idx = np.concatenate([rng.permutation(size) for _ in range(full)] + [rng.permutation(size)[:part]])
        out.append(a + idx.astype(np.int64))
    pos = np.sort(np.concatenate(out)) if out else np.zeros(0, np.int64)
    return pos, drawn


def describe_mixture(groups, weights: Mapping[str, float], drawn: Mapping[str, int], tokens: Mapping[str, int]) -> str:
    """A table of the mixture: per source its size, weight, draws per epoch and passes over it."""
    total = sum(drawn.values()) or 1
    top = max(weights.values(), default=0.0) or 1.0  # scaled first: huge weights cannot overflow the sum
    wsum = sum(v / top for v in weights.values()) or 1.0
    rows = []
    for name, a, b in groups:
        size = b - a
        passes = drawn[name] / size if size else math.nan
        rows.append(f"  {name}: {size} samples ({tokens.get(name, 0)} tokens), weight {weights[name] / top / wsum:.3f}, "
                    f"{drawn[name]} per epoch ({drawn[name] / total:.1%}, {passes:.2f} passes)")
    return "mixture per epoch:\n" + "\n".join(rows)


def pad_arrays(samples: Sequence[Sample], *, pad_id: int = 0, pad_to_multiple: int = 1,
               padded_len: int = 0) -> dict[str, np.ndarray]:
    """The padded numpy arrays of a batch (input_ids, attention_mask, position_ids, loss_mask, [b, S]), ``S``
    the longest sample rounded up to ``pad_to_multiple``, or ``padded_len`` (the plan's) if larger."""
    if not samples:
        raise ValueError("cannot pad an empty batch")
    lens = np.fromiter((len(s.input_ids) for s in samples), dtype=np.int64, count=len(samples))
    longest = int(lens.max())
    m = max(int(pad_to_multiple), 1)
    width = max(-(-longest // m) * m, int(padded_len))
    b = len(samples)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    loss = np.zeros((b, width), dtype=np.int64)
    for i, s in enumerate(samples):
        n = int(lens[i])
        if len(s.loss_mask) != n:
            raise ValueError(f"sample {s.sample_id} ({s.source or 'unknown source'}): loss_mask has "
                             f"{len(s.loss_mask)} entries for {n} tokens")
        ids[i, :n] = s.input_ids
        loss[i, :n] = s.loss_mask
    cols = np.arange(width, dtype=np.int64)
    attn = (cols[None, :] < lens[:, None]).astype(np.int64)
    # Right padding: positions are 0..n-1 on real tokens; padded slots get 0 (never attended, never in the loss).
    pos = np.where(attn.astype(bool), cols[None, :], 0)
    return {"input_ids": ids, "attention_mask": attn, "position_ids": pos, "loss_mask": loss}


def pad_samples(samples: Sequence[Sample], meta: BatchMeta, *, pad_id: int = 0, pad_to_multiple: int = 1,
                pin_memory: bool | None = None) -> PaddedBatch:
    """`PaddedBatch` of int64 CPU tensors, pinned when CUDA is present (``pin_memory=None``) or asked."""
    import torch

    if meta.filler:
        # A filler batch keeps its rank in step with the others (data parallel); it has no samples.
        empty = np.zeros((0, 0), dtype=np.int64)
        arrays = dict.fromkeys(("input_ids", "attention_mask", "position_ids", "loss_mask"), empty)
    else:
        arrays = pad_arrays(samples, pad_id=pad_id, pad_to_multiple=pad_to_multiple, padded_len=meta.padded_len)
    pin = (pin_memory is None or bool(pin_memory)) and torch.cuda.is_available()
    tensors = {}
    for k, v in arrays.items():
        t = torch.from_numpy(v)
        # position_ids never leave the host (right padding: the target derives them), so they are not pinned.
        tensors[k] = t.pin_memory() if pin and k != "position_ids" else t
    return PaddedBatch(meta=meta, **tensors)


def pad_batch(batch: PlannedBatch, *, pad_id: int = 0, pad_to_multiple: int = 1,
              pin_memory: bool | None = None) -> PaddedBatch:
    return pad_samples(batch.samples, batch.meta, pad_id=pad_id, pad_to_multiple=pad_to_multiple, pin_memory=pin_memory)

