"""Item types that travel between the DFlash stages. Importable without torch (`validate` and `graph` read the
port types of every stage), so tensor fields are typed ``Any``."""

from __future__ import annotations

from typing import Any

import attrs


class SampleSet:
    """What a Bucketer takes: one `Sample`, or a `SampleTable` of many (a source's whole corpus)."""

    __slots__ = ()


@attrs.define(eq=False)
class Sample(SampleSet):
    """One tokenized training sample."""

    sample_id: int
    input_ids: Any  # list[int] or 1-D integer array
    loss_mask: Any  # same length as input_ids, 1 on supervised (assistant) tokens
    source: str = ""  # "file:line" of the record it came from

    def __len__(self) -> int:
        return len(self.input_ids)


@attrs.define(eq=False)
class SampleTable(SampleSet):
    """Many samples as columns (a corpus costs a few arrays, not an object per sample): ``lengths`` and
    ``sample_ids`` are int64 arrays; ``table[i]`` makes a `Sample` from ``fetch(i)`` -> ``(ids, mask, "file:line")``."""

    name: str  # the source stage it came from (mixture weights are keyed by it)
    lengths: Any
    sample_ids: Any
    fetch: Any
    tokens: int = 0
    digests: list[str] = attrs.field(factory=list)  # content sha256 of the inputs (one file read twice shows)
    inputs: list[str] = attrs.field(factory=list)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Sample:
        ids, mask, source = self.fetch(int(i))
        return Sample(sample_id=int(self.sample_ids[i]), input_ids=ids, loss_mask=mask, source=source)


@attrs.frozen
class RunPlan:
    """What the run will train, known once the first epoch is planned (the console's start banner); shared."""

    samples: int  # samples in the run's data (each trained once per epoch)
    epochs: int
    batches: int  # batches this rank takes over the whole run (max_batches applied)
    world_size: int = 1
    max_tokens: int | None = None  # each batch's token budget (the Bucketer's)
    buckets: int | None = None
    from_epoch: int = 0  # the first epoch this process trains (after a resume: the checkpoint's)

    def sentence(self, optimizer_steps: int | None) -> str:
        per = f" of at most {self.max_tokens:,} tokens" if self.max_tokens else ""
        ranks = f" on each of {self.world_size} ranks" if self.world_size > 1 else ""
        buckets = f" in {self.buckets} length buckets" if self.buckets else ""
        resumed = f", resuming in epoch {self.from_epoch}" if self.from_epoch else ""
        steps = f" -> {optimizer_steps:,} optimizer steps" if optimizer_steps else ""
        return (f"training {self.samples:,} samples{buckets} x {self.epochs} epoch{'s' if self.epochs != 1 else ''}"
                f"{resumed}: {self.batches:,} batches{per}{ranks}{steps}")


@attrs.define(eq=False)
class BatchMeta:
    """What a batch is, carried with it from the planner to the trainer."""

    epoch: int
    index: int  # position in the epoch's global batch plan
    bucket: int
    lengths: list[int]
    real_tokens: int
    padded_tokens: int
    num_samples: int
    sample_ids: list[int] = attrs.field(factory=list)
    padded_len: int = 0
    total_batches: int = 0  # over the whole run, for this rank (the trainer's schedule and checkpoints)
    # Batches this rank will still take from this one on, per epoch (max_batches applied): the steps left.
    batches_ahead: tuple[int, ...] = ()
    rank: int = 0
    # Its place in the epoch's plan of global steps (data.epoch.EpochPlan): filler batches (no samples) keep the
    # ranks in step; `plan_state` is the Interleaver's state right after this batch.
    filler: bool = False
    step: int = 0
    last_of_epoch: bool = False  # the epoch's last step (for this rank)
    last_of_run: bool = False  # the last batch the run plans for this rank (max_batches reached, or the last epoch ends)
    plan_state: dict[str, Any] | None = None
    plan: RunPlan | None = None  # the run's plan (the same object for every batch of an epoch)
    # The sample lengths its bucket holds, (shortest, longest): for the bucket mix's legend (None: a filler).
    bucket_range: tuple[int, int] | None = None

    @property
    def ends_accumulation(self) -> bool:
        """The optimizer steps after this batch even if its accumulation is not complete (``planned_updates``)."""
        return self.last_of_epoch or self.last_of_run


@attrs.define(eq=False)
class PlannedBatch:
    """A batch chosen by the planner: samples not yet padded."""

    meta: BatchMeta
    samples: list[Sample]


@attrs.define(eq=False)
class PaddedBatch:
    """Right-padded tensors of one batch, shape [b, S]."""

    meta: BatchMeta
    input_ids: Any
    attention_mask: Any
    position_ids: Any
    loss_mask: Any


@attrs.define(eq=False)
class TargetFeatures:
    """Hidden states of the chosen target layers, aligned 1:1 with input_ids (no shift)."""

    meta: BatchMeta
    input_ids: Any
    loss_mask: Any
    attention_mask: Any
    hidden_states: Any  # [b, S, n_layers * H]
    target_layer_ids: list[int] = attrs.field(factory=list)


#: How a trainer metric of a StepReport combines over the ranks of a job; every metric not listed is averaged.
TRAIN_METRIC_REDUCTIONS: dict[str, str] = {
    "tokens": "sum", "samples": "sum", "num_tokens": "sum", "tokens_per_s": "sum", "samples_per_s": "sum",
    "allreduce_wait_s": "max", "allreduce_wait_frac": "max", "step_s": "max",
}


@attrs.frozen
class HeldoutWalk:
    """The drafter's teacher-forced walk on a fixed held-out sample (``model.walk.HeldoutProbe``)."""

    tau: float
    elapsed_s: float  # seconds since the trainer's setup began
    probe_s: float  # what this measurement cost
    conversations: int
    horizon: int


@attrs.define(eq=False)
class StepReport:
    """What one optimizer step of the drafter reports; ``metrics``: its scalar curves (loss, ``lr``, ...)."""

    step: int
    epoch: int
    meta: BatchMeta | None
    metrics: dict[str, float] = attrs.field(factory=dict)
    position_accuracy: tuple[float, ...] = ()  # accuracy of block slots k = 1..B-1 (0.0: none supervised)
    total_steps: int | None = None  # the schedule's length in optimizer steps (a run fact, not a curve)
    final: bool = False  # the last report of the run
    artifacts: dict[str, str] = attrs.field(factory=dict)  # e.g. {"drafter": "/path/to/export"}
    heldout: HeldoutWalk | None = None  # the held-out walk, at the steps the trainer measured it


@attrs.define(eq=False)
class EvalReport:
    """One evaluation's result (``observe.names`` makes the MLflow keys from it). ``metrics``: figures at the first
    horizon and those tied to none; ``by_horizon``: ``{H: {"tau": ..., ...}}`` for every horizon, in order."""

    name: str
    metrics: dict[str, float] = attrs.field(factory=dict)
    by_horizon: dict[int, dict[str, float]] = attrs.field(factory=dict)
    temperature: float | None = None  # real decoding's temperature: 0 greedy, > 0 speculative sampling
    top_p: float | None = None  # sampling settings (None when greedy or not a decoding)
    top_k: int | None = None
    lossless: bool | None = None  # greedy decoding: every output identical to the target's greedy output
    num_prompts: int | None = None  # prompts decoded
    num_conversations: int | None = None  # conversations walked (the teacher-forced walk)

    @property
    def horizons(self) -> tuple[int, ...]:
        """The new-token horizons measured, the first being the one ``metrics`` reports."""
        return tuple(self.by_horizon)

    @property
    def max_new_tokens(self) -> int | None:
        """The first horizon (None: the evaluation has none)."""
        return next(iter(self.by_horizon), None)

    @property
    def sampled(self) -> bool:
        return self.temperature is not None and self.temperature > 0

    def at(self, horizon: int, metric: str = "tau") -> float | None:
        """``metric`` measured at ``horizon`` new tokens (None: not measured there)."""
        return self.by_horizon.get(int(horizon), {}).get(metric)


@attrs.define(eq=False)
class EpochBatches:
    """One epoch's packed batches by bucket, not yet ordered (Bucketer -> Interleaver), with the samples they index."""

    epoch: int
    packed: Any  # dflash_flow.data.packing.PackedEpoch
    samples: Any  # samples[i] is the sample at plan position i (a list, or a lazy view of the corpus)
    num_epochs: int = 1  # epochs the run plans (for the trainer's schedule length)
    # Global batches of every epoch of the run (the schedule's totals). Empty: later epochs as large as this one.
    epoch_sizes: tuple[int, ...] = ()
    max_tokens: int | None = None  # each batch's token budget
