"""``SpecDecodeEval.quick``: the short run's evaluation (issue 40.20), and what it skips."""

from __future__ import annotations

from pathlib import Path

import attrs

from dflash_flow.model.spec import ModelSpec
from dflash_flow.stages.spec_eval import SpecDecodeEval


def test_quick_evaluation_skips_sampling_long_horizons_and_most_prompts(tmp_path, tiny_export):
    """``quick`` (the short run's evaluation): at most 8 prompts, greedy only, no baseline, the walk on at most
    16 conversations at max_new_tokens only; without it the stage's own settings pass through."""
    target = tiny_export[2]
    spec = ModelSpec(declared=target, target=target, tokenizer=target)
    stage = SpecDecodeEval(prompts="embedded", limit=16, max_new_tokens=64, horizons=[448], temperatures=[0.0, 1.0],
                           walk_data="embedded", walk_limit=64, walk_horizons=[64, 448], baseline=True)
    full = stage.evaluation_settings(spec, tmp_path / "full")
    assert (full["limit"], full["max_new_tokens"], full["temperatures"], full["walk_limit"], full["walk_horizons"],
            full["baseline"]) == (16, [64, 448], [0.0, 1.0], 64, [64, 448], True)
    quick = attrs.evolve(stage, quick=True).evaluation_settings(spec, tmp_path / "quick")
    assert (quick["limit"], quick["max_new_tokens"], quick["temperatures"], quick["walk_limit"],
            quick["walk_horizons"], quick["baseline"]) == (8, [64], [0.0], 16, [64], False)
    assert len(Path(quick["prompts_path"]).read_text().splitlines()) == 8
