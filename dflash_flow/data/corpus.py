"""The corpus the plan is made over: source tables side by side, and the per-epoch mixture of them.

A source emits one `SampleTable` (its files, memory-mapped); the Bucketer puts every table (and any loose
`Sample`) into one `Corpus`, indexed in a fixed order (tables by source name, then loose samples by id), so
the plan never depends on which thread delivered what first. Mixture weights decide how many samples each
source contributes to an epoch: `draw_epoch` is a pure function of (sizes, weights, seed, epoch), so a resume
redraws the same epoch. Without replacement a source's draws are whole passes over it in a fresh random
order, then a random subset; with replacement, independent uniform draws."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

from dflash_flow.items import Sample, SampleTable

from .packing import epoch_rng
from .reports import TokenizedFile

__all__ = ["Corpus", "EpochView", "describe_mixture", "draw_epoch", "file_table", "mixture_counts"]

_SALT_MIX = 0x4D495845


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
    """Corpus indices of one epoch's samples (sorted) and how many each source contributed."""
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

