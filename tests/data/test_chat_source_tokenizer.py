"""A ChatSource renders chats with the target's tokenizer when the pipeline declares the target once
(``model.target``): no tokenizer repeated in the source, no run-time 'set tokenizer' failure."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from dflash_flow.app import load, model_services
from dflash_flow.core import Pipeline

MODEL = Path(__file__).resolve().parents[2] / "dflash_flow" / "embedded" / "assets" / "target"


def _doc(tmp_path: Path, **model) -> Path:
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({key: [{"role": "user", "content": f"hi {i}"},
                                              {"role": "assistant", "content": f"hello number {i}"}]}) + "\n"
                            for i, key in enumerate(["conversations", "messages"] * 3)))
    doc = {"name": "t", "output_dir": str(tmp_path / "out"), "model": {"target": str(MODEL), **model},
           "stages": [{"name": "src", "type": "ChatSource", "config": {"paths": [str(chat)], "cache_dir": None}},
                      {"name": "sink", "type": "Discard", "inputs": ["src"]}]}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_source_takes_the_tokenizer_of_model_target(tmp_path: Path) -> None:
    v = load(_doc(tmp_path), check_devices=False)
    services = model_services(v)
    assert services.model.tokenizer == str(MODEL)
    pipe = Pipeline(v, check_devices=False, services=services)
    pipe.run()
    src = pipe.snapshot().stages["src"].replicas[0].metrics
    assert src["samples"] == 6 and not src.get("bad_records")


def test_model_tokenizer_wins_over_the_target(tmp_path: Path) -> None:
    v = load(_doc(tmp_path, tokenizer=str(MODEL)), check_devices=False)
    assert model_services(v).model.tokenizer == str(MODEL)
