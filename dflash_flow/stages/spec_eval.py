"""SpecDecodeEval: after training, speculative decoding on held-out prompts and the teacher-forced walk."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, ClassVar

import attrs

from dflash_flow.core import Stage, cfg
from dflash_flow.embedded import embedded_walk_data
from dflash_flow.items import EvalReport, StepReport
from dflash_flow.model.spec import UsesModel, model_of

#: ``quick``: prompts decoded and conversations walked at most.
QUICK_PROMPTS, QUICK_WALKS = 8, 16


_NOT_EMBEDDED = ("walk_data 'embedded' holds the embedded target's replies; with another target, give a JSONL of "
                 "that target's own replies")


def _list_field(default: list | None, check, what: str, doc: str, *, nonempty: bool = False) -> Any:
    """A list config field checking every element; ``default`` None: optional (a given list non-empty)."""

    def validate(_inst: Any, _attribute: attrs.Attribute, value: list) -> None:
        if (nonempty or default is None) and not value:
            raise ValueError("must not be empty")
        bad = [v for v in value if not check(v)]
        if bad:
            raise ValueError(f"every value must be {what}, got {bad[0]!r}")

    metadata = {"doc": f"{doc} (each {what})", "config": True, "bounds": {}, "choices": None, "finite": True}
    if default is None:
        return attrs.field(default=None, validator=attrs.validators.optional(validate), kw_only=True,
                           metadata=metadata)
    return attrs.field(factory=lambda: list(default), validator=validate, kw_only=True, metadata=metadata)


@attrs.define(kw_only=True, eq=False)
class SpecDecodeEval(Stage, UsesModel):
    """On the trainer's final report: acceptance length and target-forward speedup, trained vs untrained,
    greedy and sampled, at each horizon; and the teacher-forced walk of the trained drafter."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.model.evaluation  # noqa: F401 (imports model.walk)

    input_type = StepReport
    output_type = EvalReport
    cardinality = "1:n"
    singleton = True
    affects_result = False  # it evaluates the trained drafter: a resume may change how
    moved_fields: ClassVar[dict[str, str]] = {"target": "model.target", "tokenizer": "model.tokenizer"}

    prompts: str = cfg(doc="JSONL of held-out prompts ({'prompt': ...} or {'conversations': [...]}); 'embedded' for the built-in set.")
    limit: int = cfg(32, ge=1, doc="Prompts to evaluate.")
    max_new_tokens: int = cfg(64, ge=1, doc="Tokens generated per prompt: the horizon 'tau' reports.")
    horizons: list[int] = _list_field([], lambda v: v >= 1, ">= 1", "More horizons (new tokens) measured beside max_new_tokens, as tau_h<H>, e.g. [448]")
    temperatures: list[float] = _list_field([0.0, 1.0], lambda v: v >= 0, ">= 0", "Decoding temperatures: 0 = greedy (lossless-checked), > 0 = speculative sampling",
                                     nonempty=True)
    top_p: float = cfg(1.0, gt=0, le=1, doc="Nucleus mass kept when sampling (1 = all).")
    top_k: int = cfg(0, ge=0, doc="Most likely tokens kept when sampling (0 = all).")
    walk_data: str | None = cfg(None, doc="JSONL of held-out conversations whose last turn is the target's own greedy reply, for the teacher-forced walk ('embedded': the embedded dataset's eval split; null: no walk).")
    walk_limit: int = cfg(64, ge=1, doc="Conversations to walk.")
    walk_horizons: list[int] | None = _list_field(
        None, lambda v: v >= 1, ">= 1", "Horizons of the walk (null: max_new_tokens and horizons); the walk costs one "
        "target forward per conversation at any horizon, so long horizons are cheap here, unlike real decoding",
    )
    baseline: bool = cfg(False, doc="Also evaluate an untrained drafter of the same shape (it accepts about 1.0; doubles the decoding time).")
    quick: bool = cfg(False, doc="A short run's evaluation: at most 8 prompts, greedy only (no sampled decoding, no untrained baseline), the walk on at most 16 conversations at max_new_tokens only (no whole-reply horizon). Same measures, fewer samples: noisier figures, no T > 0 or long-horizon tau_h<H> rows.")
    batch_size: int = cfg(16, ge=1, doc="Prompts (and walked conversations) decoded together: each one's figures are exactly its own one-at-a-time figures (only the wall-clock ones change); 1 = one at a time.")
    torch_threads: int | None = cfg(None, ge=1, doc="torch intra-op threads for the evaluation (CPU runs; batch-1 decoding of a small model is fastest on 1).")

    def input_paths(self) -> list[tuple[str, str, str]]:
        return [(f, p, "file") for f, p in (("prompts", self.prompts), ("walk_data", self.walk_data))
                if p is not None and p != "embedded"]

    def model_problems(self, spec, devices: list[list[str]]) -> list[tuple[str, str]]:  # noqa: ARG002
        if spec.target is None:
            return [("model.target", "SpecDecodeEval needs the target (the drafter's own): set model.target")]
        if self.walk_data == "embedded" and not spec.is_embedded:
            return [("walk_data", _NOT_EMBEDDED)]
        return []

    def setup(self, ctx) -> None:
        self._ctx = ctx
        self._spec = model_of(ctx)
        self._spec.require_target(f"stage '{ctx.name}'")
        if self.walk_data == "embedded" and not self._spec.is_embedded:
            raise ValueError(f"stage '{ctx.name}': {_NOT_EMBEDDED}")

    def _progress_hook(self):
        """Between units of the evaluation: a heartbeat, a stop check and the console's progress line."""
        from dflash_flow.observe.record import PhaseProgress
        from dflash_flow.services import services_of

        ctx, record, t0, tokens = self._ctx, services_of(self._ctx).record, time.monotonic(), [0]

        def hook(done: int, total: int, new_tokens: int) -> None:
            ctx.check_stop()
            ctx.heartbeat()
            tokens[0] += new_tokens
            if record is not None:
                record.note_phase(PhaseProgress(label=f"{ctx.name}: held-out decoding and walk", done=done,
                                                total=total, tokens=tokens[0], elapsed_s=time.monotonic() - t0))

        return hook

    def evaluation_settings(self, spec, output_dir) -> dict[str, Any]:
        """``evaluation.evaluate_exported``'s settings from this stage's (``quick`` applied; the embedded
        prompts written into ``output_dir``), all but the drafter, seed, device and progress."""
        from dflash_flow.embedded import write_eval_prompts

        limit, walk_limit, temperatures = self.limit, self.walk_limit, self.temperatures
        horizons, walk_horizons, baseline = self.horizons, self.walk_horizons, self.baseline
        if self.quick:  # what `quick` skips: its field's doc
            limit, walk_limit, baseline = min(limit, QUICK_PROMPTS), min(walk_limit, QUICK_WALKS), False
            temperatures = [t for t in temperatures if t == 0] or [0.0]
            horizons, walk_horizons = [], [self.max_new_tokens]
        prompts = self.prompts
        if prompts == "embedded":
            prompts = str(write_eval_prompts(Path(output_dir) / "eval_prompts.jsonl", limit))
        return dict(target=spec.target, prompts_path=prompts, tokenizer_path=spec.tokenizer, limit=limit,
                    max_new_tokens=[self.max_new_tokens, *(h for h in horizons if h != self.max_new_tokens)],
                    baseline=baseline, temperatures=temperatures, top_p=self.top_p, top_k=self.top_k,
                    walk_data=str(embedded_walk_data()) if self.walk_data == "embedded" else self.walk_data,
                    walk_limit=walk_limit, walk_horizons=walk_horizons, batch_size=self.batch_size)

    def process(self, report: StepReport):
        # Under torchrun only rank 0's final report names the export: one evaluation per job.
        if not report.final or "drafter" not in report.artifacts:
            return None
        from dflash_flow.model import MODEL_LOAD_LOCK
        from dflash_flow.model.evaluation import evaluate_exported

        if self.torch_threads:
            import torch

            torch.set_num_threads(self.torch_threads)
        # Evaluation builds models (target, drafters): hold the process-wide model lock.
        with MODEL_LOAD_LOCK:
            return evaluate_exported(progress=self._progress_hook(), drafter_path=report.artifacts["drafter"],
                                     seed=self._ctx.seed_for(0, "evaluation"), device=self._ctx.device,
                                     **self.evaluation_settings(self._spec, self._ctx.output_dir))
