"""Evaluation shows progress and honours a stop: ``evaluate_exported`` reports every unit of work (a prompt
at one horizon, a conversation walked) with its total known up front; the stage puts it on the console's
progress line (prompts, tok/s, ETA) and a stop abandons the rest at once, leaving no thread behind. A real
export of a tiny drafter against the embedded target."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import attrs
import pytest

from dflash_flow.core import Graph, Pipeline, Source, register_stage
from dflash_flow.core.errors import PipelineInterrupted, StopRequested
from dflash_flow.items import StepReport
from dflash_flow.model.spec import ModelSpec
from dflash_flow.services import RunServices
from dflash_flow.stages.monitor import Monitor
from dflash_flow.stages.spec_eval import SpecDecodeEval


@pytest.fixture
def exported(tiny_export):
    return tiny_export


def test_every_unit_is_reported_against_a_total_known_first(exported):
    from dflash_flow.embedded import embedded_walk_data
    from dflash_flow.model.evaluation import evaluate_exported

    drafter, prompts, target = exported
    calls: list[tuple[int, int, int]] = []
    evaluate_exported(target=target, drafter_path=drafter, prompts_path=prompts, limit=3, max_new_tokens=[4, 6],
                      baseline=False, temperatures=[0.0, 1.0], walk_data=embedded_walk_data(), walk_limit=2,
                      progress=lambda *a: calls.append(a))
    total = 2 * 3 * 2 + 2  # temperatures x prompts x horizons + conversations walked
    assert calls[0] == (0, total, 0)
    assert [c[0] for c in calls] == list(range(total + 1)) and {c[1] for c in calls} == {total}
    assert all(c[2] > 0 for c in calls[1:])  # every unit produced or walked tokens


def test_a_raising_progress_hook_abandons_the_rest(exported):
    from dflash_flow.model.evaluation import evaluate_exported

    drafter, prompts, target = exported
    seen: list[int] = []

    def hook(done: int, total: int, tokens: int) -> None:
        seen.append(done)
        if done == 2:
            raise StopRequested("stop")

    with pytest.raises(StopRequested):
        evaluate_exported(target=target, drafter_path=drafter, prompts_path=prompts, limit=3, max_new_tokens=8,
                          baseline=False, temperatures=[0.0, 1.0], progress=hook)
    assert seen == [0, 1, 2]


@register_stage("TestFinalReport")
@attrs.define(kw_only=True, eq=False)
class FinalReport(Source):
    """The trainer's last report, naming an export (what SpecDecodeEval waits for)."""

    drafter: str = ""
    output_type = StepReport

    def produce(self):
        yield StepReport(step=1, epoch=0, meta=None, final=True, artifacts={"drafter": self.drafter})


def _graph(tmp_path: Path, exported, **evaluate) -> Graph:
    drafter, prompts, target = exported
    g = Graph(name="evalprogress", output_dir=str(tmp_path / "out"))
    g.add("trainer", FinalReport(drafter=str(drafter)))
    g.add("evaluate", SpecDecodeEval(prompts=str(prompts), limit=3, **evaluate), inputs="trainer")
    g.add("monitor", Monitor(interval_s=60.0, progress_interval_s=0.01), inputs="evaluate")
    return g


def _services(exported) -> RunServices:
    target = exported[2]
    return RunServices(model=ModelSpec(declared=target, target=target, tokenizer=target))


def test_the_console_shows_evaluation_progress(tmp_path, exported, capsys):
    services = _services(exported)
    Pipeline(_graph(tmp_path, exported, max_new_tokens=6, temperatures=[0.0]), services=services,
             check_devices=False).run()
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if "evaluate: held-out decoding and walk" in ln]
    assert any("0/3 units" in ln for ln in lines) and any("3/3 units" in ln and "tok/s" in ln for ln in lines), err
    assert services.record.phase.done == services.record.phase.total == 3
    assert "eval trained" in err  # the results follow


def test_a_stop_during_evaluation_ends_it_at_once(tmp_path, exported):
    services = _services(exported)
    before = set(threading.enumerate())
    pipe = Pipeline(_graph(tmp_path, exported, max_new_tokens=48, temperatures=[0.0, 1.0]), services=services,
                    check_devices=False)
    record = services.record

    def stop_after_first_unit() -> None:
        while record.phase is None or record.phase.done < 1:
            time.sleep(0.01)
        pipe.stop("test stop")

    stopper = threading.Thread(target=stop_after_first_unit, daemon=True)
    stopper.start()
    with pytest.raises(PipelineInterrupted):
        pipe.run()
    assert record.phase.done < record.phase.total  # the rest was abandoned
    assert not record.evals
    leftover = [t for t in set(threading.enumerate()) - before if t.is_alive() and t is not stopper]
    assert leftover == [], leftover
