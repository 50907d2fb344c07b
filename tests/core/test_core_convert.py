"""The strict cattrs converter: no coercion, no unknown keys, NaN/inf refused, every problem at once."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any, Literal, Optional

import attrs
import pytest

from dflash_flow.core import Graph, RuntimeOptions, Stage, cfg, load_graph_text, validate
from dflash_flow.core import graph as core_sections
from dflash_flow.core.convert import structure
from dflash_flow.core.convert_types import describe_type
from dflash_flow.core.graph import describe_stage


@attrs.define(kw_only=True)
class Inner:
    depth: int = cfg(1, ge=1)
    scale: float = cfg(1.0)


@attrs.define(kw_only=True, eq=False)
class Typed(Stage):
    """Every kind of field the converter knows."""

    count: int = cfg(1, ge=0, le=100)
    rate: float = cfg(0.5, gt=0, lt=1)
    flag: bool = cfg(False)
    name: str = cfg("x")
    path: Path = cfg(Path("."))
    mode: Literal["a", "b"] = cfg("a")
    level: Literal[1, 2] = cfg(1)
    maybe: Optional[int] = cfg(None, ge=1)
    either: str | dict[str, Any] = cfg("s")
    num: float | int = cfg(0)
    sizes: list[int] = cfg(factory=list)
    opt_sizes: list[int] | None = cfg(None)
    pair: tuple[int, str] = cfg((0, "a"))
    weights: dict[str, float] = cfg(factory=dict)
    inner: Inner = cfg(factory=Inner)
    inners: list[Inner] = cfg(factory=list)
    threshold: float = cfg(1.0, ge=0, finite=False, doc="May be .inf (never stop).")
    cap: float = cfg(1.0, le=10, finite=False)
    scores: list[float] = cfg(factory=list)
    choice: str = cfg("p", choices=("p", "q"))
    plain: int = attrs.field(default=3, validator=attrs.validators.lt(10), kw_only=True)


def _problems(data: dict, cls: type = Typed) -> list[tuple[str | None, str]]:
    obj, probs = structure(cls, data)
    assert (obj is None) == bool(probs)
    return [(p.field, p.message) for p in probs]


def _one(data: dict, cls: type = Typed) -> tuple[str | None, str]:
    probs = _problems(data, cls)
    assert len(probs) == 1, probs
    return probs[0]


def test_valid_values_are_structured_to_their_types():
    obj, probs = structure(
        Typed,
        {
            "count": 3, "rate": 1 // 2 + 0.25, "path": "a/b", "maybe": 4, "either": {"k": 1}, "num": 3,
            "sizes": [1, 2], "opt_sizes": None, "pair": [5, "z"], "weights": {"a": 1}, "inner": {"depth": 2},
            "inners": [{"scale": 3}], "threshold": math.inf, "level": 2,
        },
    )
    assert probs == []
    assert obj.path == Path("a/b") and obj.pair == (5, "z") and obj.either == {"k": 1}
    assert obj.inner == Inner(depth=2) and obj.inners == [Inner(scale=3.0)]
    assert type(obj.num) is int  # an int stays an int in ``float | int``
    assert type(obj.weights["a"]) is float and type(obj.inners[0].scale) is float  # int -> float is fine
    assert obj.threshold == math.inf  # finite=False


@pytest.mark.parametrize(
    ("data", "field", "message"),
    [
        ({"count": "3"}, "count", "expected an integer, got str '3'"),
        ({"count": 3.0}, "count", "expected an integer, got float 3.0"),
        ({"count": True}, "count", "expected an integer, got bool True"),
        ({"flag": 1}, "flag", "expected a boolean, got int 1"),
        ({"flag": "yes"}, "flag", "expected a boolean, got str 'yes'"),
        ({"rate": "0.5"}, "rate", "expected a number, got str '0.5'"),
        ({"rate": False}, "rate", "expected a number, got bool False"),
        ({"name": 3}, "name", "expected a string, got int 3"),
        ({"path": ["a"]}, "path", "expected a string, got list"),
        ({"mode": "c"}, "mode", "expected one of 'a', 'b', got str 'c'"),
        ({"level": True}, "level", "expected one of 1, 2, got bool True"),
        ({"maybe": "x"}, "maybe", "expected an integer, got str 'x'"),
        ({"either": 3}, "either", "expected str | dict[str, Any], got int 3"),
        ({"sizes": "123"}, "sizes", "expected a list, got str '123'"),
        ({"sizes": {"a": 1}}, "sizes", "expected a list, got dict"),
        ({"opt_sizes": [1, "2"]}, "opt_sizes", "item 1: expected an integer, got str '2'"),
        ({"pair": [1, 2]}, "pair", "item 1: expected a string, got int 2"),
        ({"pair": [1]}, "pair", "expected a list of 2 items (tuple[int, str]), got 1"),
        ({"weights": {"a": "x"}}, "weights", "key 'a': expected a number, got str 'x'"),
        ({"weights": [1]}, "weights", "expected a mapping, got list"),
        ({"inner": 3}, "inner", "expected a mapping, got int 3"),
        ({"inner": {"depth": 0}}, "inner.depth", "'depth' must be >= 1: 0"),
        ({"inner": {"deep": 2}}, "inner.deep", "unknown field 'deep'; did you mean 'depth'?"),
        ({"inners": [{}, {"scale": "s"}]}, "inners[1].scale", "expected a number, got str 's'"),
        ({"count": 101}, "count", "'count' must be <= 100: 101"),
        ({"rate": 1}, "rate", "'rate' must be < 1: 1.0"),
        ({"maybe": 0}, "maybe", "'maybe' must be >= 1: 0"),
        ({"choice": "r"}, "choice", "'choice' must be in ('p', 'q') (got 'r')"),
        ({"plain": 10}, "plain", "'plain' must be < 10: 10"),
        ({"cuont": 1}, "cuont", "unknown field 'cuont'; did you mean 'count'?"),
    ],
)
def test_each_wrong_value_gets_one_message_with_its_field(data, field, message):
    assert _one(data) == (field, message)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_nan_and_infinity_are_refused_for_every_float_field(value):
    spelled = "float .nan" if math.isnan(value) else ("float .inf" if value > 0 else "float -.inf")
    assert _one({"rate": value}) == ("rate", f"expected a finite number, got {spelled} (this field takes no .inf or .nan)")
    assert _one({"scores": [1.0, value]})[1].startswith(f"item 1: expected a finite number, got {spelled}")
    assert _one({"inner": {"scale": value}})[0] == "inner.scale"
    assert _one({"weights": {"w": value}})[1].startswith(f"key 'w': expected a finite number, got {spelled}")
    assert _one({"num": value})[0] == "num"  # in a union too
    # runtime options are plain attrs fields: the converter refuses them as well
    _, probs = structure(RuntimeOptions, {"shutdown_grace_s": value}, field_prefix="runtime.")
    assert [p.field for p in probs] == ["runtime.shutdown_grace_s"]


def test_a_field_may_accept_infinity_but_its_bounds_still_refuse_nan():
    assert _problems({"threshold": math.inf, "cap": -math.inf}) == []
    assert _problems({"cap": math.inf}) == [("cap", "'cap' must be <= 10: inf")]
    assert _problems({"threshold": math.nan}) == [("threshold", "'threshold' must be >= 0: nan")]
    assert _problems({"cap": math.nan}) == [("cap", "'cap' must be <= 10: nan")]
    assert _problems({"threshold": 10**400}) == [("threshold", "expected a finite number, got int 1000000000000000000000000000000000000... (too large for a float)")]


def test_bounds_hold_against_nan_on_python_built_objects():
    # cfg's validators run in __init__ too: a Python caller cannot build a NaN or infinite setting either.
    with pytest.raises(ValueError, match="'rate' must be > 0: nan"):
        Typed(rate=math.nan)
    with pytest.raises(ValueError, match="'scale' must be a finite number, got inf"):
        Inner(scale=math.inf)
    assert Typed(threshold=math.inf, count=0).threshold == math.inf


def test_every_problem_of_a_mapping_is_reported_at_once():
    probs = _problems({"count": "x", "rate": 2, "sizes": ["a", "b"], "inner": {"depth": "d", "x": 1}, "nmae": 0, "zzz": 1})
    assert probs == [
        ("count", "expected an integer, got str 'x'"),
        ("rate", "'rate' must be < 1: 2.0"),
        ("sizes", "item 0: expected an integer, got str 'a'"),
        ("sizes", "item 1: expected an integer, got str 'b'"),
        ("inner.depth", "expected an integer, got str 'd'"),
        ("inner.x", "unknown field 'x'; known fields: depth, scale"),
        ("nmae", "unknown field 'nmae'; did you mean 'name'?"),
        ("zzz", "unknown field 'zzz'; known fields: " + ", ".join(f.name for f in Typed.config_fields())),
    ]


@attrs.define(kw_only=True, eq=False)
class Needy(Stage):
    size: int = cfg()
    ratio: float = cfg(0.5)

    @ratio.validator
    def _ratio_below_size(self, attribute, value):  # needs the instance: runs in __init__
        if value > self.size:
            raise ValueError(f"ratio {value} is larger than size {self.size}")

    def __attrs_post_init__(self):
        if self.size == 13:
            raise ValueError("13 is unlucky")


@attrs.define(kw_only=True, eq=False)
class Empty(Stage):
    pass


def test_required_fields_instance_validators_and_post_init_are_reported():
    assert _problems({}, Needy) == [("size", "missing required field 'size'")]
    assert _problems({"size": 1, "ratio": 2.0}, Needy) == [(None, "invalid config: ratio 2.0 is larger than size 1")]
    assert _problems({"size": 13}, Needy) == [(None, "invalid config: 13 is unlucky")]
    assert _problems({"x": 1}, Empty) == [("x", "unknown field 'x'; this stage takes no config")]
    obj, probs = structure(Needy, [1])
    assert obj is None and [p.message for p in probs] == ["config must be a mapping, got list"]


def test_problems_are_located_by_file_line_stage_and_field():
    text = textwrap.dedent(
        """\
        runtime:
          capacity: "8"
          watchdog_interval_s: .nan
        stages:
          - name: src
            type: TestSource
            config:
              count: 1.5
              max_delay_s: -.inf
          - {name: t, type: TestTyped, inputs: [src], config: {required: 1, sizes: [1, "2"]}}
        """
    )
    with pytest.raises(Exception) as info:
        load_graph_text(text, "p.yaml")
    assert [p.format() for p in info.value.problems] == [
        "p.yaml:2, field 'runtime.capacity': expected an integer, got str '8'",
        "p.yaml:3, field 'runtime.watchdog_interval_s': expected a finite number, got float .nan (this field takes no .inf or .nan)",
    ]
    probs = validate(load_graph_text(text.replace('"8"', "8").replace(".nan", "1.0"), "p.yaml"))
    assert [p.format() for p in probs] == [
        "p.yaml:8, stage 'src', field 'count': expected an integer, got float 1.5",
        "p.yaml:9, stage 'src', field 'max_delay_s': expected a finite number, got float -.inf (this field takes no .inf or .nan)",
        "p.yaml:10, stage 't', field 'sizes': item 1: expected an integer, got str '2'",
    ]


def test_graphs_built_in_python_get_the_same_checks():
    g = Graph(runtime=RuntimeOptions(shutdown_grace_s=math.nan, capacity="8"))  # type: ignore[arg-type]
    g.add("src", "TestSource", replicas="2", devices=[])  # type: ignore[arg-type]
    g.add("sink", "TestSink", inputs=["src"])
    assert sorted((p.stage, p.field, p.message) for p in validate(g)) == [
        ("src", "devices", "'devices' must be a device string or a non-empty list of them"),
        ("src", "replicas", "'replicas' must be an integer, got '2'"),
    ]
    g.stages[0].replicas, g.stages[0].devices = 2, "cpu"
    assert sorted((p.field, p.message) for p in validate(g)) == [
        ("runtime.capacity", "expected an integer, got str '8'"),
        ("runtime.shutdown_grace_s", "expected a finite number, got float .nan (this field takes no .inf or .nan)"),
    ]


@attrs.define(kw_only=True)
class _Section:
    budget: float = attrs.field(default=1.0)


def test_application_sections_are_strict_in_yaml_and_in_python(monkeypatch):
    monkeypatch.setitem(core_sections._SECTIONS, "budgeting", _Section)
    text = "budgeting: {budget: .inf, extra: 1}\nstages:\n  - {name: s, type: TestSource}\n"
    with pytest.raises(Exception) as info:
        load_graph_text(text, "s.yaml")
    assert [(p.field, p.line) for p in info.value.problems] == [("budgeting.budget", 1), ("budgeting.extra", 1)]
    g = Graph()
    g.add("s", "TestSource")
    g.sections["budgeting"] = _Section(budget=math.nan)
    assert [p.field for p in validate(g)] == ["budgeting.budget"]


def test_describe_lists_types_bounds_and_finiteness():
    assert describe_type(Optional[list[int]]) == "list[int] | null"
    assert describe_type(Literal["a", "b"]) == "'a' | 'b'"
    text = describe_stage("TestTyped")
    assert "  - size: int (default 1)  [>= 1]" in text
    assert "  - mode: str (default 'a')  [one of 'a', 'b']" in text


def test_finite_false_is_shown_by_describe(monkeypatch):
    from dflash_flow.core import registry

    monkeypatch.setitem(registry._REGISTERED, "TestConvertTyped", Typed)
    text = describe_stage("TestConvertTyped")
    assert "  - threshold: float (default 1.0)  May be .inf (never stop).  [>= 0, .inf and .nan accepted]" in text
    assert "  - either: str | dict[str, Any] (default 's')" in text
