"""Evaluation results are typed from the model to the console: horizons and temperatures are keys and
fields, run facts are fields, and the ``eval`` command's table and the run summary read them (nothing
rebuilds ``tau_h<H>`` to look a value up). A real export of a tiny drafter against the embedded target."""

from __future__ import annotations

import pytest

from dflash_flow.items import EvalReport


@pytest.fixture
def exported(tiny_export):
    return tiny_export


def test_evaluate_exported_reports_typed_results(exported):
    from dflash_flow.embedded import embedded_walk_data
    from dflash_flow.model.evaluation import evaluate_exported
    from dflash_flow.observe.names import eval_label, eval_metrics

    drafter, prompts, target = exported
    reports = evaluate_exported(target=target, drafter_path=drafter, prompts_path=prompts, limit=2,
                                max_new_tokens=[4, 6], baseline=False, temperatures=[0.0, 0.7],
                                walk_data=embedded_walk_data(), walk_limit=2, walk_horizons=[4, 12])
    assert all(isinstance(r, EvalReport) for r in reports)
    greedy, walk, sampled = reports
    assert (greedy.name, greedy.temperature, greedy.horizons, greedy.max_new_tokens) == ("trained", 0.0, (4, 6), 4)
    assert greedy.lossless is True and greedy.num_prompts == 2 and greedy.metrics["tau"] == greedy.at(4)
    assert set(greedy.by_horizon[6]) == {"tau", "speedup_forwards", "tokens_generated"}
    assert "lossless" not in greedy.metrics and "num_prompts" not in greedy.metrics  # facts are fields
    assert (walk.name, walk.horizons, walk.num_conversations, walk.temperature) == ("walk", (4, 12), 2, None)
    assert (sampled.name, sampled.temperature, sampled.lossless, sampled.top_p) == ("trained", 0.7, None, 1.0)
    # The flat names users see in MLflow, made from the typed fields in one place.
    assert [eval_label(r) for r in reports] == ["trained", "walk", "trained-T0_7"]
    assert eval_metrics(greedy)["tau_h6"] == greedy.at(6) and eval_metrics(walk)["tau_h12"] == walk.at(12)


def test_eval_command_table_reads_the_typed_reports(exported, capsys):
    from dflash_flow.app.commands import eval_command

    drafter, prompts, target = exported
    code = eval_command(drafter, target, prompts, 4, 2, False, None, temperature=1.0, horizons=[4, 6])
    out = capsys.readouterr().out
    assert code == 0, out
    header = next(line for line in out.splitlines() if "acceptance_length" in line and "drafter" in line)
    assert "acceptance@6" in header and "acceptance@4" not in header.replace("acceptance_length", "")
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()[:1] in (["trained"], ["trained-T1"])}
    assert set(rows) == {"trained", "trained-T1"}
    assert rows["trained"][4] == "yes"  # lossless, from the typed field
    assert float(rows["trained"][2]) >= 1.0  # tau at 6 new tokens, from by_horizon


@pytest.mark.parametrize(("temperatures", "baseline"), [([0.0], False), ([0.0, 1.0], True)])
def test_evaluate_exported_figures_do_not_depend_on_the_batch(exported, temperatures, baseline):
    """Batch 1 (one prompt, one conversation at a time) against batch 2 (prompts decoded together, the walk's drafts
    batched; with a sampled decoding the walk's first target forwards run on a second thread beside it): every
    figure but the seconds, the reports in the same order."""
    from concurrent.futures import ThreadPoolExecutor

    from dflash_flow.embedded import embedded_walk_data
    from dflash_flow.model.evaluation import (
        _load_models,
        _walk_inputs_beside,
        evaluate_exported,
        read_walk_conversations,
    )

    drafter, prompts, target = exported
    kw = dict(target=target, drafter_path=drafter, prompts_path=prompts, limit=3, max_new_tokens=[6], baseline=baseline,
              temperatures=temperatures, walk_data=embedded_walk_data(), walk_limit=6, walk_horizons=[4, 12])
    wall = ("greedy_s", "spec_s", "speedup_wall")

    def figures(reports):
        return [(r.name, r.temperature, r.lossless, {k: v for k, v in r.metrics.items() if k not in wall},
                 r.by_horizon) for r in reports]

    one, two = evaluate_exported(batch_size=1, **kw), evaluate_exported(batch_size=2, **kw)
    assert figures(one) == figures(two)
    sampled = [("trained", 1.0)] * (len(temperatures) - 1)
    untrained = [("untrained", t) for t in temperatures] if baseline else []
    assert [(r.name, r.temperature) for r in two] == [("trained", 0.0), ("walk", None), *sampled, *untrained]
    tok, model, d = _load_models(target, None, drafter, "cpu")
    with ThreadPoolExecutor(1) as pool:  # batch 2 did take the walk's forwards beside decoding
        beside = _walk_inputs_beside(pool, model, d, read_walk_conversations(embedded_walk_data(), tok, 6, []), 12,
                                     [], 8)
        assert beside is not None and len(beside.result()) == 6


def test_batch_size_one_walks_every_conversation_alone(exported, monkeypatch):
    """Batch 1 is main's loop (the bench's "before"): no batched walk forwards, no batched drafts."""
    import dflash_flow.model.walk as walk
    from dflash_flow.embedded import embedded_walk_data
    from dflash_flow.model.evaluation import evaluate_exported

    def refuse(*_args, **_kwargs):
        raise AssertionError("a batched walk at batch_size 1")

    monkeypatch.setattr(walk, "walk_inputs", refuse)
    monkeypatch.setattr(walk, "walk_batch", refuse)
    drafter, prompts, target = exported
    reports = evaluate_exported(target=target, drafter_path=drafter, prompts_path=prompts, limit=2, max_new_tokens=[6],
                                baseline=False, temperatures=[0.0, 1.0], walk_data=embedded_walk_data(), walk_limit=3,
                                walk_horizons=[4], batch_size=1)
    assert [r.name for r in reports] == ["trained", "walk", "trained"] and reports[1].num_conversations == 3
