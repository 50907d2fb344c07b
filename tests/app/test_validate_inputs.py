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


# -- item 11: a mixture that does not fit the Bucketer's sources; weights that overflow --------------------


def _mixed_graph(tmp_path, mixture):
    from dflash_flow.stages.bucketer import Bucketer

    g = Graph(name="m")
    for name in ("chat", "code"):
        g.add(name, TokenizedSource(paths=[_tokens(tmp_path / f"{name}.jsonl")], cache_dir=None))
    g.add("bucket", Bucketer(max_tokens=4096, mixture=mixture), inputs=["chat", "code"])
    return g


@pytest.mark.parametrize("mixture,says", [
    ({"chat": 1.0}, "no weight for 'code'"),
    ({"chat": 1.0, "code": 1.0, "poetry": 2.0}, "'poetry' is not among its sources"),
])
def test_a_mixture_that_omits_or_invents_a_source_is_refused_by_validate(tmp_path, mixture, says):
    with pytest.raises(ConfigError) as e:
        load(_mixed_graph(tmp_path, mixture), check_devices=False)
    [msg] = _messages(e.value)
    assert "stage 'bucket', field 'mixture'" in msg and says in msg and "chat, code" in msg


def test_a_mixture_in_yaml_is_refused_at_its_line(tmp_path):
    from dflash_flow.core.config import load_graph

    _tokens(tmp_path / "a.jsonl")
    _tokens(tmp_path / "b.jsonl")
    f = tmp_path / "p.yaml"
    f.write_text(f"""name: m
stages:
  - {{name: a, type: TokenizedSource, config: {{paths: [{tmp_path}/a.jsonl], cache_dir: null}}}}
  - {{name: b, type: TokenizedSource, config: {{paths: [{tmp_path}/b.jsonl], cache_dir: null}}}}
  - name: bucket
    type: Bucketer
    inputs: [a, b]
    config:
      max_tokens: 4096
      mixture: {{a: 1.0}}
""")
    with pytest.raises(ConfigError) as e:
        load(load_graph(f), check_devices=False)
    [p] = e.value.problems
    assert p.line == 10 and p.field == "mixture"


def test_huge_weights_keep_their_proportions():
    from dflash_flow.data.plan import draw_epoch, mixture_counts

    assert mixture_counts([1e308, 1e308], 78) == [39, 39]
    assert mixture_counts([1e308, 1e308 / 3], 80) == [60, 20]
    pos, drawn = draw_epoch([("a", 0, 50), ("b", 50, 78)], {"a": 1e308, "b": 1e308}, samples_per_epoch=None,
                            replacement=False, seed=0, epoch=0)
    assert pos.size == 78 and drawn == {"a": 39, "b": 39}


# -- item 14: prompts past the target's context window -------------------------------------------------------


def test_target_facts_read_the_context_window():
    from dflash_flow.embedded.train_target import embedded_target_path
    from dflash_flow.model.facts import target_facts

    assert target_facts(str(embedded_target_path())).max_positions == 1024
    assert target_facts("tiny-qwen3-8l").max_positions == 4096
    assert target_facts({"preset": "tiny-qwen3-8l", "max_position_embeddings": None}).max_positions is None


def test_validate_warns_when_max_length_is_past_the_targets_window(tmp_path, caplog):
    import logging

    from dflash_flow.core.config import load_graph

    data = tmp_path / "c.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n")
    f = tmp_path / "p.yaml"
    for max_length, warned in ((8192, True), (1024, False)):
        f.write_text(f"name: w\nmodel: {{target: embedded}}\nstages:\n"
                     f"  - {{name: src, type: ChatSource, config: {{paths: [{data}], max_length: {max_length}}}}}\n")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dflash_flow"):
            load(load_graph(f), check_devices=False)
        said = [r.getMessage() for r in caplog.records if "context window" in r.getMessage()]
        assert bool(said) == warned
        if warned:
            assert said[0].startswith(f"warning: {f}:4, stage 'src', field 'max_length': max_length 8192 is past the "
                                      "target's context window of 1024 positions")


# -- item 24: a relative path that is not there names the directory it was looked for in --------------------


def test_a_missing_relative_data_file_names_the_working_directory(tmp_path, monkeypatch):
    from dflash_flow.core.config import load_graph

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "data.jsonl").write_text("{}\n")  # beside the YAML: not where it is looked for
    f = tmp_path / "conf" / "p.yaml"
    f.write_text("name: r\nstages:\n  - {name: src, type: TokenizedSource, config: {paths: [data.jsonl]}}\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        load(load_graph(f))
    [msg] = _messages(e.value)
    assert f"data.jsonl: no such file (a data file src reads) (looked for in {tmp_path}, the working directory" in msg
    assert "not against the pipeline file" in msg
    g = Graph(name="a")
    g.add("src", TokenizedSource(paths=[str(tmp_path / "none.jsonl")]))
    with pytest.raises(ConfigError) as e:
        load(g)
    assert _messages(e.value)[0].endswith("no such file (a data file src reads)")  # absolute: said as it is
