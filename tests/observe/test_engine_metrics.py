"""Acceptance as engines count it: Prometheus text, counter deltas summed over engines and servers, resets
refused, missing positions, per-request figures (vLLM, SGLang), and the engine-vs-ours check. The servers are
fake engines in real processes (``tests/fake_engine.py``) whose figures the tests chose."""

from __future__ import annotations

import json
import math
import urllib.request

import fake_engine
import pytest

from dflash_flow.observe.engine_metrics import (
    LIKELY_CAUSES,
    CounterReset,
    compare,
    fetch_text,
    mismatch_warning,
    parse_prometheus,
    rates_from_histogram,
    request_summary,
    sglang_request,
    spec_counters,
    spec_delta,
    vllm_request,
    weak_drafter_note,
)


def post(url: str, path: str, payload: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def complete(url: str, ids: list[int], max_tokens: int = 64) -> dict:
    return post(url, "/v1/completions", {"model": "fake", "prompt": ids, "max_tokens": max_tokens, "temperature": 0})


@pytest.fixture
def engines(tmp_path):
    procs = []

    def run(scenario: dict, name: str = "engine") -> str:
        url, proc = fake_engine.start(scenario, tmp_path, name)
        procs.append(proc)
        return url

    yield run
    for p in procs:
        fake_engine.stop(p)


def test_prometheus_text_is_parsed_with_labels_escapes_and_timestamps():
    text = "\n".join([
        "# HELP vllm:x A counter.", "# TYPE vllm:x counter",
        'vllm:x_total{engine="0",model_name="a \\"quoted\\" \\\\ name"} 12.0 1700000000000',
        'vllm:x_total{engine="1",model_name="m",} 3',
        "plain_gauge NaN", "inf_gauge +Inf", "",
        "# EOF",
    ])
    samples = parse_prometheus(text)
    assert [(s.name, dict(s.labels).get("engine"), s.value) for s in samples[:2]] == [
        ("vllm:x_total", "0", 12.0), ("vllm:x_total", "1", 3.0)]
    assert dict(samples[0].labels)["model_name"] == 'a "quoted" \\ name'
    assert math.isnan(samples[2].value) and samples[3].value == math.inf
    with pytest.raises(ValueError, match="metrics line 2: malformed labels"):
        parse_prometheus('ok 1\nbad{engine=0} 1')
    with pytest.raises(ValueError, match="metrics line 1: 'x' is not a number"):
        parse_prometheus("name x")


def test_counter_deltas_sum_over_engines_and_servers(engines):
    # Two servers of two engines each; requests alternate between a server's engines. Steps of accepted
    # drafts per request are known, so every figure has a known answer.
    a = engines({"engines": 2, "positions": 3, "steps": [3, 0, 1, 2]}, "a")
    b = engines({"engines": 2, "positions": 3, "steps": [1, 1]}, "b")
    warmup = complete(a, [1, 2, 3])  # traffic before the window: not counted
    assert warmup["choices"][0]["token_ids"]

    def scrape() -> dict:
        return {f"{name}|{k}": c for name, url in (("a", a), ("b", b))
                for k, c in spec_counters(fetch_text(url + "/metrics")).items()}

    before = scrape()
    assert set(before) == {"a|engine=0,model_name=fake", "a|engine=1,model_name=fake",
                           "b|engine=0,model_name=fake", "b|engine=1,model_name=fake"}
    for _ in range(3):
        complete(a, [1, 2, 3])
    for _ in range(5):
        complete(b, [4, 5])
    d = spec_delta(before, scrape())
    steps_a, steps_b = [3, 0, 1, 2] * 3, [1, 1] * 5
    all_steps = steps_a + steps_b
    assert d.engines == 4 and d.drafts == len(all_steps) and d.draft_tokens == 3 * len(all_steps)
    assert d.accepted == sum(all_steps)
    assert d.tau_per_step == pytest.approx(1 + sum(all_steps) / len(all_steps))
    assert d.accept_rate_per_position == pytest.approx(
        [sum(s > k for s in all_steps) / len(all_steps) for k in range(3)])
    assert d.draft_acceptance_rate == pytest.approx(sum(all_steps) / (3 * len(all_steps)))
    assert not d.missing_positions


def test_a_reset_counter_is_refused_not_subtracted(engines):
    url = engines({"engines": 2, "steps": [2, 2], "reset_after": 3})
    start = spec_counters(fetch_text(url + "/metrics"))
    complete(url, [1])
    complete(url, [1])
    mid = spec_counters(fetch_text(url + "/metrics"))
    assert spec_delta(start, mid).drafts == 4
    complete(url, [1])  # the third request restarts engine 0 (its counters start again from 0)
    with pytest.raises(CounterReset, match=r"engine engine=0,model_name=fake: vllm:spec_decode_num_drafts_total "
                                           r"went down from 2 to 0 .*restarted"):
        spec_delta(mid, spec_counters(fetch_text(url + "/metrics")))


def test_an_engine_that_vanishes_is_a_reset(engines):
    url = engines({"engines": 3, "steps": [1], "vanish_after": 2})
    before = spec_counters(fetch_text(url + "/metrics"))
    assert len(before) == 3
    complete(url, [9])
    complete(url, [9])
    with pytest.raises(CounterReset, match="engine engine=2,model_name=fake vanished"):
        spec_delta(before, spec_counters(fetch_text(url + "/metrics")))


def test_missing_positions_count_zero_and_are_named(engines):
    url = engines({"engines": 2, "positions": 3, "steps": [3, 3], "missing_positions": {"1": [2]}})
    before = spec_counters(fetch_text(url + "/metrics"))
    for _ in range(2):  # one request per engine
        complete(url, [5])
    d = spec_delta(before, spec_counters(fetch_text(url + "/metrics")))
    assert d.missing_positions == {"engine=1,model_name=fake": (2,)}
    # Position 3 is seen on engine 0 only (2 of the 4 steps' acceptances): counted as 0 on engine 1.
    assert d.accept_rate_per_position == pytest.approx([1.0, 1.0, 0.5])
    assert d.to_json()["missing_positions"] == {"engine=1,model_name=fake": [2]}


def test_a_server_without_spec_counters_gives_no_delta(engines):
    url = engines({"engines": 1, "steps": []})
    assert spec_counters("# a server without speculation\nvllm:num_requests_running 0\n") == {}
    before = spec_counters(fetch_text(url + "/metrics"))
    complete(url, [1])
    d = spec_delta(before, spec_counters(fetch_text(url + "/metrics")))
    assert d.drafts == 0 and d.tau_per_step is None and d.accept_rate_per_position is None


def test_vllm_per_request_figures_and_the_three_averages(engines):
    # Two requests of different lengths: pooled per step, mean of means and per token all differ.
    r1, r2 = [3, 3, 3, 3], [0]
    url = engines({"engines": 1, "positions": 3, "per_request": True,
                   "replies": {json.dumps([1]): {"ids": list(range(17)), "steps": r1},
                               json.dumps([2]): {"ids": [5, 6], "steps": r2}}})
    specs = [vllm_request(complete(url, [1])), vllm_request(complete(url, [2]))]
    assert specs[0].steps == 4 and specs[0].accepted == 12 and specs[0].histogram == (0, 0, 0, 4)
    assert specs[0].completion_tokens == 17 and specs[1].mean_acceptance == 1.0
    s = request_summary(specs)
    assert s["tau_per_step"] == pytest.approx(1 + 12 / 5)  # pooled: 3.4
    assert s["tau_per_request"] == pytest.approx((4.0 + 1.0) / 2)  # z-lab's mean of means: 2.5
    assert s["tau_per_token"] == pytest.approx((17 + 2) / 5)  # SpecForge's: 3.8
    assert s["histogram_accepted_drafts"] == [1, 0, 0, 4]
    assert s["accept_rate_per_position"] == pytest.approx([0.8, 0.8, 0.8])
    assert vllm_request({"choices": [], "usage": {}}) is None  # served without the flag


def test_sglang_meta_info(engines):
    url = engines({"kind": "sglang", "positions": 3, "steps": [2, 0, 3]})
    out = post(url, "/generate", {"input_ids": [1, 2], "sampling_params": {"temperature": 0, "max_new_tokens": 64}})
    spec = sglang_request(out["meta_info"])
    assert (spec.steps, spec.accepted, spec.histogram, spec.completion_tokens) == (3, 5, (1, 0, 1, 1), 9)
    assert request_summary([spec])["tau_per_token"] == pytest.approx(9 / 3)
    # Without a histogram: the accepted drafts follow from the tokens (the prefill gives one, a step one more).
    assert sglang_request({"spec_verify_ct": 4, "completion_tokens": 11}).accepted == 11 - 1 - 4
    assert sglang_request({"completion_tokens": 3}) is None
    with pytest.raises(ValueError, match="spec_verify_ct must be a count"):
        sglang_request({"spec_verify_ct": -1})


def test_rates_from_a_histogram():
    assert rates_from_histogram([2, 1, 0, 1]) == pytest.approx([0.5, 0.25, 0.25])
    assert rates_from_histogram([0, 0]) is None


def test_comparison_and_the_loud_warning():
    ok = compare(2.0, [0.6, 0.3, 0.1], 2.02, [0.61, 0.3, 0.11], tau_tolerance=0.05, rate_tolerance=0.03)
    assert ok.ok and ok.tau_difference == pytest.approx(0.02) and not ok.problems
    bad = compare(2.0, [0.6, 0.3, 0.1], 1.1, [0.1, 0.0, 0.0], tau_tolerance=0.05, rate_tolerance=0.03)
    assert not bad.ok and bad.problems[0].startswith("tau 1.100 (engine) vs 2.000 (ours)")
    assert [p.split(":")[0] for p in bad.problems[1:]] == ["position 1", "position 2", "position 3"]
    text = mismatch_warning("gsm8k", bad)
    assert "WARNING: gsm8k: the serving engine's acceptance is NOT ours" in text
    for needle in ("layer ids", "mask token", "thinking", "rope", "features", "k_norm"):
        assert needle in text
    assert len(LIKELY_CAUSES) == 6
    ours_row = next(line for line in text.splitlines() if line.strip().startswith("ours"))
    assert ours_row.split()[1:] == ["2.000", "0.600", "0.300", "0.100"]
    nothing = compare(2.0, [0.5], None, None, tau_tolerance=0.05, rate_tolerance=0.03)
    assert not nothing.ok and "counted no drafts" in nothing.problems[0]
    wrong_width = compare(2.0, [0.5, 0.5], 2.0, [0.5, 0.5, 0.0], tau_tolerance=0.05, rate_tolerance=0.03)
    assert "num_speculative_tokens must be block_size - 1" in wrong_width.problems[0]


def test_weak_drafter_verdict():
    note = weak_drafter_note("trained", 1.03)
    assert note.startswith("verdict: the trained drafter barely beats plain decoding (acceptance length 1.03 < 1.3")
    assert "regenerate" in note and "too little training data" in note
    assert weak_drafter_note("trained", 2.4) is None and weak_drafter_note("trained", float("nan")) is None


def test_fetch_errors_name_the_server_without_its_password():
    with pytest.raises(OSError) as err:
        fetch_text("http://user:s3cret-pw@127.0.0.1:9/metrics", timeout_s=5)
    assert "s3cret-pw" not in str(err.value) and "127.0.0.1:9" in str(err.value)
