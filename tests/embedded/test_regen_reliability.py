"""Regeneration reliability (issue 40, items 4-7 and 9): --no-resume never deletes, stale replies redone,
the answering model checked and recorded, every assistant turn of a conversation regenerated, a reply the
output cannot hold counted and skipped. In process with the shipped target, and through real local server
processes (tests/embedded/fake_openai_server.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_flow.embedded.regen_io import OutputWriter
from dflash_flow.embedded.regenerate import regenerate

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dflash_flow", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _records(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


# -- item 4: --no-resume checks ownership first and moves the old output aside -------------------------------


def test_no_resume_refuses_a_file_regenerate_did_not_write_and_leaves_it(tmp_path, capsys):
    from dflash_flow.app.commands import regenerate_command

    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "a", "prompt": "Count to 3."}\n')
    out = tmp_path / "mine.jsonl"
    body = '{"note": "my own hand-written file"}\n'
    out.write_text(body)
    code = regenerate_command(src, "embedded", out, 8, 4, False, None)  # dflash-flow regenerate ... --no-resume
    err = capsys.readouterr().err
    assert code == 2, err
    assert "not a record written by dflash-flow regenerate" in err and err.count("\n") == 1
    assert out.read_text() == body
    assert not list(tmp_path.glob("mine.jsonl.old*"))


def test_no_resume_moves_an_old_output_aside_never_deletes_it(tmp_path, target):
    model, tok = target
    src = tmp_path / "p.jsonl"
    src.write_text('{"id": "a", "prompt": "Count to 3."}\n')
    out = tmp_path / "o.jsonl"
    old = '{"id": "a", "conversations": [], "finish_reason": "stop"}\n'
    out.write_text(old)
    stats = regenerate(src, None, out, max_new_tokens=4, resume=False, model=model, tokenizer=tok)
    assert stats.generated == 1 and stats.moved_aside == tmp_path / "o.jsonl.old"
    assert (tmp_path / "o.jsonl.old").read_text() == old
    assert [r["id"] for r in _records(out)] == ["a"]
    # a second start-over keeps the first one aside too: nothing is ever overwritten
    second = out.read_text()
    stats = regenerate(src, None, out, max_new_tokens=4, resume=False, model=model, tokenizer=tok)
    assert stats.moved_aside == tmp_path / "o.jsonl.old.2"
    assert (tmp_path / "o.jsonl.old").read_text() == old and (tmp_path / "o.jsonl.old.2").read_text() == second


def test_output_writer_start_over_is_refused_for_a_foreign_file(tmp_path):
    out = tmp_path / "o.jsonl"
    out.write_text('{"id": 1, "text": "no finish_reason"}\n')
    with pytest.raises(ValueError, match="not a record written by dflash-flow regenerate"):
        OutputWriter(out, resume=False).__enter__()
    assert out.read_text() == '{"id": 1, "text": "no finish_reason"}\n'
