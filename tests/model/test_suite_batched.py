"""``decode_suite`` batched (the same turn of many prompts together) against one request at a time: every
request's tokens, steps, accepted drafts and counts are the same, in the same order; a second mt-bench turn
follows the target's own first reply either way. A real export of a tiny drafter against the embedded target."""

from __future__ import annotations

import json

import attrs
import pytest
import torch

from dflash_flow.data.chat import stop_token_ids
from dflash_flow.data.suites import read_suite
from dflash_flow.model.export import load_drafter
from dflash_flow.model.suite_eval import decode_suite, suite_figures
from dflash_flow.model.target import load_target

pytestmark = pytest.mark.usefixtures("one_thread")

TIMES = ("spec_s", "greedy_s")


def test_a_suite_decoded_in_batches_gives_every_request_its_own_figures(tiny_export, tmp_path):
    from transformers import AutoTokenizer

    drafter_dir, _, target = tiny_export
    mt = tmp_path / "question.jsonl"
    mt.write_text("".join(json.dumps({"question_id": i, "category": "writing", "turns": turns}) + "\n" for i, turns in (
        (81, ["Write two sentences about the sea.", "Now make them shorter."]),
        (82, ["Name a color."]),
        (83, ["Count to three, please, in words.", "And back down?"]))))
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = load_target(target, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, dtype=torch.float32, target_config=model.config)
    prompts = read_suite("mt-bench", mt)
    kw = dict(max_new_tokens=12, stop_token_ids=stop_token_ids(tok))
    seen: list[tuple[str, int]] = []
    one = decode_suite(model, drafter, tok, prompts, batch_size=1, **kw)
    many = decode_suite(model, drafter, tok, prompts, batch_size=2, on_request=lambda r: seen.append((r.prompt_id, r.turn)),
                        **kw)
    assert [(r.prompt_id, r.turn) for r in many] == [(r.prompt_id, r.turn) for r in one]
    assert sorted(seen) == sorted((r.prompt_id, r.turn) for r in one)
    for a, b in zip(one, many, strict=True):
        assert {k: v for k, v in attrs.asdict(b).items() if k not in TIMES} == {
            k: v for k, v in attrs.asdict(a).items() if k not in TIMES}
    same = {k for k in suite_figures(one, 4) if k not in ("spec_s", "greedy_s", "speedup_wall")}
    assert {k: suite_figures(many, 4)[k] for k in same} == {k: suite_figures(one, 4)[k] for k in same}
