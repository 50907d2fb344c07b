"""The CLI: validate exit codes and messages, graph rendering, stage listing, and no heavy imports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from typer.testing import CliRunner

from dflash_flow.cli import app

GOOD = textwrap.dedent(
    """\
    name: good
    stages:
      - name: src
        type: Range
        config: {count: 20}
      - name: work
        type: Delay
        inputs: [src]
        replicas: 3
      - name: sink
        type: Discard
        inputs: [{stage: work, policy: least_loaded}]
        ordered: true
    """
)

BAD = textwrap.dedent(
    """\
    name: bad
    stages:
      - name: src
        type: Range
        config: {count: -3, speed: 2}
      - name: work
        type: Dleay
        inputs: [src]
      - name: sink
        type: Discard
        inputs: [nowhere]
        replicas: 0
    """
)


@pytest.fixture
def files(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text(GOOD)
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    return good, bad


def _cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "dflash_flow.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=cwd,
    )


def test_validate_bad_file_exits_2_with_one_line_per_problem(files):
    _, bad = files
    res = _cli("validate", str(bad))
    assert res.returncode == 2, res
    assert "Traceback" not in res.stderr + res.stdout
    lines = res.stderr.strip().splitlines()
    assert lines[0] == f"error: {bad}: 5 problem(s)"
    body = lines[1:]
    assert len(body) == 5
    expected = [
        (5, "src", "count", "must be >= 0"),
        (5, "src", "speed", "unknown field 'speed'"),
        (7, "work", "type", "unknown stage type 'Dleay'; did you mean 'Delay'?"),
        (11, "sink", "inputs", "dangling input: no stage named 'nowhere'"),
        (12, "sink", "replicas", "replicas must be >= 1"),
    ]
    for line, stage, field, text in expected:
        prefix = f"{bad}:{line}, stage '{stage}', field '{field}': "
        assert any(b.startswith(prefix) and text in b for b in body), (prefix, text, body)


def test_validate_good_file_and_set_overrides(files):
    good, _ = files
    runner = CliRunner()
    res = runner.invoke(app, ["validate", str(good)])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == f"ok: {good}: 3 stages, 5 replicas"
    res = runner.invoke(
        app, ["validate", str(good), "--set", "stages.work.replicas=2", "-s", "stages.src.count=4"]
    )
    assert res.exit_code == 0 and "3 stages, 4 replicas" in res.output
    res = runner.invoke(app, ["validate", str(good), "--set", "stages.src.count=-1"])
    assert res.exit_code == 2
    assert "stage 'src', field 'count': " in res.output and "must be >= 0" in res.output
    assert "Traceback" not in res.output


def test_validate_device_problem_and_no_device_check(files):
    good, _ = files
    res = _cli("validate", str(good), "--set", "stages.work.devices=cuda:0")
    assert res.returncode == 2
    assert (
        "field 'devices': device cuda:0 requested but this machine has no visible CUDA device" in res.stderr
    )
    res = _cli("validate", str(good), "--no-device-check", "--set", "stages.work.devices=cuda:0")
    assert res.returncode == 0, res.stderr


def test_python_tags_rejected_by_cli(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("name: x\nstages:\n  - name: a\n    type: !!python/object/new:os.system [ls]\n")
    res = CliRunner().invoke(app, ["validate", str(evil)])
    assert res.exit_code == 2
    assert f"{evil}:4: invalid YAML" in res.output and "not allowed" in res.output


def test_graph_mermaid_and_dot(files, tmp_path):
    good, bad = files
    runner = CliRunner()
    res = runner.invoke(app, ["graph", str(good)])
    assert res.exit_code == 0, res.output
    assert res.output.splitlines()[0] == "flowchart LR"
    assert 's_work["work: Delay (x3)"]' in res.output
    assert "s_src -->|round_robin cap 8| s_work" in res.output
    assert "s_work -->|cap 8 ordered| s_sink" in res.output
    res = runner.invoke(app, ["graph", str(good), "--format", "dot"])
    assert res.exit_code == 0
    assert res.output.startswith('digraph "good" {') and res.output.rstrip().endswith("}")
    assert "s_src -> s_work" in res.output and "s_work -> s_sink" in res.output
    out = tmp_path / "g.dot"
    res = runner.invoke(app, ["graph", str(good), "-f", "dot", "-o", str(out)])
    assert res.exit_code == 0 and out.read_text().startswith("digraph")
    assert runner.invoke(app, ["graph", str(good), "--format", "png"]).exit_code == 2
    assert runner.invoke(app, ["graph", str(bad)]).exit_code == 2


def test_stages_lists_types_with_fields():
    runner = CliRunner()
    res = runner.invoke(app, ["stages"])
    assert res.exit_code == 0, res.output
    for name in ("Range", "Delay", "Discard", "TestSource"):
        assert f"\n{name}  (" in "\n" + res.output
    assert "  - count: int (default 10)  How many integers to emit." in res.output
    assert "input: none (source)   output: int   cardinality: 1:n" in res.output
    one = runner.invoke(app, ["stages", "TestTyped"])
    assert one.exit_code == 0
    assert "  - required: int (required)" in one.output
    assert "  - sizes: list[int] (default [])" in one.output
    assert runner.invoke(app, ["stages", "NoSuch"]).exit_code == 2


CHECK_IMPORTS = textwrap.dedent(
    """
    import json, sys
    from dflash_flow.cli import app
    try:
        app(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "mlflow", "transformers"))
    print(json.dumps({"code": code, "heavy": heavy}))
    """
)


@pytest.mark.parametrize(
    "args",
    [["--help"], ["validate", "{good}"], ["validate", "{bad}"], ["graph", "{good}"], ["stages"]],
    ids=["help", "validate-good", "validate-bad", "graph", "stages"],
)
def test_light_commands_do_not_import_torch_or_mlflow(files, tmp_path, args):
    good, bad = files
    script = tmp_path / "check_imports.py"
    script.write_text(CHECK_IMPORTS)
    argv = [a.format(good=good, bad=bad) for a in args]
    res = subprocess.run([sys.executable, str(script), *argv], capture_output=True, text=True, timeout=120)
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["code"] in (0, 2, None), res
    assert report["heavy"] == [], report["heavy"][:10]
