"""Bad environments, built for real at test time: read-only mounts, a filesystem too small for one
checkpoint, a disk that fills up mid-run, symbolic links out of the output directory, a second run on
the same output directory, a data file changed under a checkpoint, a 1 GiB JSONL line, corrupt
checkpoints beside good ones. Each ends in one clear line and exit code 2 (never a traceback), through
the real CLI; what ran before the problem (the last checkpoint, the MLflow run's status) stays right.

Small filesystems are tmpfs mounts (the tests run as root, where ``os.access`` says yes to everything:
only a real mount makes a directory truly read-only or full). Every mount is removed at teardown.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from reltools import (
    cli,
    cli_env,
    finish,
    mlflow_run,
    mlflow_runs,
    start_cli,
    summary,
    train_pipeline,
    wait_for_lines,
    write_tokenized,
    write_yaml,
)

HERE = Path(__file__).resolve().parent
HOSTILE = HERE / "hostile"
HANG_BOUND_S = 60.0  # a hang bound per case (the batch's imports are paid before the first)
GiB = 2**30


# -- mounts ------------------------------------------------------------------------------------------
class Mounts:
    """tmpfs mounts made for one test, lazily unmounted at its end."""

    def __init__(self) -> None:
        self.points: list[Path] = []

    def tmpfs(self, where: Path, *, size: str = "4m", ro: bool = False) -> Path:
        where.mkdir(parents=True, exist_ok=True)
        opts = f"size={size}" + (",ro" if ro else "")
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(where)], capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"these cases need tmpfs mounts (root with CAP_SYS_ADMIN): {proc.stderr.strip()}")
        self.points.append(where)
        return where

    def remount_ro(self, where: Path) -> None:
        subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True, capture_output=True)

    def close(self) -> None:
        for p in reversed(self.points):
            subprocess.run(["umount", "-l", str(p)], capture_output=True)


@pytest.fixture
def mounts():
    m = Mounts()
    yield m
    m.close()


# -- batched CLI cases -------------------------------------------------------------------------------
def run_batch(tmp_path: Path, cases: list[tuple[str, list, int, list[str]]]) -> list[str]:
    """Run the cases in one warmed-up CLI process (batch_cli.py); returns one line per failed expectation."""
    spec, out = tmp_path / "batch.json", tmp_path / "results.json"
    spec.write_text(json.dumps([[str(a) for a in c[1]] for c in cases]))
    cwd = tmp_path / "cwd"
    cwd.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(HERE / "batch_cli.py"), str(spec), str(out)], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    failures = []
    for (label, _args, code, texts), res in zip(cases, json.loads(out.read_text()), strict=True):
        problems = []
        if res["code"] != code:
            problems.append(f"exit {res['code']} != {code}")
        problems += [f"message lacks {t!r}" for t in texts if t not in res["stderr"]]
        if "Traceback" in res["stderr"] or "Traceback" in res["stdout"]:
            problems.append("traceback printed")
        if res["wall_s"] >= HANG_BOUND_S:
            problems.append(f"took {res['wall_s']:.1f} s")
        if problems:
            failures.append(f"{label}: {'; '.join(problems)}\n    stderr: {res['stderr'].strip()[-800:]}")
    return failures


def read_args(data: Path, output_dir: Path, *extra: str, reader: str = "read_tokens.yaml", mode: str = "fail") -> list:
    return ["run", HOSTILE / reader, "--set", f"stages.source.paths=[{data}]", "--set", f"stages.source.on_bad_record={mode}",
            "--set", f"output_dir={output_dir}", *extra]


def good_tokens(path: Path, n: int = 4) -> Path:
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"input_ids": [1 + i, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}) + "\n")
    return path


def make_checkpoint(directory: Path, step: int, *, config_hash: str, data_files: dict[str, str] | None = None) -> Path:
    """A real checkpoint (the application's writer) of the reading pipeline."""
    import torch

    from dflash_flow.app.checkpoint import Checkpointer

    ck = Checkpointer(directory, keep_last=10, config_hash=config_hash, data_files=data_files)
    return ck.save(step=step, epoch=0, model_state={"w": torch.zeros(2)}, optimizer_state={"step": step},
                   data_position={"epoch": 0, "plan": None, "total": step})


def config_hash_of(args: list) -> str:
    """The resume hash of the pipeline a `run` command line describes (file plus --set overrides)."""
    import dflash_flow.app  # noqa: F401 - the application sections
    from dflash_flow.app.prepare import resume_config_hash
    from dflash_flow.core import load_graph

    overrides = [str(args[i + 1]) for i, a in enumerate(args) if a == "--set"]
    return resume_config_hash(load_graph(Path(args[1]), overrides))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bad_environments_get_one_line_and_exit_2(tmp_path, mounts):
    data = good_tokens(tmp_path / "data.jsonl")
    cases = []

    # output_dir: an existing file; under a read-only mount; a read-only directory; a link out of it.
    (tmp_path / "a_file").write_text("not a directory\n")
    cases.append(("output_dir is a file", read_args(data, tmp_path / "a_file"), 2,
                  [f"output_dir {tmp_path / 'a_file'} is an existing file, not a directory"]))
    ro = mounts.tmpfs(tmp_path / "ro", size="1m", ro=True)
    cases.append(("output_dir under a read-only mount", read_args(data, ro / "run" / "out"), 2,
                  [f"cannot create output_dir {ro / 'run' / 'out'}: Read-only file system"]))
    rw = mounts.tmpfs(tmp_path / "rw", size="1m")
    (rw / "out").mkdir()
    mounts.remount_ro(rw)
    cases.append(("read-only output_dir", read_args(data, rw / "out"), 2,
                  [f"output_dir {rw / 'out'} is not writable: Read-only file system"]))
    linked = tmp_path / "linked"
    linked.mkdir()
    (tmp_path / "elsewhere").mkdir()
    (linked / "monitor").symlink_to(tmp_path / "elsewhere")
    cases.append(("a link out of output_dir", read_args(data, linked), 2,
                  [f"output_dir {linked}: monitor is a symbolic link to {tmp_path / 'elsewhere'}, outside the output directory"]))
    # tracking_uri under a read-only mount.
    cases.append(("tracking_uri under a read-only mount",
                  read_args(data, tmp_path / "t_out", "--set", "tracking.enabled=true", "--set", f"tracking.tracking_uri={ro / 'mlflow.db'}"),
                  2, [f"error: tracking: cannot write {ro / 'mlflow.db'}: {ro} is not writable (Read-only file system)"]))
    # A filesystem too small for one checkpoint of the real training pipeline: refused before anything runs.
    small = mounts.tmpfs(tmp_path / "small", size="256k")
    doc = train_pipeline(tmp_path, data=write_tokenized(tmp_path / "train.jsonl", 8), output_dir=small / "out", tracking=False)
    cases.append(("no room for one checkpoint", ["run", write_yaml(tmp_path / "train.yaml", doc)], 2,
                  [f"not enough free space in {small / 'out' / 'checkpoints'} for one checkpoint and the export: about",
                   "MiB needed", "KiB free"]))
    # checkpoint.dir: a file, or under a read-only mount; an export directory that is a file (found at start,
    # not after the training).
    cases.append(("checkpoint.dir is a file", read_args(data, tmp_path / "c_out", "--set", f"checkpoint.dir={tmp_path / 'a_file'}"),
                  2, [f"checkpoint.dir {tmp_path / 'a_file'} is an existing file, not a directory"]))
    cases.append(("checkpoint.dir under a read-only mount", read_args(data, tmp_path / "c_out2", "--set", f"checkpoint.dir={ro / 'ck'}"),
                  2, [f"cannot create checkpoint.dir {ro / 'ck'}: {ro} is not writable (Read-only file system)"]))
    export_out = tmp_path / "export_out"
    export_out.mkdir()
    (export_out / "drafter").write_text("a file where the export goes\n")
    doc = train_pipeline(tmp_path, data=tmp_path / "train.jsonl", output_dir=export_out, tracking=False)
    cases.append(("export_dir is a file", ["run", write_yaml(tmp_path / "export.yaml", doc)], 2,
                  [f"stage 'drafter': export_dir {export_out / 'drafter'} is an existing file, not a directory"]))
    # A second run on an output directory another process holds (this test process takes the real lock).
    held = tmp_path / "held"
    held.mkdir()
    fd = os.open(held / ".dflash-flow.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname()}).encode())
    cases.append(("output_dir in use", read_args(data, held), 2,
                  [f"output_dir {held} is in use by another run (pid {os.getpid()} on {socket.gethostname()})"]))

    # Data: a 1 GiB line (sparse: no disk, no memory), refused or skipped as one bad record.
    big = mounts.tmpfs(tmp_path / "big", size="8m") / "data_big_line.jsonl"
    with open(big, "wb") as f:
        f.truncate(GiB)  # 1 GiB of NUL bytes, then a newline and one good record
        f.seek(GiB)
        f.write(b'\n{"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}\n')
    cases.append(("a 1 GiB line (fail)", read_args(big, tmp_path / "big_fail"), 2,
                  [f"{big}:1: record of {GiB} bytes is longer than max_record_bytes=67108864 (64 MiB)"]))
    cases.append(("a 1 GiB line (skip)", read_args(big, tmp_path / "big_skip", mode="skip"), 0,
                  ["1 samples from 2 records in 1 file(s), bad=1", f"{big}:1: record of {GiB} bytes is longer"]))
    deep = tmp_path / "data_deep.jsonl"
    deep.write_text('{"input_ids": ' + "[" * 100_000 + "]" * 100_000 + ', "loss_mask": [1]}\n')
    cases.append(("JSON nested 100000 deep", read_args(deep, tmp_path / "deep_out"), 2,
                  [f"{deep}:1: invalid JSON: maximum recursion depth exceeded"]))

    # Checkpoints: `latest` falls back past a corrupt newest one (one warning); a changed data file is named.
    fallback_out = tmp_path / "fallback"
    args = read_args(data, fallback_out, "--resume", "latest", mode="skip")
    chash = config_hash_of(args)
    make_checkpoint(fallback_out / "checkpoints", 1, config_hash=chash)
    newest = make_checkpoint(fallback_out / "checkpoints", 2, config_hash=chash)
    (newest / "optimizer.pt").write_bytes(b"flipped")
    cases.append(("--resume latest past a corrupt newest", args, 0,
                  [f"skipping 1 invalid checkpoint(s) ({newest}: optimizer.pt is corrupted (checksum mismatch)); "
                   f"resuming from the newest valid one, {fallback_out / 'checkpoints' / 'step-00000001'}",
                   f"resuming from {fallback_out / 'checkpoints' / 'step-00000001'} (step 1, epoch 0)"]))
    changed = good_tokens(tmp_path / "changed.jsonl")
    changed_out = tmp_path / "changed_out"
    args = read_args(changed, changed_out, "--resume", "latest")
    make_checkpoint(changed_out / "checkpoints", 3, config_hash=config_hash_of(args), data_files={str(changed): "ab" * 32})
    cases.append(("data changed under a checkpoint", args, 2,
                  [f"cannot resume from {changed_out / 'checkpoints' / 'step-00000003'}: data file {changed} changed since "
                   "the checkpoint was written (sha256 abababababab... then"]))
    fake_out = tmp_path / "fake_out"
    args = read_args(data, fake_out, "--resume", "latest")
    fake = make_checkpoint(fake_out / "checkpoints", 4, config_hash=config_hash_of(args))
    (fake / "model.safetensors").write_bytes(b"\xff" * 64)
    manifest = json.loads((fake / "MANIFEST.json").read_text())
    from dflash_flow.util import sha256_file

    manifest["model.safetensors"] = sha256_file(fake / "model.safetensors")
    (fake / "MANIFEST.json").write_text(json.dumps(manifest))
    cases.append(("weights that are not safetensors (checksums right)", args, 2,
                  [f"not a valid checkpoint: {fake}: model.safetensors is not a safetensors file"]))

    try:
        failures = run_batch(tmp_path, cases)
    finally:
        os.close(fd)
    assert not failures, "\n".join(failures)
    # Nothing was written where it was refused, and the refused runs created no output.
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert (tmp_path / "a_file").read_text() == "not a directory\n"


# -- a crafted state.json -------------------------------------------------------------------------------
def _crafted(src: Path, root: Path, name: str, edit) -> Path:
    """A copy of checkpoint ``src`` whose state.json is ``edit(state)`` (or the text ``edit``), with a
    MANIFEST that agrees (an attacker rewrites both): only the state's content is wrong."""
    import shutil

    from dflash_flow.util import sha256_file

    d = root / name / src.name
    shutil.copytree(src, d)
    if isinstance(edit, str):
        text = edit
    else:
        state = json.loads((src / "state.json").read_text())
        edit(state)
        text = json.dumps(state)
    (d / "state.json").write_text(text)
    manifest = json.loads((d / "MANIFEST.json").read_text())
    manifest["state.json"] = sha256_file(d / "state.json")
    (d / "MANIFEST.json").write_text(json.dumps(manifest))
    return d


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_crafted_state_json_is_not_a_valid_checkpoint_for_run_resume_and_export(tmp_path):
    """A real run's checkpoint with its state.json rewritten (wrong types, missing keys, huge numbers, NaN,
    not JSON, states that do not fit the rebuilt plan): `run --resume` and `export` say "not a valid
    checkpoint: PATH: what" in one line, exit 2 (old main: tracebacks, one escaping the CLI, or a run
    resumed from a position that does not exist)."""
    doc = train_pipeline(tmp_path, data=write_tokenized(tmp_path / "tok.jsonl", 16, seed=3), output_dir=tmp_path / "run",
                         every_steps=2, epochs=1, tracking=False)
    path = write_yaml(tmp_path / "p.yaml", doc)
    res = cli(["run", path], cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    src = sorted((tmp_path / "run" / "checkpoints").glob("step-*"))[0]

    def put(where: str, value):
        def edit(state):
            *head, last = where.split("/")
            node = state
            for k in head:
                node = node[int(k)] if isinstance(node, list) else node[k]
            if value is KeyError:
                del node[last]
            else:
                node[last] = value
        return edit

    crafted = {  # name: (edit, what the message says, also through `export`)
        "not_json": ("{not json", "state.json is not valid JSON", True),
        "step_huge": (put("step", 10**30), "'step' must be a non-negative integer", True),
        "no_epoch": (put("epoch", KeyError), "state.json: has no 'epoch'", True),
        "position_epoch_str": (put("data_position/epoch", "zero"), "'data_position.epoch' must be a non-negative integer", True),
        "position_total_nan": (put("data_position/total", float("nan")), "'data_position.total' must be", True),
        "position_plan_list": (put("data_position/plan", [1, 2]), "'data_position.plan': must be an object", True),
        "position_chain_str": (put("data_position/plan/chain", "x"), "'chain' must be a non-empty list", True),
        "stage_states_null": (put("stage_states", None), "'stage_states' must be an object", True),
        "trainer_state_missing": (put("stage_states/drafter", KeyError), "state.json has no state for stage 'drafter'", False),
        "trainer_step_str": (put("stage_states/drafter/0/trainer/step", "x"),
                             "stage 'drafter' replica 0: its saved state cannot be restored (ValueError", False),
        "plan_fingerprint": (put("data_position/plan/fingerprint", "00" * 16),
                             "stage 'interleaver' replica 0: the checkpoint's data position cannot continue", False),
    }
    cases = []
    for name, (edit, what, export) in crafted.items():
        ck = _crafted(src, tmp_path / "crafted", name, edit)
        expected = [f"error: not a valid checkpoint: {ck}: ", what]
        cases.append((f"run --resume {name}", ["run", path, "--resume", ck, "--set", f"output_dir={tmp_path / 'res' / name}"],
                      2, expected))
        if export:
            cases.append((f"export {name}", ["export", ck, tmp_path / "exp" / name], 2, expected))
    failures = run_batch(tmp_path, cases)
    assert not failures, "\n".join(failures)


# -- a disk that fills up mid-run -------------------------------------------------------------------------
def _fill(directory: Path, leave: int) -> Path:
    """Take the whole filesystem of ``directory`` with one file (the run keeps writing meanwhile), then give
    ``leave`` bytes back."""
    import errno

    filler = directory / "filler.bin"
    chunk = b"\0" * 2**16
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(chunk)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    os.truncate(filler, max(filler.stat().st_size - leave, 0))
    return filler


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disk_full_mid_checkpoint_is_one_line_the_last_checkpoint_intact_and_mlflow_failed(tmp_path, mounts):
    from dflash_flow.app.checkpoint import Checkpointer

    disk = mounts.tmpfs(tmp_path / "disk", size="16m")
    out = disk / "out"
    data = write_tokenized(tmp_path / "data.jsonl", 32, seed=4)
    doc = train_pipeline(tmp_path, data=data, output_dir=out, every_steps=2, epochs=2)
    path = write_yaml(tmp_path / "p.yaml", doc)
    proc = start_cli(["run", path], cwd=tmp_path, log=tmp_path / "run.log")
    ckdir = out / "checkpoints"
    deadline = time.monotonic() + 180
    while not Checkpointer(ckdir).list() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before its first checkpoint: " + (tmp_path / "run.log").read_text()[-2000:]
    _fill(disk, leave=96 * 1024)  # batch log lines and the summary fit, the next checkpoint (~0.5 MiB) does not
    code = finish(proc, 240)
    log = (tmp_path / "run.log").read_text()
    assert code == 2, log[-3000:]
    assert "Traceback" not in log
    assert "error: stage 'drafter' replica 0 failed in process: CheckpointError: cannot write checkpoint" in log, log[-3000:]
    assert "No space left on device; the earlier checkpoints are intact" in log
    # The last good checkpoint loads with every checksum right; no half-written one is left behind.
    good = Checkpointer(ckdir).load("latest", check_config=False)
    assert good.step >= 2 and good.model_state() and good.optimizer_state()
    assert not list(ckdir.glob(".tmp-*"))
    s = summary(out)
    assert s["status"] == "FAILED"
    assert mlflow_run(tmp_path / "mlflow.db", s["mlflow_run_id"]).info.status == "FAILED"


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_full_tracking_store_is_one_line_and_training_goes_on_spooling(tmp_path, mounts):
    """The MLflow sqlite store's disk fills up mid-run: the run trains to its end (exit 0), the metrics go
    to the spool, and the console says so in one line naming the cause; mlflow's own log of each failed
    write (its traceback, the SQL and its parameters: screens per metric batch) is not printed."""
    disk = mounts.tmpfs(tmp_path / "store", size="3m")
    out = tmp_path / "out"
    data = write_tokenized(tmp_path / "data.jsonl", 48, seed=4)
    doc = train_pipeline(tmp_path, data=data, output_dir=out, every_steps=0, epochs=4)
    doc["tracking"]["tracking_uri"] = str(disk / "mlflow.db")
    proc = start_cli(["run", write_yaml(tmp_path / "p.yaml", doc)], cwd=tmp_path, log=tmp_path / "run.log")
    wait_for_lines(out / "batches.jsonl", 2, proc, timeout=180)  # the MLflow run exists: training started
    assert proc.poll() is None, "the run ended before the disk could fill: " + (tmp_path / "run.log").read_text()[-2000:]
    _fill(disk, leave=0)
    code = finish(proc, 240)
    log = (tmp_path / "run.log").read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "[SQL:" not in log and "SQLAlchemy database error" not in log, log[-3000:]
    outage = [x for x in log.splitlines() if "is unreachable" in x]
    assert len(outage) == 1 and "database or disk is full" in outage[0], outage
    assert "Training continues; metrics are spooled" in outage[0]
    assert list((out / "mlflow-spool").glob("spool-*.jsonl")), "the metrics are kept for import-spool"
    assert summary(out)["status"] == "FINISHED"


# -- start-up: the MLflow run is never left RUNNING ------------------------------------------------------
def _slow_pipeline(root: Path, out: Path, count: int = 100_000) -> Path:
    doc = {
        "name": "slow",
        "output_dir": str(out),
        "tracking": {"tracking_uri": str(root / "mlflow.db"), "experiment": "reliability", "system_metrics": False},
        "runtime": {"drain_timeout_s": 10, "shutdown_grace_s": 5},
        "stages": [{"name": "source", "type": "Range", "config": {"count": count, "service_s": 0.002}},
                   {"name": "sink", "type": "Discard", "inputs": ["source"]}],
    }
    return write_yaml(root / f"slow-{out.name}.yaml", doc)


def _catches(pid: int, signum: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    caught = int(text.split("SigCgt:")[1].split()[0], 16)
    return bool(caught & (1 << (signum - 1)))


def _wait_handler(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the CLI has installed its SIGTERM handler (before that, Python is still starting)."""
    import signal

    deadline = time.monotonic() + timeout
    while not _catches(proc.pid, signal.SIGTERM):
        assert proc.poll() is None and time.monotonic() < deadline, "the CLI did not start"
        time.sleep(0.002)


def _no_run_left_running(db: Path) -> list[str]:
    return [f"{r.info.run_id}: {r.info.status}" for r in mlflow_runs(db) if r.info.status == "RUNNING"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_bad_output_dir_creates_no_mlflow_run(tmp_path):
    (tmp_path / "a_file").write_text("x")
    res = cli(["run", _slow_pipeline(tmp_path, tmp_path / "a_file")], cwd=tmp_path, timeout=60)
    assert res.returncode == 2 and "is an existing file, not a directory" in res.stderr and "Traceback" not in res.stderr
    assert mlflow_runs(tmp_path / "mlflow.db") == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_signals_at_any_moment_of_start_up_and_end_exit_130_and_end_the_mlflow_run(tmp_path):
    """SIGINT or SIGTERM at random moments of the first seconds (imports, the MLflow run's creation, the
    pipeline's start), and a stream of SIGTERMs that keeps coming through the drain, the end of run and the
    interpreter's exit: always exit code 130, never a traceback, never a RUNNING run."""
    import random
    import signal

    seed = int(os.environ.get("DFLASH_RELIABILITY_SEED", time.time_ns() % 10**6))
    rng = random.Random(seed)
    db = tmp_path / "mlflow.db"
    trials = [(signal.SIGINT, rng.uniform(0, 3.0), False), (signal.SIGTERM, rng.uniform(0, 3.0), False),
              (signal.SIGTERM, rng.uniform(0, 1.0), False), (signal.SIGTERM, rng.uniform(2.0, 5.0), True),
              (signal.SIGINT, rng.uniform(2.0, 5.0), True)]
    for i, (sig, delay, stream) in enumerate(trials):
        where = f"(seed {seed}, trial {i}: signal {sig} after {delay:.2f}s{', then a stream' if stream else ''})"
        path = _slow_pipeline(tmp_path, tmp_path / f"out{i}")
        proc = subprocess.Popen([sys.executable, "-m", "dflash_flow.cli", "run", str(path)], cwd=tmp_path, env=cli_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_handler(proc)
            time.sleep(delay)
            proc.send_signal(sig)
            while stream and proc.poll() is None:
                time.sleep(rng.uniform(0.005, 0.05))
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    break
            try:
                out, err = proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)  # PYTHONFAULTHANDLER: every thread's stack to stderr
                out, err = proc.communicate(timeout=30)
                raise AssertionError(f"{where}: the CLI did not end\n{err[-6000:]}") from None
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 130, f"{where}: exit {proc.returncode}\n{err[-2000:]}"
        assert "Traceback" not in err, f"{where}\n{err[-3000:]}"
        assert _no_run_left_running(db) == [], where


# -- SIGSTOP / SIGCONT and the no-progress watchdog -------------------------------------------------------
WATCHED = """
import sys
from dflash_flow.core import Graph, Pipeline, RuntimeOptions
g = Graph(runtime=RuntimeOptions(stall_timeout_s=1.5, watchdog_interval_s=0.05, shutdown_grace_s=5))
g.add("source", "Range", config={"count": 8})
g.add("slow", "Delay", inputs=["source"], config={"service_s": 0.8})
g.add("sink", "Discard", inputs=["slow"])
print("READY", flush=True)
Pipeline(g, check_devices=False).run()
print("FINISHED", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_process_does_not_trip_the_no_progress_watchdog(tmp_path):
    """Each item takes 0.8 s without progress (the stall timeout is 1.5 s); the process is stopped for 3 s in
    the middle of items, twice. Suspended time is not no-progress time: the run finishes."""
    import signal

    script = tmp_path / "watched.py"
    script.write_text(WATCHED)
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        for _ in range(2):
            time.sleep(1.2)
            proc.send_signal(signal.SIGSTOP)
            time.sleep(3.0)
            proc.send_signal(signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0 and "FINISHED" in out, err[-3000:]


# -- two runs on one output directory -------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_second_run_on_the_same_output_dir_is_refused_naming_the_first(tmp_path):
    import signal

    out = tmp_path / "out"
    path = _slow_pipeline(tmp_path, out)
    first = start_cli(["run", path], cwd=tmp_path, log=tmp_path / "first.log")
    try:
        deadline = time.monotonic() + 60
        lock = out / ".dflash-flow.lock"
        while not (lock.exists() and f'"pid": {first.pid}' in lock.read_text()):
            assert first.poll() is None and time.monotonic() < deadline, (tmp_path / "first.log").read_text()
            time.sleep(0.01)
        res = cli(["run", path], cwd=tmp_path, timeout=60)
        assert res.returncode == 2, res.stderr[-2000:]
        assert f"error: output_dir {out} is in use by another run (pid {first.pid} on " in res.stderr
        assert "Traceback" not in res.stderr
        first.send_signal(signal.SIGTERM)
        assert finish(first, 60) == 130
    finally:
        if first.poll() is None:
            first.kill()
            finish(first, 30)
    # The first run's lock went with it: the directory is free again.
    res = cli(["run", _slow_pipeline(tmp_path, out, count=3)], cwd=tmp_path, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]


# -- divergence through the CLI ---------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_diverging_run_stops_naming_the_step_and_batch(tmp_path):
    data = write_tokenized(tmp_path / "data.jsonl", 16, seed=1)
    doc = train_pipeline(tmp_path, data=data, output_dir=tmp_path / "out", every_steps=100, epochs=1,
                         overrides={"drafter": {"lr": 1e12, "warmup_ratio": 0.0, "max_grad_norm": None}})
    res = cli(["run", write_yaml(tmp_path / "p.yaml", doc)], cwd=tmp_path, timeout=240)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr
    assert "NonFiniteError: non-finite gradient norm (nan) at optimizer step " in res.stderr, res.stderr[-3000:]
    assert " of epoch 0, samples [" in res.stderr and "Lower lr (now 1e+12)" in res.stderr
    s = summary(tmp_path / "out")
    assert s["status"] == "FAILED"
    assert mlflow_run(tmp_path / "mlflow.db", s["mlflow_run_id"]).info.status == "FAILED"
    assert not (tmp_path / "out" / "drafter").exists(), "a diverged drafter is never exported"

