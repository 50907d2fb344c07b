"""``dflash-flow eval --suite``: the standard suites through the command, on the embedded target and a tiny
exported drafter (``tiny_export``): the results file, the table, the plot, MLflow read back; mt-bench's
second turn after the target's own reply; the engine beside ours through fake engines in real processes
(``tests/fake_engine.py``): agreement, a loud disagreement, SGLang's per-request figures; bad input refused
with one line."""

from __future__ import annotations

import json
from pathlib import Path

import fake_engine
import pytest
from typer.testing import CliRunner

from dflash_flow.cli import app

H = 8  # new tokens per request: the figures' arithmetic, not their size, is under test


def write_suites(root: Path) -> dict[str, Path]:
    gsm = root / "gsm8k.jsonl"
    gsm.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in
                           ("Ann has 3 pens and buys 4 more. How many pens?", "What is 6 times 5?")))
    mt = root / "question.jsonl"
    mt.write_text(json.dumps({"question_id": 81, "category": "writing",
                              "turns": ["Write two sentences about the sea.", "Now make them shorter."]}) + "\n")
    return {"gsm8k": gsm, "mt-bench": mt}


def invoke(*args: str):
    result = CliRunner().invoke(app, ["eval", *args])
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def setup(tiny_export, tmp_path_factory):
    drafter, _, target = tiny_export
    root = tmp_path_factory.mktemp("suites")
    return drafter, target, write_suites(root)


@pytest.fixture(scope="module")
def ours(setup):
    """Our decoding of the suites' requests (the figures a faithful engine must reproduce)."""
    import torch
    from transformers import AutoTokenizer

    from dflash_flow.data.chat import stop_token_ids
    from dflash_flow.data.suites import read_suite
    from dflash_flow.model.export import load_drafter
    from dflash_flow.model.suite_eval import decode_suite
    from dflash_flow.model.target import load_target

    drafter_dir, target, suites = setup
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = load_target(target, dtype=torch.float32)
    drafter = load_drafter(drafter_dir, dtype=torch.float32, target_config=model.config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch-1 decoding of a tiny model: one thread (two spin against a busy machine)
    try:
        return {name: decode_suite(model, drafter, tok, read_suite(name, path), max_new_tokens=H,
                                   stop_token_ids=stop_token_ids(tok)) for name, path in suites.items()}, tok
    finally:
        torch.set_num_threads(threads)


def test_mt_bench_second_turn_follows_the_targets_own_reply(ours):
    results, tok = ours
    first, second = results["mt-bench"]
    assert (first.turn, second.turn) == (0, 1) and first.lossless and second.lossless
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids
    rendered = tok.decode(second.prompt_ids)
    assert tok.decode(first.greedy_ids, skip_special_tokens=True) in rendered
    assert rendered.index("Write two sentences") < rendered.index("Now make them shorter.")


@pytest.mark.slow
def test_eval_suites_writes_results_table_plot_and_mlflow(setup, tmp_path):
    from mlflow import MlflowClient

    drafter, target, suites = setup
    out = tmp_path / "results.json"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    code, stdout, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"gsm8k={suites['gsm8k']}",
                                  "--suite", f"mt-bench={suites['mt-bench']}", "--max-new-tokens", str(H),
                                  "--out", str(out), "--tracking-uri", uri)
    assert code == 0, stderr
    r = json.loads(out.read_text())
    assert r["block_size"] == 4 and r["chat_template"] == {"enable_thinking": False, "template_reads_it": False}
    gsm, mt = r["suites"]["gsm8k"], r["suites"]["mt-bench"]
    assert (gsm["prompts"], gsm["requests"], mt["prompts"], mt["requests"]) == (2, 2, 1, 2)
    for s in (gsm, mt):
        assert s["lossless"] == f"{s['requests']}/{s['requests']}"
        assert len(s["accept_rate_per_position"]) == 3 and len(s["histogram"]) == 5
        assert sum(s["histogram"]) == sum(s["histogram_accepted_drafts"]) == s["verify_steps"]
        assert s["tau_per_step"] >= 1.0 and s["tau_per_request"] >= 1.0
        assert s["target_forwards"] == s["requests"] + s["verify_steps"] and "engine" not in s
    assert "engine" not in r
    assert "gsm8k" in stdout and "mt-bench" in stdout and "tau/step" in stdout and "pos 3" in stdout
    assert (tmp_path / "results.positions.png").stat().st_size > 1000
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("dflash-flow-eval").experiment_id])
    assert run.data.metrics["suite/gsm8k/tau_per_step"] == pytest.approx(gsm["tau_per_step"])
    assert run.data.metrics["suite/mt-bench/lossless_fraction"] == 1.0
    positions = client.get_metric_history(run.info.run_id, "suite/gsm8k/accept_rate_per_position")
    assert sorted(m.step for m in positions) == [1, 2, 3]
    assert run.data.params["max_new_tokens"] == str(H) and run.data.tags["dflash_flow.kind"] == "eval-suites"
    assert {a.path for a in client.list_artifacts(run.info.run_id, "eval")} == {
        "eval/results.json", "eval/results.positions.png"}


def scenario(results, *, kind="vllm", steps_of=None, per_request=False) -> dict:
    """A fake engine that answers every request of ``results`` with our output; its steps are ours (the
    engine's count: drafts accepted, not cut), or ``steps_of(request)``."""
    replies = {json.dumps(r.prompt_ids): {"ids": r.new_ids, "steps": (steps_of or (lambda q: q.accepted))(r)}
               for rs in results.values() for r in rs}
    return {"kind": kind, "engines": 2, "positions": 3, "replies": replies, "per_request": per_request}


@pytest.fixture
def server(tmp_path):
    procs = []

    def run(sc: dict) -> str:
        url, proc = fake_engine.start(sc, tmp_path)
        procs.append(proc)
        return url

    yield run
    for p in procs:
        fake_engine.stop(p)


def test_an_engine_that_counts_as_we_do_agrees(setup, ours, server, tmp_path):
    drafter, target, suites = setup
    url = server(scenario(ours[0], per_request=True))
    out = tmp_path / "r.json"
    code, stdout, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"gsm8k={suites['gsm8k']}",
                                  "--suite", f"mt-bench={suites['mt-bench']}", "--max-new-tokens", str(H), "--out",
                                  str(out), "--server", url, "--no-mlflow")
    assert code == 0, stderr
    r = json.loads(out.read_text())
    assert r["engine"]["kinds"] == ["vllm"] and r["engine"]["served_model"] == "fake"
    for name, s in r["suites"].items():
        e = s["engine"]
        assert e["lossless_vs_ours"] == f"{s['requests']}/{s['requests']}"
        assert e["tau_per_step"] == pytest.approx(s["tau_engine_count"])
        assert e["accept_rate_per_position"] == pytest.approx(s["accept_rate_per_position"])
        assert e["counters"]["engines"] == 2 and e["counters"]["drafts"] == s["verify_steps"]
        assert e["per_request"]["requests"] == s["requests"] and "note" not in e
        assert s["agreement"]["ok"] is True, (name, s["agreement"])
    assert "the engine's acceptance equals ours on every suite" in stdout and "WARNING" not in stderr


def test_an_engine_that_disagrees_is_impossible_to_miss(setup, ours, server, tmp_path):
    drafter, target, suites = setup
    # Every draft accepted by the engine where ours accepted none (or some): a wrong-features-like gap.
    url = server(scenario(ours[0], steps_of=lambda q: [3] * len(q.accepted)))
    out = tmp_path / "r.json"
    code, stdout, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"gsm8k={suites['gsm8k']}",
                                  "--max-new-tokens", str(H), "--out", str(out), "--server", url, "--no-mlflow")
    assert code == 1
    s = json.loads(out.read_text())["suites"]["gsm8k"]
    assert s["agreement"]["ok"] is False and s["engine"]["tau_per_step"] == pytest.approx(4.0)
    assert "WARNING: gsm8k: the serving engine's acceptance is NOT ours on the same prompts" in stderr
    assert "likely causes:" in stderr and "mask token" in stderr and "layer ids" in stderr
    engine_row = next(line for line in stderr.splitlines() if line.strip().startswith("engine"))
    assert engine_row.split()[1:] == ["4.000", "1.000", "1.000", "1.000"]


def test_launch_vllm_starts_a_server_measures_through_it_and_stops_it(setup, ours, tmp_path):
    """``--launch-vllm PYTHON``: the command starts ``PYTHON -m vllm.entrypoints.openai.api_server ...`` itself
    (here a fake engine that listens where the arguments say), measures through it, and stops it."""
    import os

    drafter, target, suites = setup
    sc = scenario(ours[0], per_request=True)
    sc.pop("model", None)  # the fake serves the name the command asks for
    python = fake_engine.as_vllm_python(sc, tmp_path)
    out = tmp_path / "r.json"
    code, _, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"gsm8k={suites['gsm8k']}",
                             "--max-new-tokens", str(H), "--out", str(out), "--launch-vllm", str(python), "--no-mlflow",
                             "--launch-arg=--max-num-seqs=1")
    assert code == 0, stderr
    r = json.loads(out.read_text())
    argv = json.loads((tmp_path / "scenario.json.argv.json").read_text())
    assert argv[:2] == ["-m", "vllm.entrypoints.openai.api_server"] and argv[-1] == "--max-num-seqs=1"
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": str(Path(drafter).resolve()), "num_speculative_tokens": 3}
    assert argv[argv.index("--per-request-spec-decode-metrics") + 1] == "detailed" and "--no-enable-prefix-caching" in argv
    assert r["launched"]["log"] == str(tmp_path / "r.vllm.log") and r["suites"]["gsm8k"]["agreement"]["ok"]
    port = int(argv[argv.index("--port") + 1])
    assert "started server vllm-eval" in stderr and "stopped server vllm-eval" in stderr
    import socket

    with socket.socket() as sock:  # nothing listens there any more: the server was stopped
        assert sock.connect_ex(("127.0.0.1", port)) != 0
    assert not [p for p in os.listdir("/proc") if p.isdigit() and f"{tmp_path}/scenario.json -m" in _cmdline(p)]


def _cmdline(pid: str) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def test_one_engine_kind_at_a_time(setup, server, tmp_path):
    drafter, target, suites = setup
    urls = [server({"kind": kind, "steps": [0]}) for kind in ("vllm", "sglang")]
    code, _, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"gsm8k={suites['gsm8k']}",
                             "--out", str(tmp_path / "r.json"), "--server", urls[0], "--server", urls[1], "--no-mlflow")
    assert code == 2 and f"{urls[0]} is vllm, {urls[1]} is sglang; one engine kind at a time" in stderr


def test_sglang_per_request_figures_stand_for_the_counters(setup, ours, server, tmp_path):
    drafter, target, suites = setup
    url = server(scenario(ours[0], kind="sglang"))
    out = tmp_path / "r.json"
    code, _, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"gsm8k={suites['gsm8k']}",
                             "--max-new-tokens", str(H), "--out", str(out), "--server", url, "--no-mlflow")
    assert code == 0, stderr
    r = json.loads(out.read_text())
    s, e = r["suites"]["gsm8k"], r["suites"]["gsm8k"]["engine"]
    assert r["engine"]["kinds"] == ["sglang"] and "counters" not in e
    assert e["tau_per_step"] == pytest.approx(s["tau_engine_count"])
    assert e["tau_per_token"] == pytest.approx(s["tau_per_token"])  # SpecForge's count, both sides


def test_batch_size_changes_only_the_seconds(setup, tmp_path):
    """``--batch-size`` reaches the decoding and the results: one at a time and in pairs, the same figures but the
    wall-clock ones, the batch size recorded."""
    drafter, target, suites = setup
    results = {}
    for bs in (1, 2):
        out = tmp_path / f"r{bs}.json"
        code, _, stderr = invoke("--drafter", str(drafter), "--target", target, "--suite", f"mt-bench={suites['mt-bench']}",
                                 "--suite", f"gsm8k={suites['gsm8k']}", "--max-new-tokens", str(H), "--out", str(out),
                                 "--no-mlflow", "--batch-size", str(bs))
        assert code == 0, stderr
        results[bs] = json.loads(out.read_text())
    assert (results[1]["batch_size"], results[2]["batch_size"]) == (1, 2)
    clock = {"spec_s", "greedy_s", "speedup_wall", "seconds"}
    for name in ("gsm8k", "mt-bench"):
        one, two = ({k: v for k, v in r["suites"][name].items() if not any(c in k for c in clock)} for r in
                    (results[1], results[2]))
        assert one == two and one["requests"] >= 2


@pytest.mark.parametrize("args, message", [
    (["--suite", "gsm9k=x.jsonl"], "unknown suite 'gsm9k'; known suites: gsm8k, math500, humaneval, mbpp, mt-bench"),
    (["--suite", "gsm8k=SUITE", "--prompts", "SUITE"], "not both"),
    (["--suite", "gsm8k=SUITE", "--temperature", "0.7"], "--temperature: only with --prompts, not with --suite"),
    (["--prompts", "SUITE", "--server", "http://127.0.0.1:9"], "--server: only with --suite"),
    (["--suite", "gsm8k=SUITE", "--out", "OUT", "--max-new-tokens", "2000"],
     "exceed the target's 1024 positions; pass a smaller --max-new-tokens"),
    (["--suite", "gsm8k=SUITE", "--out", "OUT", "--server", "http://user:pw-123456@127.0.0.1:9"],
     "neither a vLLM server"),
])
def test_bad_input_gets_one_line(setup, tmp_path, args, message):
    drafter, target, suites = setup
    args = [a.replace("SUITE", str(suites["gsm8k"])).replace("OUT", str(tmp_path / "o.json")) for a in args]
    if "--out" not in args and "--prompts" not in args:
        args += ["--out", str(tmp_path / "o.json")]
    code, _, stderr = invoke("--drafter", str(drafter), "--target", target, "--no-mlflow" if "--suite" in args
                             and "--prompts" not in args else "--limit", *([] if "--suite" in args and "--prompts"
                                                                           not in args else ["1"]), *args)
    assert code == 2, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], stderr
    assert "pw-123456" not in stderr


@pytest.mark.parametrize("tau, verdict", [(1.04, True), (2.6, False)])
def test_end_of_run_says_when_the_drafter_barely_beats_plain_decoding(tmp_path, capsys, tau, verdict):
    """The end of ``dflash-flow run`` (``app.endrun.end_of_run``) on a real finished pipeline, with the
    trained drafter's real-decoding result in the run record."""
    from types import SimpleNamespace

    from dflash_flow.app.endrun import end_of_run
    from dflash_flow.app.runner import Outcome
    from dflash_flow.core import Graph, Pipeline
    from dflash_flow.items import EvalReport
    from dflash_flow.observe.record import EvalPoint, RunRecord
    from dflash_flow.observe.tracking import Tracker

    g = Graph()
    g.add("src", "Range", config={"count": 3})
    g.add("sink", "Discard", inputs=["src"])
    pipeline = Pipeline(g, check_devices=False)
    pipeline.run()
    record = RunRecord(plots=False)
    record.add_eval(EvalPoint(10, (EvalReport("trained", {"tau": tau, "speedup_forwards": tau}, lossless=True,
                                              num_prompts=4),)))
    end_of_run(pipeline, SimpleNamespace(tracker=Tracker(enabled=False), record=record), Outcome(), tmp_path)
    err = capsys.readouterr().err
    assert f"acceptance length {tau:.2f}" in err
    assert ("verdict: the trained drafter barely beats plain decoding" in err) is verdict
    if verdict:
        assert "replies that are not the target's own" in err
