"""bench/gpu.py is ready for the first GPU: its code path runs here on a CPU with tiny models, without
MLflow, typer or rich (the GPU machine has none of them), and its correctness check is real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_bench_smoke_runs_on_cpu_without_mlflow(tmp_path):
    out = tmp_path / "gpu.json"
    code = (
        "import sys, runpy\n"
        "for m in ('mlflow', 'typer', 'rich'):\n    sys.modules[m] = None  # import fails, as on the GPU machine\n"
        f"sys.argv = ['gpu.py', '--tiny', '--device', 'cpu', '--steps', '3', '--out', {str(out)!r}]\n"
        f"runpy.run_path({str(REPO / 'bench' / 'gpu.py')!r}, run_name='__main__')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["correctness"]["ok"] and result["correctness"]["reference"][1] > 0
    pipe = result["pipeline"]
    assert pipe["steps"] == 3 and pipe["target_tokens_per_s"] > 0 and pipe["drafter_step_s_mean"] > 0
    assert 0.0 <= pipe["data_wait_fraction"] <= 1.0
