"""bench/gpu.py is ready for the first GPU: its code path runs here on a CPU with tiny models, without
MLflow, typer or rich (the GPU machine has none of them), its correctness check is real (a backward
included), and its figures leave the setup out (issue 41, review finding 3)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_gpu_bench_tiny_on_cpu_measures_a_steady_window_after_a_real_setup(tmp_path):
    out = tmp_path / "gpu.json"
    # TargetForward's setup takes 0.5 s longer (as a real model load does): the setup seconds must show it, and
    # the window's figures must not contain it (busy is alive less blocked, so the old figures counted setups).
    code = (
        "import sys, runpy, time\n"
        "for m in ('mlflow', 'typer', 'rich'):\n    sys.modules[m] = None  # import fails, as on the GPU machine\n"
        "from dflash_flow.stages.target_forward import TargetForward\n"
        "setup = TargetForward.setup\n"
        "def slow_setup(self, ctx):\n    time.sleep(0.5)\n    return setup(self, ctx)\n"
        "TargetForward.setup = slow_setup\n"
        f"sys.argv = ['gpu.py', '--tiny', '--device', 'cpu', '--steps', '3', '--warmup', '2', '--out', {str(out)!r}]\n"
        f"runpy.run_path({str(REPO / 'bench' / 'gpu.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    result = json.loads(out.read_text())
    corr = result["correctness"]
    assert corr["ok"] and corr["reference"][1] > 0 and corr["grad_cosine"] > 0.99
    pipe = result["pipeline"]
    assert pipe["steps"] == 5
    assert pipe["setup_s"]["target"] >= 0.5 and pipe["setup_s"]["drafter"] > 0
    window = pipe["window"]
    assert window is not None and window["optimizer_steps"] >= 1 and window["drafter_step_s"] > 0
    assert window["seconds"] < pipe["wall_s"]
    assert 0.0 <= window["data_wait_fraction"] <= 1.0
    assert result["alone"]["target_forward_s"] > 0 and result["alone"]["drafter_micro_batch_s"] > 0
    checks = {c["check"]: c for c in result["checks"]}
    assert not [c for c in result["checks"] if c["ok"] is False], result["checks"]
    assert checks["setup time measured (the target's build)"]["ok"] is True
    findings = {c["finding"] for c in result["checks"]} | {line[1:line.index("]")] for line in result["must_check"]}
    assert {"1", "2", "3"} <= findings
    assert "checks:" in proc.stdout and "the first GPU run must also look at:" in proc.stdout
