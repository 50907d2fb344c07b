"""SpecDecodeEval: after training, real speculative decoding on held-out prompts."""

from __future__ import annotations

from typing import Any

import attrs

from dflash_flow.core import Stage, cfg
from dflash_flow.items import EvalReport, StepReport


@attrs.define(kw_only=True, eq=False)
class SpecDecodeEval(Stage):
    """On the trainer's final report: acceptance length and target-forward speedup, trained vs untrained."""

    @classmethod
    def preload(cls) -> None:
        import dflash_flow.model.evaluation  # noqa: F401
        import dflash_flow.model.speculative  # noqa: F401

    input_type = StepReport
    output_type = EvalReport
    cardinality = "1:n"
    singleton = True

    target: str | dict[str, Any] = cfg(doc="The target model (as in TargetForward).")
    prompts: str = cfg(doc="JSONL of held-out prompts ({'prompt': ...} or {'conversations': [...]}); 'embedded' for the built-in set.")
    tokenizer: str | None = cfg(None, doc="Tokenizer path (default: the target directory).")
    limit: int = cfg(32, ge=1, doc="Prompts to evaluate.")
    max_new_tokens: int = cfg(64, ge=1, doc="Tokens generated per prompt.")
    baseline: bool = cfg(True, doc="Also evaluate an untrained drafter of the same shape.")

    def setup(self, ctx) -> None:
        self._ctx = ctx

    def process(self, report: StepReport):
        # Under torchrun only rank 0's final report names the export: one evaluation per job.
        if not report.final or "drafter" not in report.artifacts:
            return None
        from dflash_flow.embedded import resolve_target, write_eval_prompts
        from dflash_flow.model.evaluation import evaluate_exported
        from dflash_flow.model.loading import MODEL_LOAD_LOCK

        prompts = self.prompts
        if prompts == "embedded":
            prompts = str(write_eval_prompts(self._ctx.output_dir / "eval_prompts.jsonl", self.limit))
        # Evaluation builds models (target, drafters): hold the process-wide model lock.
        with MODEL_LOAD_LOCK:
            results = evaluate_exported(
                target=resolve_target(self.target),
                drafter_path=report.artifacts["drafter"],
                prompts_path=prompts,
                tokenizer_path=self.tokenizer,
                limit=self.limit,
                max_new_tokens=self.max_new_tokens,
                baseline=self.baseline,
                seed=self._ctx.seed_for(0, "baseline"),
                device=self._ctx.device,
            )
        return [EvalReport(name=name, metrics=m) for name, m in results.items()]
