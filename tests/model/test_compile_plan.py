"""``compile: auto`` (model.compile_plan): a short run or a test never compiles and measures nothing; a long run
compiles when the measured eager steps times the saving beat the compiling, says so once, records what compiling
really cost and saved for the next run, and goes back to eager when compiled steps turn out slower."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from model_testlib import build_drafter, build_target, target_features

from dflash_flow.model import compile_plan as cp
from dflash_flow.model.blockplan import sample_anchors
from dflash_flow.model.compile_plan import CompilePlan, plan_steps
from dflash_flow.model.head import SharedHead
from dflash_flow.model.objective import dflash_loss


@pytest.fixture(scope="module")
def target():
    return build_target()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(plan: CompilePlan, clock: Clock, gaps: list[float], shape=(4, 512)) -> None:
    for gap in gaps:
        plan.tick(shape)
        clock.now += gap


def _plan(drafter, tmp_path, steps: int) -> tuple[CompilePlan, Clock]:
    clock = Clock()
    drafter.compiled = "auto"
    plan = drafter.compile_plan = CompilePlan(drafter, record=tmp_path / "record.json", clock=clock, cpu_clock=clock)
    plan_steps(drafter, steps)
    return plan, clock


def test_a_short_run_through_the_real_loss_never_compiles_nor_measures(target, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_FLOW_CACHE", str(tmp_path))
    drafter = build_drafter(target)
    drafter.compiled = "auto"
    plan_steps(drafter, 50)  # the README's 50-batch run
    head = SharedHead(target.get_input_embeddings().weight, target.lm_head.weight)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 95, (2, 40), generator=g)
    loss_mask = torch.ones(2, 40, dtype=torch.long)
    feats = target_features(target, ids, drafter.target_layer_ids)
    for _ in range(3):
        out = dflash_loss(drafter, embed_tokens=head.embed_tokens, lm_head=head.lm_head, input_ids=ids,
                          loss_mask=loss_mask, hidden_states=feats, gamma=4.0,
                          anchors=sample_anchors(loss_mask, 4, generator=g))
        out.loss.backward()
    assert drafter.compile_plan.state == "eager" and drafter.compile_plan.message is None
    assert not drafter.compiled and not any(layer.compiled for layer in drafter.layers)
    assert not (tmp_path / cp.RECORD).exists()


def test_a_long_run_compiles_says_so_and_records_what_it_measured(target, tmp_path, caplog):
    drafter = build_drafter(target)
    plan, clock = _plan(drafter, tmp_path, 10_000)
    with caplog.at_level(logging.INFO, logger="dflash_flow"):
        _run(plan, clock, [2.0] + [0.1] * cp.WARMUP)  # a slow first step, then 100 ms steps
        assert plan.state == "waiting" and not drafter.compiled
        _run(plan, clock, [0.1])
    assert plan.state == "calibrating" and drafter.compiled and all(layer.compiled for layer in drafter.layers)
    left = 10_000 - cp.WARMUP - 1
    # one shape: ~40 s of compiling (defaults) against 12% of 100 ms over the steps left
    assert f"compiling: ~40 s, saves ~{0.12 * 0.1 * left:.0f} s over {left} steps" in caplog.text
    assert "defaults" in plan.message
    # The first compiled step compiles (30 s), the others take 85 ms.
    _run(plan, clock, [30.0] + [0.085] * (cp.CALIBRATE - 1))
    plan.tick((4, 512))
    assert plan.state == "compiled" and drafter.compiled
    record = json.loads((tmp_path / "record.json").read_text())[plan.key()]
    assert record["compile_s"] == pytest.approx(29.915, abs=0.01) and record["saving"] == pytest.approx(0.15, abs=1e-3)
    # The next run of this drafter on this machine starts from the measurement.
    again, _clock = _plan(build_drafter(target), tmp_path, 10_000)
    est = again.estimate()
    assert est.compile_s == pytest.approx(29.915, abs=0.01) and est.saving == pytest.approx(0.15) and "measured" in est.source


def test_too_few_steps_to_repay_it_stays_eager_and_says_why(target, tmp_path, caplog):
    drafter = build_drafter(target)
    plan, clock = _plan(drafter, tmp_path, 1_500)  # the embedded default's length
    with caplog.at_level(logging.INFO, logger="dflash_flow"):
        # Batches of two shapes: the second compiles again (dynamic sizes), 2 x 40 s.
        for i in range(cp.WARMUP + 2):
            _run(plan, clock, [0.08], shape=(4, 512) if i % 2 else (8, 256))
    assert plan.state == "eager" and not drafter.compiled
    assert "not compiling: ~80 s, saves ~14 s over 1491 steps" in caplog.text
    _run(plan, clock, [0.08] * 50)
    assert plan.state == "eager" and not drafter.compiled and not (tmp_path / "record.json").exists()


def test_compiled_steps_that_are_slower_go_back_to_eager(target, tmp_path):
    drafter = build_drafter(target)
    plan, clock = _plan(drafter, tmp_path, 100_000)
    _run(plan, clock, [0.1] * (cp.WARMUP + 2))
    assert plan.state == "calibrating" and drafter.compiled
    _run(plan, clock, [20.0] + [0.12] * cp.CALIBRATE)
    assert plan.state == "reverted" and not drafter.compiled and not any(layer.compiled for layer in drafter.layers)
    assert "back to eager" in plan.message
    assert json.loads((tmp_path / "record.json").read_text())[plan.key()]["saving"] < 0


def test_auto_off_the_cpu_stays_eager_and_says_how_to_compile(target, tmp_path, caplog):
    drafter = build_drafter(target).to("meta")
    plan, clock = _plan(drafter, tmp_path, 100_000)
    with caplog.at_level(logging.INFO, logger="dflash_flow"):
        _run(plan, clock, [0.1] * 3)
    assert plan.state == "eager" and not drafter.compiled
    assert "compiles on CPU only (this drafter is on meta); set compile: true" in caplog.text


def test_a_bad_compile_value_is_refused(target):
    with pytest.raises(ValueError, match="compile must be true, false or 'auto'"):
        build_drafter(target).compiled = "sometimes"


def test_steps_waiting_for_a_core_stretch_the_compiling_estimate(target, tmp_path, caplog):
    """Steps that got a third of a core (wall 3x their CPU time): compiling would wait as long, 3 x 40 s."""
    drafter = build_drafter(target)
    clock, cpu = Clock(), Clock()
    drafter.compiled = "auto"
    plan = drafter.compile_plan = CompilePlan(drafter, record=tmp_path / "r.json", clock=clock, cpu_clock=cpu)
    plan_steps(drafter, 3_000)
    with caplog.at_level(logging.INFO, logger="dflash_flow"):
        for _ in range(cp.WARMUP + 2):
            plan.tick((4, 512))
            clock.now += 0.3
            cpu.now += 0.1
    assert plan.state == "eager" and not drafter.compiled  # 108 s saved beats 1.5 x 40 s, not 1.5 x 120 s
    assert "not compiling: ~120 s, saves ~108 s over 2991 steps (300 ms each eager, 12% saved, 1 shape compiled, x3.0" \
        in caplog.text
