"""Settings refused by validate, before anything is read or trained (issue 40, items 10, 11, 14): a token
store that cannot be a directory, a mixture that does not fit the Bucketer's inputs or whose weights
overflow, a max_length past the target's context window (a warning)."""

from __future__ import annotations

import json

import pytest

from dflash_flow.app.runner import load
from dflash_flow.core import ConfigError, Graph
from dflash_flow.stages.sources import TokenizedSource


def _tokens(path) -> str:
    path.write_text(json.dumps({"input_ids": [1, 2, 3, 4], "loss_mask": [0, 1, 1, 1]}) + "\n")
    return str(path)


def _messages(exc: ConfigError) -> list[str]:
    return [p.format() for p in exc.problems]


# -- item 10: cache_dir (or $DFLASH_FLOW_CACHE) that is a file or a dangling link ---------------------------


@pytest.mark.parametrize("kind", ["file", "dangling link", "file above"])
def test_a_cache_dir_that_cannot_be_a_directory_is_refused_by_validate(tmp_path, kind):
    data = _tokens(tmp_path / "t.jsonl")
    if kind == "file":
        cache = tmp_path / "cache"
        cache.write_text("not a directory")
    elif kind == "dangling link":
        cache = tmp_path / "cache"
        cache.symlink_to(tmp_path / "gone")
    else:
        (tmp_path / "f").write_text("x")
        cache = tmp_path / "f" / "cache"
    g = Graph(name="c")
    g.add("src", TokenizedSource(paths=[data], cache_dir=str(cache)))
    with pytest.raises(ConfigError) as e:
        load(g, check_devices=False)
    [msg] = _messages(e.value)
    assert "field 'cache_dir'" in msg and ("not a directory" in msg or "does not exist" in msg)


def test_a_cache_env_that_is_a_file_is_refused_naming_the_variable(tmp_path, monkeypatch):
    env = tmp_path / "cache-file"
    env.write_text("x")
    monkeypatch.setenv("DFLASH_FLOW_CACHE", str(env))
    g = Graph(name="c")
    g.add("src", TokenizedSource(paths=[_tokens(tmp_path / "t.jsonl")]))  # cache_dir: auto
    with pytest.raises(ConfigError) as e:
        load(g, check_devices=False)
    [msg] = _messages(e.value)
    assert "$DFLASH_FLOW_CACHE" in msg and "not a directory" in msg and str(env) in msg


def test_a_cache_dir_that_will_be_created_passes(tmp_path):
    g = Graph(name="c")
    g.add("src", TokenizedSource(paths=[_tokens(tmp_path / "t.jsonl")], cache_dir=str(tmp_path / "new" / "cache")))
    load(g, check_devices=False)
