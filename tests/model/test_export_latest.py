"""``export .../checkpoints/latest OUT`` and ``eval --drafter .../checkpoints/latest`` take the checkpoint the
``latest`` file names, as ``--resume latest`` does (issue 40.21; it was "no checkpoint at .../latest")."""

from __future__ import annotations

import json

import pytest
from model_testlib import build_drafter

from dflash_flow.app.checkpoint import Checkpointer
from dflash_flow.app.commands import _drafter_dir, eval_command, export_checkpoint
from dflash_flow.model.export import drafter_config_dict, load_drafter
from dflash_flow.model.export_contract import check_export

pytestmark = pytest.mark.usefixtures("one_thread")


def _checkpoints(target, root):
    d = build_drafter(target)
    files = {"config.json": json.dumps(drafter_config_dict(d.config))}
    for step in (3, 5):
        newest = Checkpointer(root).save(step=step, epoch=0, model_state=d.state_dict(), optimizer_state={"step": step},
                                         data_position={"epoch": 0, "plan": None, "total": step}, files=files)
    return newest


def test_export_of_the_latest_file_exports_the_checkpoint_it_names(target, tmp_path, capsys):
    newest = _checkpoints(target, tmp_path / "checkpoints")
    assert (tmp_path / "checkpoints" / "latest").is_file()
    assert export_checkpoint(tmp_path / "checkpoints" / "latest", tmp_path / "exported") == 0, capsys.readouterr().err
    assert f"exported {newest} ->" in capsys.readouterr().out
    check_export(tmp_path / "exported")


def test_eval_drafter_takes_the_latest_file_or_the_checkpoints_directory(target, tmp_path, capsys):
    newest = _checkpoints(target, tmp_path / "checkpoints")
    for given in (tmp_path / "checkpoints" / "latest", tmp_path / "checkpoints"):
        assert _drafter_dir(given) == newest
    load_drafter(_drafter_dir(tmp_path / "checkpoints" / "latest"))  # the drafter loads from it
    # the command gets past --drafter (it stops at the missing prompts file, before any model is loaded)
    code = eval_command(tmp_path / "checkpoints" / "latest", "tiny-qwen3-8l", tmp_path / "none.jsonl", 8, 1, False,
                        None)
    err = capsys.readouterr().err
    assert code == 2 and "--prompts" in err and "--drafter" not in err
    empty = tmp_path / "empty" / "checkpoints"
    empty.mkdir(parents=True)
    (empty / "latest").write_text("step-00000009\n")  # names a checkpoint that is not there
    assert eval_command(empty / "latest", "tiny-qwen3-8l", tmp_path / "none.jsonl", 8, 1, False, None) == 2
    assert "no checkpoint in" in capsys.readouterr().err
