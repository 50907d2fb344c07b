"""Validation: every problem at once, each located by file, line, stage and field; before any thread."""

from __future__ import annotations

import textwrap

import pytest

from dflash_flow.core import ConfigError, Graph, load_graph, load_graph_text, validate, validated

BAD = textwrap.dedent(
    """\
    name: bad
    stages:
      - name: src
        type: TestSource
        config:
          count: "ten"
          cuont: 3
      - name: mystery
        type: NoSuchStage
        inputs: [src]
      - name: dangling
        type: TestPass
        inputs: [nowhere]
      - name: orphan
        type: TestPass
      - name: strs
        type: TestIntOnly
        inputs: [typed]
      - name: typed
        type: TestDrop
        inputs: [src]
      - name: loop_a
        type: TestPass
        inputs: [loop_b]
      - name: loop_b
        type: TestPass
        inputs: [loop_a]
      - name: src
        type: TestSource
      - name: gpu
        type: TestPass
        inputs: [typed]
        devices: cuda:1
        replicas: 0
        capacity: 0
      - name: weird
        type: TestPass
        inputs: [typed]
        devices: tpu
    """
)


def _by(problems, stage, field):
    return [p for p in problems if p.stage == stage and p.field == field]


def test_every_problem_reported_at_once_and_located(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BAD)
    problems = validate(load_graph(path), gpu_count=0)
    assert all(p.file == str(path) for p in problems)
    assert all(p.line is not None for p in problems)

    def one(stage, field, text, line):
        hits = [p for p in _by(problems, stage, field) if text in p.message]
        assert hits, f"no problem for {stage}.{field} containing {text!r} in:\n" + "\n".join(
            p.format() for p in problems
        )
        assert hits[0].line == line, hits[0].format()
        return hits[0]

    one("src", "count", "expected an integer", 6)
    assert "did you mean 'count'" in one("src", "cuont", "unknown field 'cuont'", 7).message
    one("mystery", "type", "unknown stage type 'NoSuchStage'", 9)
    one("dangling", "inputs", "dangling input: no stage named 'nowhere'", 13)
    one("orphan", "inputs", "missing input", 14)
    one("strs", "inputs", "type mismatch: 'typed' emits int but 'strs' (TestIntOnly) accepts str", 18)
    cyc = [p for p in problems if p.message.startswith("cycle:")]
    assert len(cyc) == 1 and "loop_a" in cyc[0].message and "loop_b" in cyc[0].message
    assert cyc[0].stage in ("loop_a", "loop_b") and cyc[0].line in (24, 27)
    one("src", "name", "duplicate stage name 'src'", 28)
    one("gpu", "replicas", "replicas must be >= 1", 34)
    one("gpu", "capacity", "capacity must be >= 1", 35)
    one("gpu", "devices", "no visible CUDA device", 33)
    one("weird", "devices", "bad device 'tpu'", 39)
    # format() gives file:line, stage and field on one line
    text = _by(problems, "weird", "devices")[0].format()
    assert text.startswith(f"{path}:39, stage 'weird', field 'devices': bad device")


def test_validated_raises_config_error_with_all_problems():
    with pytest.raises(ConfigError) as info:
        validated(load_graph_text(BAD, "bad.yaml"), gpu_count=0)
    assert len(info.value.problems) == 12
    assert str(info.value).count("\n") == len(info.value.problems) - 1


def test_gpu_stage_on_machine_without_that_device():
    g = Graph()
    g.add("src", "TestSource")
    g.add("a", "TestPass", inputs=["src"], devices="cuda")
    g.add("b", "TestPass", inputs=["src"], devices=["cuda:0", "cuda:3"], replicas=2)
    g.add("c", "TestPass", inputs=["src"], devices="auto")
    none = validate(g, gpu_count=0)
    assert {(p.stage, p.field) for p in none} == {("a", "devices"), ("b", "devices")}
    one = validate(g, gpu_count=1)
    assert [(p.stage, p.field) for p in one] == [("b", "devices")]
    assert "cuda:3" in one[0].message and "only 1 CUDA device" in one[0].message
    assert validate(g, gpu_count=4) == []
    assert validate(g, check_devices=False, gpu_count=0) == []


def test_python_graph_problems_name_stage_and_field():
    g = Graph()
    g.add("src", "TestSource", config={"count": -1})
    g.add(
        "t",
        "TestTyped",
        inputs=["src"],
        config={"size": 0, "rate": "high", "flag": 1, "sizes": [1, "2"], "mode": "c"},
    )
    g.add("p", "TestPass", inputs=[("src", "sideways")])
    g.add("self", "TestPass", inputs=["self"])
    problems = validate(g)
    got = {(p.stage, p.field) for p in problems}
    assert {
        ("src", "count"),
        ("t", "size"),
        ("t", "rate"),
        ("t", "flag"),
        ("t", "sizes"),
        ("t", "mode"),
        ("t", "required"),
    } <= got
    assert any(p.stage == "p" and "unknown fan-out policy 'sideways'" in p.message for p in problems)
    assert any(p.stage == "self" and "its own input" in p.message for p in problems)
    assert all(p.file is None for p in problems)


def test_source_with_inputs_and_sink_as_producer():
    g = Graph()
    g.add("src", "TestSource")
    g.add("src2", "TestSource", inputs=["src"])
    g.add("sink", "TestSink", inputs=["src"])
    g.add("after", "TestPass", inputs=["sink"])
    msgs = {(p.stage, p.message) for p in validate(g)}
    assert any(s == "src2" and "is a source and takes no inputs" in m for s, m in msgs)
    assert any(s == "after" and "'sink' (TestSink) has no output" in m for s, m in msgs)


def test_ordered_needs_single_origin_and_single_replica():
    g = Graph()
    g.add("src", "TestSource", replicas=2)
    g.add("a", "TestPass", inputs=["src"], replicas=3)
    g.add("sink", "TestSink", inputs=["a"], ordered=True, replicas=2)
    probs = validate(g)
    assert [(p.stage, p.field) for p in probs] == [("sink", "ordered")]
    g.stage("sink").replicas = 1
    probs = validate(g)
    assert "'src' starts the order but has 2 replicas" in probs[0].message
    g.stage("src").replicas = 1
    assert validate(g) == []


def test_runtime_options_and_top_level_keys_are_checked(tmp_path):
    text = textwrap.dedent(
        """\
        name: r
        sede: 3
        runtime:
          capacity: 0
          stall_timeout: 5
        stages:
          - name: src
            type: TestSource
            replica: 2
        """
    )
    with pytest.raises(ConfigError) as info:
        validated(load_graph_text(text, "r.yaml"))
    probs = info.value.problems
    msgs = [p.format() for p in probs]
    assert any("r.yaml:2" in m and "unknown top-level key 'sede'; did you mean 'seed'" in m for m in msgs), (
        msgs
    )
    assert any("r.yaml:5" in m and "unknown field 'stall_timeout'" in m for m in msgs), msgs
    assert any(
        "r.yaml:9" in m and "unknown stage key 'replica'; did you mean 'replicas'" in m for m in msgs
    ), msgs
    # Shape problems are found first; the numeric check runs on a well-formed file.
    fixed = (
        text.replace("sede", "seed").replace("  stall_timeout: 5\n", "").replace("replica: 2", "replicas: 2")
    )
    with pytest.raises(ConfigError) as info:
        validated(load_graph_text(fixed, "r.yaml"))
    assert [p.format() for p in info.value.problems] == [
        "r.yaml:4, field 'runtime.capacity': runtime.capacity must be >= 1, got 0"
    ]


def test_python_object_tags_are_rejected_with_line():
    text = "name: x\nstages:\n  - name: a\n    type: !!python/object/apply:os.system ['echo pwned']\n"
    with pytest.raises(ConfigError) as info:
        load_graph_text(text, "evil.yaml")
    (p,) = info.value.problems
    assert (p.file, p.line) == ("evil.yaml", 4)
    assert "not allowed" in p.message


def test_duplicate_yaml_keys_and_syntax_errors_are_located():
    with pytest.raises(ConfigError) as info:
        load_graph_text("name: a\nname: b\nstages: []\n", "dup.yaml")
    assert info.value.problems[0].format() == "dup.yaml:2: duplicate key 'name'"
    with pytest.raises(ConfigError) as info:
        load_graph_text("name: a\nstages: [\n", "syn.yaml")
    assert info.value.problems[0].file == "syn.yaml" and info.value.problems[0].line is not None


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_graph(tmp_path / "nope.yaml")


def test_runtime_numbers_are_located():
    text = "runtime:\n  watchdog_interval_s: 0\n  drain_timeout_s: -1\nstages:\n  - {name: src, type: TestSource}\n"
    probs = validate(load_graph_text(text, "rt.yaml"))
    assert sorted(p.format() for p in probs) == [
        "rt.yaml:2, field 'runtime.watchdog_interval_s': runtime.watchdog_interval_s must be > 0",
        "rt.yaml:3, field 'runtime.drain_timeout_s': runtime.drain_timeout_s must be >= 0",
    ]


def test_ordered_input_from_several_origins_is_rejected():
    g = Graph()
    g.add("a", "TestSource")
    g.add("b", "TestSource")
    g.add("mid", "TestPass", inputs=["a", "b"], replicas=2)
    g.add("sink", "TestSink", inputs=["mid"], ordered=True)
    (p,) = validate(g)
    assert (p.stage, p.field) == ("sink", "ordered")
    assert "several origins (a, b)" in p.message


def test_ordered_input_reached_twice_is_rejected():
    # A diamond delivers every item twice: there is no single source order to restore.
    g = Graph()
    g.add("src", "TestSource")
    g.add("a", "TestPass", inputs=["src"])
    g.add("b", "TestPass", inputs=["src"], replicas=2)
    g.add("sink", "TestSink", inputs=["a", "b"], ordered=True)
    (p,) = validate(g)
    assert (p.stage, p.field) == ("sink", "ordered")
    assert "items of stage 'src' arrive by more than one path" in p.message
    # broadcast into a replicated stage on the way duplicates items too
    g = Graph()
    g.add("src", "TestSource")
    g.add("a", "TestPass", inputs=[("src", "broadcast")], replicas=2)
    g.add("sink", "TestSink", inputs=["a"], ordered=True)
    (p,) = validate(g)
    assert "receives 'src' by broadcast to 2 replicas" in p.message
    # broadcast into a single replica is harmless
    g.stage("a").replicas = 1
    assert validate(g) == []


def test_runtime_waits_names_and_seeds_are_bounded():
    text = (
        "name: ../up\nseed: 9223372036854775808\nruntime:\n  stall_timeout_s: 1.0e+12\n  watchdog_interval_s: .nan\n"
        "stages:\n  - {name: " + "s" * 101 + ", type: TestSource}\n"
    )
    with pytest.raises(ConfigError) as info:
        load_graph_text(text, "b.yaml")
    assert [(p.line, p.field) for p in info.value.problems] == [
        (1, "name"), (2, "seed"), (5, "runtime.watchdog_interval_s"), (7, "name"),
    ]
    g = Graph()
    g.runtime.stall_timeout_s = 1e12
    g.runtime.drain_timeout_s = float("nan")
    g.add("src", "TestSource")
    assert sorted(p.format() for p in validate(g)) == [
        "field 'runtime.drain_timeout_s': expected a finite number, got float .nan (this field takes no .inf or .nan)",
    ]
    g.runtime.drain_timeout_s = 1.0
    assert [p.format() for p in validate(g)] == [
        "field 'runtime.stall_timeout_s': runtime.stall_timeout_s must be <= 1000000000 "
        "(seconds; longer waits overflow the clock), got 1e+12"
    ]


NESTED = textwrap.dedent(
    """\
    name: nested
    stages:
      - {name: src, type: TestSource}
      - name: shared
        type: TestPass
        inputs: [src]
        replicas: 2
        devices:
          - [cuda:0, cuda:1]
          - [cuda:1, cuda:2]
      - {name: short, type: TestPass, inputs: [src], replicas: 3, devices: [[cuda:0], [cuda:1]]}
      - {name: twice, type: TestPass, inputs: [src], devices: [[cuda, cuda:0]]}
      - {name: auto, type: TestPass, inputs: [src], devices: [[auto]]}
      - {name: ok, type: TestPass, inputs: [src], replicas: 2, devices: [[cuda:0], [cuda:1]]}
      - name: tf
        type: TargetForward
        inputs: [src]
        replicas: 2
        devices: [[cuda:0, cuda:1], [cuda:2, cuda:3]]
    """
)


def test_device_lists_per_replica_are_checked_and_located(tmp_path):
    path = tmp_path / "nested.yaml"
    path.write_text(NESTED)
    problems = validate(load_graph(path), gpu_count=4)
    got = sorted((p.stage, p.field, p.line, p.message.split(":")[0] if p.stage == "tf" else p.message[:40]) for p in problems)
    assert got == sorted([
        ("shared", "devices", 9, "device list 0 has 2 devices, but stage t"),
        ("shared", "devices", 10, "device list 1 has 2 devices, but stage t"),
        ("shared", "devices", 10, "device lists 0 and 1 both use cuda:1: gi"),
        ("short", "devices", 11, "devices gives 2 device lists (one per re"),
        ("twice", "devices", 12, "device list 0 has 2 devices, but stage t"),
        ("twice", "devices", 12, "device cuda:0 appears twice in device li"),
        ("auto", "devices", 13, "'auto' cannot be used in a list of devic"),
    ]), "\n".join(p.format() for p in problems)
    by = {(p.stage, p.message[:12]): p for p in problems}
    assert "stage type 'TestPass' runs each replica on one device" in by[("shared", "device list ")].message
    # Beyond the machine / the rank's slice: every device of every list is mapped like a flat one.
    few = validate(load_graph(path), gpu_count=2)
    assert any(p.stage == "tf" and "cuda:3 requested but only 2 CUDA device(s)" in p.message for p in few)
    two_ranks = validate(load_graph(path), gpu_count=4, local_world_size=2)
    assert any(p.stage == "tf" and "beyond this rank's 2 GPU(s)" in p.message for p in two_ranks)


def test_malformed_nestings_are_reading_errors_with_a_line():
    base = "stages:\n  - {name: src, type: TestSource}\n  - {name: t, type: TestPass, inputs: [src], devices: %s}\n"
    for value, text in [
        ("[cuda:0, [cuda:1, cuda:2]]", "'devices' mixes device strings and lists"),
        ("[[cuda:0], []]", "'devices' list 1 must be a non-empty list of device strings"),
        ("[[cuda:0, [cuda:1]]]", "'devices' list 0 must be a non-empty list of device strings (lists nest one level)"),
        ("[[cuda:0, 3]]", "'devices' list 0 must be a non-empty list of device strings"),
        ("[]", "'devices' must be a device string or a non-empty list of them"),
    ]:
        with pytest.raises(ConfigError) as info:
            load_graph_text(base % value, "n.yaml")
        [p] = info.value.problems
        assert p.line == 3 and p.stage == "t" and p.field == "devices" and text in p.message, p.format()


def test_nested_lists_from_python_get_the_same_checks():
    g = Graph()
    g.add("src", "TestSource")
    g.add("t", "TestPass", inputs=["src"], devices=[["cuda:0", 7]])  # type: ignore[list-item]
    assert [(p.stage, p.field) for p in validate(g, gpu_count=2)] == [("t", "devices")]
    g.stages[1].devices = [["cpu", "cpu"]]
    assert "runs each replica on one device" in validate(g)[0].message
    g.stages[1].type = "TargetForward"
    g.stages[1].config = {}  # the target and its layers are the model section's (checked by the application)
    assert validate(g) == []
