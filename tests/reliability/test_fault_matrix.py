"""Fault containment: every built-in stage type x {setup, mid-stream, teardown} x {1, several replicas}.

Faults are injected into the real stages (``faulty_stages.Faulty<Type>``: the real class, its real hooks,
plus one raise after the hook). Most of the matrix runs in-process (``Pipeline``) and checks: the run
ends within a bound, a ``StageError`` names the stage, the replica and the phase, the original exception
and its traceback are attached, every thread is joined. A few cases run the real CLI in a subprocess and
check the exit code, the message, MLflow's FAILED status and that the last checkpoint is intact.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from faulty_stages import BUILTIN_TYPES, FAULTY, PLUGIN_TYPES, InjectedFault
from reltools import (
    MASK_ID,
    VOCAB,
    mlflow_run,
    summary,
    train_pipeline,
    wait_threads_back,
    write_chat,
    write_tokenized,
    write_yaml,
)

from dflash_flow.core import Graph, Pipeline, StageError
from dflash_flow.core.graph import RuntimeOptions
from dflash_flow.model.facts import target_facts
from dflash_flow.model.spec import ModelSpec
from dflash_flow.services import RunServices

BOUND_S = 60.0  # a failing run ends well within this on a busy 2-core box (typically < 2 s)
HERE = Path(__file__).resolve().parent


def _runtime() -> RuntimeOptions:
    return RuntimeOptions(capacity=2, stall_timeout_s=60, drain_timeout_s=10, shutdown_grace_s=10, watchdog_interval_s=0.05)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    tokens = write_tokenized(root / "tokens.jsonl", 8, seed=1)
    # Embedded-target ids (vocab 768) for the SpecDecodeEval pipeline, which needs a tokenizer.
    chat = root / "chat.jsonl"
    write_chat(chat, 4)
    # tqdm (the embedded dataset's regeneration progress) starts a process-wide monitor daemon that
    # outlives the run by up to 10 s; it is the library's, not a runtime thread: switch it off here.
    import tqdm

    from dflash_flow.embedded import embedded_target_path

    tqdm.tqdm.monitor_interval = 0
    return {"root": root, "tokens": tokens, "chat": chat, "embedded": embedded_target_path()}


def _tok_source(files, **extra):
    return {"paths": [str(files["tokens"])], "max_length": 64, "cache_dir": None, "vocab_size": VOCAB, **extra}


def _drafter_conf(**extra):
    return {"num_anchors": 8, "torch_threads": 1, **extra}


def _model(files, target: str = "tiny-qwen3-8l") -> ModelSpec:
    """The model facts the fault pipelines run with (what a run resolves from ``model:``)."""
    return ModelSpec(declared=target, target=target, tokenizer=str(files["embedded"]), num_draft_layers=1,
                     block_size=4, mask_token_id=MASK_ID if target == "tiny-qwen3-8l" else None,
                     facts=target_facts(target))


def _graph(victim: str, files, replicas: int, fault: dict) -> tuple[Graph, str]:
    """A small real pipeline around the victim type; returns (graph, victim stage name)."""
    g = Graph(name=f"fault-{victim}", seed=3, runtime=_runtime())
    F = f"Faulty{victim}"
    data = [("source", "TokenizedSource", [], 1, _tok_source(files)),
            ("bucketer", "Bucketer", ["source"], 1, {"max_tokens": 128, "num_buckets": 2, "epochs": 1}),
            ("interleaver", "Interleaver", ["bucketer"], 1, {}),
            ("padder", "Padder", ["interleaver"], 1, {})]

    def add(name, type_, inputs, reps, conf):
        if type_ == victim:
            type_, reps, conf = F, replicas, {**conf, **fault}
        g.add(name, type_, inputs=inputs, replicas=reps, config=conf)

    if victim in ("Range", "Delay", "Discard", "Scale"):
        add("source", "Range", [], 1, {"count": 20})
        add("work", "Scale" if victim == "Scale" else "Delay", ["source"], 1, {})
        add("sink", "Discard", ["work"], 1, {})
    elif victim in ("TokenizedSource", "ChatSource", "EmbeddedChatSource"):
        conf = {
            "TokenizedSource": _tok_source(files),
            "ChatSource": {"paths": [str(files["chat"])], "cache_dir": None},
            "EmbeddedChatSource": {"n_train": 4, "n_eval": 1, "max_new_tokens": 8, "generation_batch_size": 4,
                                   "dataset_dir": str(files["root"] / "embedded-dataset")},
        }[victim]
        add("source", victim, [], 1, conf)
        add("sink", "Discard", ["source"], 1, {})
    elif victim in ("Bucketer", "Interleaver", "Padder"):
        for spec in data:
            add(*spec)
        add("sink", "Discard", ["padder"], 1, {})
    elif victim == "Monitor":
        add("source", "Range", [], 1, {"count": 20})
        add("monitor", "Monitor", ["source"], 1, {"interval_s": 0.01, "progress": False, "plots": False})
    elif victim in ("TargetForward", "DrafterStep"):
        for spec in data:
            add(*spec)
        add("target", "TargetForward", ["padder"], 1, {"torch_threads": 1})
        if victim == "TargetForward":
            add("sink", "Discard", ["target"], 1, {})
        else:
            add("drafter", "DrafterStep", ["target"], 1, _drafter_conf())
            add("sink", "Discard", ["drafter"], 1, {})
    elif victim == "SpecDecodeEval":
        add("source", "ChatSource", [], 1, {"paths": [str(files["chat"])], "cache_dir": None})
        add("bucketer", "Bucketer", ["source"], 1, {"max_tokens": 512, "num_buckets": 1, "epochs": 1})
        add("interleaver", "Interleaver", ["bucketer"], 1, {})
        add("padder", "Padder", ["interleaver"], 1, {})
        add("target", "TargetForward", ["padder"], 1, {"torch_threads": 1})
        add("drafter", "DrafterStep", ["target"], 1, _drafter_conf())
        add("evaluate", "SpecDecodeEval", ["drafter"], 1,
            {"prompts": "embedded", "limit": 1, "max_new_tokens": 4, "baseline": False})
        add("sink", "Discard", ["evaluate"], 1, {})
    else:  # pragma: no cover - a new built-in type must be added to the matrix
        raise AssertionError(f"no fault pipeline for {victim}")
    names = [s.name for s in g.stages if s.type == F]
    assert len(names) == 1
    return g, names[0]


def _cases():
    out = []
    for t in BUILTIN_TYPES + PLUGIN_TYPES:
        cls = FAULTY[t]
        # Several replicas wherever the type allows them (validation rejects replicas of singletons and
        # of sources that would emit their whole output once per replica).
        single = cls.singleton or (cls.is_source() and not cls.shards_by_replica)
        for phase in ("setup", "process", "teardown"):
            out.append(pytest.param(t, phase, 1, 0, id=f"{t}-{phase}-1"))
            if not single:
                out.append(pytest.param(t, phase, 2, 1, id=f"{t}-{phase}-2"))
    return out


def test_matrix_covers_every_registered_builtin_type():
    from dflash_flow.core import registry

    builtins = {n for n in registry.available() if registry.resolve(n).__module__.startswith("dflash_flow.stages.")}
    assert builtins == set(BUILTIN_TYPES), f"update the fault matrix: {builtins ^ set(BUILTIN_TYPES)}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("victim", "phase", "replicas", "fault_replica"), _cases())
def test_fault_is_contained(victim, phase, replicas, fault_replica, files, tmp_path):
    fault = {"fault_phase": phase, "fault_replica": fault_replica, "fault_at": 1 if phase == "process" else 0}
    if victim == "Interleaver" and phase == "process":
        fault["fault_at"] = 0  # its only input: the one epoch
    if victim == "SpecDecodeEval" and phase == "process":
        fault["fault_at"] = 1  # one step report, then the final one (which runs the real evaluation)
    if victim == "Bucketer" and phase == "process":
        fault["fault_at"] = 0  # its only input: the source's table of samples
    g, name = _graph(victim, files, replicas, fault)
    baseline = set(threading.enumerate())
    t0 = time.monotonic()
    spec = _model(files, str(files["embedded"]) if victim == "SpecDecodeEval" else "tiny-qwen3-8l")
    p = Pipeline(g, output_dir=tmp_path / "out", check_devices=False, services=RunServices(model=spec))
    with pytest.raises(StageError) as info:
        p.run()
    elapsed = time.monotonic() - t0
    err = info.value
    expected_phase = "produce" if (phase == "process" and FAULTY[victim].is_source()) else phase
    assert (err.stage, err.replica, err.phase) == (name, fault_replica, expected_phase), str(err)
    assert isinstance(err.original, InjectedFault)
    assert err.__cause__ is err.original and err.original.__traceback__ is not None
    assert f"stage '{name}' replica {fault_replica} failed in {expected_phase}" in str(err)
    # Only the victim failed: a fault must not be re-reported by the stages that were cancelled.
    assert {(e.stage, e.replica) for e in p.errors} == {(name, fault_replica)}, [str(e) for e in p.errors]
    assert elapsed < BOUND_S, f"{victim} {phase}: the failing run took {elapsed:.1f}s"
    assert wait_threads_back(baseline) == [], "threads left after the failure"
    # Every replica that started was torn down and has ended.
    for reps in p.replicas.values():
        for rep in reps:
            assert rep.thread is not None and not rep.thread.is_alive()


# -- through the CLI: exit code, message, MLflow FAILED, last checkpoint intact -----------------------
# (stage, its faulty type, phase, replica, item) -- run side by side, each in its own process.
CLI_CASES = [
    ("target", "FaultyTargetForward", "process", 1, 5),  # mid-stream (batch ~11 of 17), second replica
    ("drafter", "FaultyDrafterStep", "teardown", 0, 0),  # after the export: the run must still fail
]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_cli_failures_exit_code_message_mlflow_failed_checkpoint_intact(tmp_path):
    """Through the real CLI: two injected faults and one real setup failure (a target directory that does
    not exist), as three processes side by side."""
    import subprocess
    import sys

    from reltools import cli_env

    from dflash_flow.app.checkpoint import Checkpointer

    data = write_tokenized(tmp_path / "data.jsonl", 24, seed=5)
    procs = []
    for i, (stage, type_, phase, replica, at) in enumerate(CLI_CASES):
        root = tmp_path / f"case{i}"
        root.mkdir()
        doc = train_pipeline(root, data=data, output_dir=root / "out", overrides={
            stage: {"type": type_, "fault_phase": phase, "fault_replica": replica, "fault_at": at}})
        cmd = [sys.executable, str(HERE / "launch.py"), "run", str(write_yaml(root / "p.yaml", doc))]
        procs.append((root, subprocess.Popen(cmd, cwd=root, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    root = tmp_path / "setup"
    root.mkdir()
    doc = train_pipeline(root, data=data, output_dir=root / "out", model={"target": str(root / "no-such-model")})
    cmd = [sys.executable, "-m", "dflash_flow.cli", "run", str(write_yaml(root / "p.yaml", doc))]
    procs.append((root, subprocess.Popen(cmd, cwd=root, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    t0 = time.monotonic()
    results = []
    try:
        for root, proc in procs:
            out, err = proc.communicate(timeout=max(240 - (time.monotonic() - t0), 1))
            results.append((root, proc.returncode, err))
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)

    for (stage, _type, phase, replica, _at), (root, code, err) in zip(CLI_CASES, results, strict=False):
        assert code == 1, err[-3000:]
        assert f"stage '{stage}' replica {replica} failed in {phase}: InjectedFault" in err, err[-3000:]
        assert f"Original traceback ({stage}[{replica}], {phase})" in err
        assert "faulty_stages.py" in err, "the original traceback points at the raising code"
        s = summary(root / "out")
        assert s["status"] == "FAILED"
        assert mlflow_run(root / "mlflow.db", s["mlflow_run_id"]).info.status == "FAILED"
        # The last good checkpoint is intact (checksums verified) and loads; nothing half-written.
        ck = Checkpointer(root / "out" / "checkpoints").load("latest", check_config=False)
        assert ck.step >= 2
        assert ck.model_state()
        assert not list((root / "out" / "checkpoints").glob(".tmp-*"))

    root, code, err = results[-1]
    # A target that does not exist is the user's input, not a crash: exit 2, the stage and the reason named.
    # Since issue 20 `run` finds it before anything starts (validation checks model directories), so no
    # stage is set up and no MLflow run is created for it.
    assert code == 2, err[-3000:]
    assert "field 'model.target'" in err and "no-such-model is not a directory here" in err, err[-3000:]
    assert "Traceback" not in err
    assert not (root / "out" / "summary.json").exists() and not (root / "mlflow.db").exists()
