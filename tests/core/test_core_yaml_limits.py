"""The YAML loader bounds its work (size, nesting, alias expansion) and refuses what cannot be built, with
one located message; ordinary anchors, aliases and merge keys still work. Limits live in core/limits.py."""

from __future__ import annotations

import sys
import textwrap

import pytest

from dflash_flow.core import ConfigError, Graph, limits, load_graph, load_graph_text, validate
from dflash_flow.core.yaml_load import load_value, parse_yaml, read_yaml_file

PIPE = "stages:\n  - {name: src, type: TestSource}\n  - {name: sink, type: TestSink, inputs: [src]}\n"


def _refused(text: str, name: str = "h.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        load_graph_text(text, name)
    (p,) = info.value.problems
    return p.format()


def _bomb(levels: int, width: int) -> str:
    lines = ["a0: &a0 [" + ", ".join(["x"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_anchors_aliases_and_merge_keys_still_work():
    text = textwrap.dedent(
        """\
        defaults: &d {count: 3, plain: true}
        stages:
          - {name: src, type: TestSource, config: {<<: *d, count: 4}}
          - {name: other, type: TestSource, config: *d}
          - {name: sink, type: TestSink, inputs: [src, other]}
        """
    )
    data, loc = parse_yaml(text, "a.yaml")
    assert data["stages"][0]["config"] == {"count": 4, "plain": True}
    assert data["stages"][1]["config"] == {"count": 3, "plain": True}
    assert loc.line("stages", 1, "config") == 4
    assert data["defaults"] is data["stages"][1]["config"]  # an alias is the same object: nothing expanded


def test_alias_expansion_is_counted_before_it_happens(monkeypatch):
    # 9 levels of 9 aliases stand for 9**9 strings: refused while composing, at the line that crosses.
    assert _refused(_bomb(9, 9) + PIPE) == (
        "h.yaml:5: the document stands for more than 20000 values once its aliases are expanded "
        "(an alias repeats the whole node it names); a pipeline file is far smaller"
    )
    # merge keys are aliases too
    merge = ["m0: &m0 {a: 1, b: 2}"] + [f"m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 9) + "]}" for i in range(1, 9)]
    assert "more than 20000 values once its aliases are expanded" in _refused("\n".join(merge) + "\n" + PIPE)
    # The count is exact: a document of exactly the limit is read, one more node is refused.
    # the root, key a0 + its list of 10, key a1 + its list of 4 aliases of 11 nodes each
    monkeypatch.setattr(limits, "MAX_YAML_NODES", 1 + (1 + 11) + (1 + 1 + 4 * 11))
    text = "a0: &a0 [" + ", ".join(["x"] * 10) + "]\na1: [*a0, *a0, *a0, *a0]\n"
    assert parse_yaml(text)[0]["a1"][3] == ["x"] * 10
    with pytest.raises(ConfigError, match="more than 59 values"):
        parse_yaml(text.replace("*a0]", "*a0, 1]"))


def test_plain_large_documents_are_refused_with_a_plain_message(monkeypatch):
    monkeypatch.setattr(limits, "MAX_YAML_NODES", 100)
    assert _refused("x: [" + ", ".join(["1"] * 200) + "]\n" + PIPE) == (
        "h.yaml:1: the document stands for more than 100 values (lists, mappings and scalars); "
        "a pipeline file is far smaller"
    )


@pytest.mark.parametrize(
    "text",
    [
        "x: " + "[" * 5000 + "]" * 5000 + "\n",
        "x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
        "x:\n" + "".join("  " * (i + 1) + "- \n" for i in range(100)),
        # 10 levels per anchor, nine anchors deep: 90 levels once expanded
        "\n".join(["d0: &d0 " + "[" * 10 + "1" + "]" * 10] + [f"d{i}: &d{i} " + "[" * 10 + f"*d{i - 1}" + "]" * 10 for i in range(1, 10)]) + "\n",
    ],
    ids=["flow-list", "flow-mapping", "block", "by-alias"],
)
def test_nesting_is_bounded_without_recursing(text):
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(400)  # the loader must stay far below Python's limit, whatever the input
    try:
        message = _refused(text + PIPE)
    finally:
        sys.setrecursionlimit(limit)
    assert message.endswith(f"lists and mappings nest deeper than {limits.MAX_YAML_DEPTH} levels")


def test_nesting_up_to_the_limit_is_read():
    ok = "x: " + "[" * (limits.MAX_YAML_DEPTH - 1) + "]" * (limits.MAX_YAML_DEPTH - 1) + "\n"
    assert parse_yaml(ok)[0]["x"] is not None
    with pytest.raises(ConfigError, match="nest deeper"):
        parse_yaml(ok.replace("[", "[[", 1).replace("]", "]]", 1))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x: &l [1, *l]\n", "h.yaml:1: alias '*l' refers to a node that contains it"),
        ("x: &m {a: *m}\n", "h.yaml:1: alias '*m' refers to a node that contains it"),
        ("stages:\n  - &s {name: a, type: TestSource, config: *s}\n", "h.yaml:2: alias '*s' refers to a node that contains it"),
        ("? [a, b]\n: 1\n", "h.yaml:1: a mapping key must be a plain value such as a name, not a list"),
        ("x: {? {a: 1} : 2}\n", "h.yaml:1: a mapping key must be a plain value such as a name, not a mapping"),
        ("x: &k [1]\ny: {*k : 2}\n", "h.yaml:2: a mapping key must be a plain value such as a name, not a list"),
        ("seed: " + "9" * 5000 + "\n", "h.yaml:1: a number literal of 5000 characters (at most 100)"),
        ("seed: 1" + ":00" * 1000 + "\n", "h.yaml:1: a number literal of 3001 characters (at most 100)"),
        ("name: 2024-02-30\n", "h.yaml:1: invalid YAML: cannot read this value: day is out of range for month"),
        ("seed: !!int abc\n", "h.yaml:1: invalid YAML: cannot read this value: invalid literal for int() with base 10: 'abc'"),
        ("name: a\x07b\n", "h.yaml:1: invalid YAML: character #x0007 is not allowed (special characters are not allowed)"),
        ("a: 1\n---\nb: 2\n", "h.yaml:2: invalid YAML: but found another document"),
    ],
)
def test_documents_that_cannot_be_built_are_refused_with_their_line(text, expected):
    assert _refused(text + ("" if "stages" in text else PIPE)).startswith(expected)


def test_non_string_scalar_keys_are_reported_as_unknown_fields():
    g = load_graph_text("stages:\n  - {name: src, type: TestSource, config: {1: 2}}\n", "k.yaml")
    (p,) = validate(g)
    assert p.format() == "k.yaml:2, stage 'src', field '1': unknown field '1'; known fields: count, max_delay_s, fail_at, plain"


def test_file_size_is_bounded_before_reading_it_all(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_text(PIPE + "# " + "x" * limits.MAX_YAML_BYTES + "\n")
    with pytest.raises(ConfigError) as info:
        read_yaml_file(big)
    assert info.value.problems[0].format() == f"{big}: the file is larger than 256 KiB, the most a pipeline file may have"
    # a device that never ends is read only up to the limit
    with pytest.raises(ConfigError, match="larger than 256 KiB"):
        read_yaml_file("/dev/zero")
    with pytest.raises(ConfigError, match="cannot read file"):
        read_yaml_file(tmp_path)
    with pytest.raises(ConfigError, match="larger than 256 KiB"):
        parse_yaml(" " * (limits.MAX_YAML_BYTES + 1))


def test_set_values_get_the_same_loader_and_limits(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(PIPE)

    def refused(*overrides: str) -> list[str]:
        with pytest.raises(ConfigError) as info:
            load_graph(path, list(overrides))
        return [p.message for p in info.value.problems]

    assert refused("stages.src.x=&a [*a]") == ["--set stages.src.x: alias '*a' refers to a node that contains it (a structure that contains itself cannot be read)"]
    assert refused("stages.src.x=" + "[" * 5000 + "]" * 5000) == ["--set stages.src.x: lists and mappings nest deeper than 64 levels"]
    bomb = "{" + _bomb(9, 9).strip().replace("\n", ", ") + "}"
    assert "more than 20000 values once its aliases are expanded" in refused("stages.src.x=" + bomb)[0]
    assert refused("stages.src.x={? [1]: 2}")[0].startswith("--set stages.src.x: a mapping key must be a plain value")
    (long_path,) = refused(".".join(["k"] * 65) + "=1")
    assert long_path.startswith("--set k.k.k.k") and long_path.endswith("...: a path of 65 keys (at most 64)")
    # The nesting of the place a value goes to counts: 60 levels under a path of 10 keys is too deep.
    deep = "[" * 60 + "]" * 60
    assert refused(".".join(["k"] * 10) + "=" + deep) == [f"--set {'.'.join(['k'] * 10)}: lists and mappings nest deeper than 64 levels"]
    assert load_value(deep, depth_offset=3) == load_value(deep)
    # a --set changes one place, also where the file shares a node through an alias
    shared = tmp_path / "shared.yaml"
    shared.write_text(PIPE.replace("type: TestSource}", "type: TestSource, config: &d {count: 3}}")
                      .replace("  - {name: sink", "  - {name: src2, type: TestSource, config: *d}\n  - {name: sink"))
    g = load_graph(shared, ["stages.src.count=7"])
    assert (g.stage("src").config, g.stage("src2").config) == ({"count": 7}, {"count": 3})
    # and every problem of every --set is reported at once
    assert len(refused("stages.src.x=&a [*a]", "novalue", "stages.src.y={? [1]: 2}")) == 3
    # text that is not YAML is still taken as a string
    assert load_graph(path, ["name=a: b: c"]).name == "a: b: c"


def test_replicas_and_capacity_are_bounded_by_what_a_machine_holds():
    g = Graph()
    g.add("src", "TestSource", replicas=10**9, capacity=10**12)
    g.add("sink", "TestSink", inputs=["src"], devices="cuda:0", replicas=limits.MAX_REPLICAS + 1)
    got = {(p.stage, p.field, p.message) for p in validate(g, gpu_count=1)}
    assert got == {
        ("src", "replicas", "replicas must be <= 1024 (each replica is a thread), got 1000000000"),
        ("src", "capacity", "capacity must be <= 65536 (items each input queue may hold in memory), got 1000000000000"),
        ("sink", "replicas", "replicas must be <= 1024 (each replica is a thread), got 1025"),
    }
    g = Graph()
    g.add("src", "TestSource", replicas=1000)
    for i in range(4):
        g.add(f"w{i}", "TestPass", inputs=["src"], replicas=1000)
    g.add("sink", "TestSink", inputs=[f"w{i}" for i in range(4)])
    (p,) = validate(g)
    assert p.message == "the stages ask for 5001 replicas in all; one process runs at most 4096 (each replica is a thread)"


def test_a_chain_longer_than_the_recursion_limit_validates():
    g = Graph()
    g.add("s0", "TestSource")
    n = sys.getrecursionlimit() + 500
    for i in range(1, n):
        g.add(f"s{i}", "TestPass", inputs=[f"s{i - 1}"])
    assert validate(g) == []
    g.stages[0].type = "TestPass"
    g.stages[0].inputs = g.stages[1].inputs[:0] + [type(g.stages[1].inputs[0])(f"s{n - 1}")]
    (p,) = validate(g)
    assert p.message == f"cycle: s1 -> s2 -> s3 -> ... -> s{n - 1} -> s0 -> s1 ({n} stages)"
