"""The README's "Your own data and target" walkthrough, run as written: its shell block between the
``own-data`` markers is executed by bash in a fresh directory, with the embedded target's directory in
place of ``/path/to/model``; so the README cannot rot. Checks what the README says each step leaves."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "dflash_flow" / "embedded" / "assets" / "target"


def walkthrough() -> str:
    text = (REPO / "README.md").read_text()
    m = re.search(r"<!-- own-data:begin -->\s*```bash\n(.*?)```\s*<!-- own-data:end -->", text, re.S)
    assert m, "README.md lost its own-data walkthrough block"
    return m.group(1)


def test_the_walkthrough_names_only_files_that_exist() -> None:
    script = walkthrough()
    for path in re.findall(r"examples/\S+", script):
        assert (REPO / path).is_file(), path
    assert "/path/to/model" in script


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_readme_walkthrough_runs_as_written(tmp_path: Path) -> None:
    script = walkthrough().replace("/path/to/model", str(MODEL))
    (tmp_path / "examples").symlink_to(REPO / "examples")  # the README's commands run from the repo root
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]
    regen = [json.loads(x) for x in (tmp_path / "chat.regen.jsonl").read_text().splitlines()]
    assert len(regen) == 4  # both formats, with and without a reply, all regenerated
    for rec in regen:
        turns = rec.get("conversations") or rec.get("messages")
        assert turns[-1]["role"] == "assistant" and turns[-1]["content"] not in ("", "...")
    out = tmp_path / "runs" / "own-data"
    assert (out / "drafter" / "model.safetensors").is_file() and (out / "summary.json").is_file()
    assert json.loads((out / "summary.json").read_text())["status"] == "FINISHED"
    summary = json.loads((out / "monitor" / "summary.json").read_text())
    assert summary["eval"]["trained"]["num_prompts"] == 1 and summary["eval"]["trained"]["lossless"] == 1
    assert (tmp_path / "mlflow.db").is_file()  # where the README says the store goes
    assert "training 4 samples" in res.stderr  # the start banner
    assert "Creating initial MLflow database tables" not in res.stderr  # no library noise
