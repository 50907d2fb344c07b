"""A corpus of hostile inputs (tests/reliability/hostile/, one file per case): each must end in a clear
message and exit code 2 (or a counted, reported skip when the user chose `on_bad_record: skip`), never a
hang and never a bare traceback.

Pipeline files go through `dflash-flow validate`; data files through `dflash-flow run` of a small reading
pipeline (`read_tokens.yaml` / `read_chat.yaml`) pointed at them; checkpoints through `run --resume`.
The cases run through the real CLI entry point in subprocesses, batched (`batch_cli.py`: one process runs
many command lines, so the start-up cost is paid once per batch); every batch has a timeout.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from reltools import cli, cli_env

HERE = Path(__file__).resolve().parent
HOSTILE = HERE / "hostile"

# (file, expected exit code, expected substring of stderr)
PIPELINE_CASES = [
    ("yaml_syntax_error.yaml", 2, "yaml_syntax_error.yaml:5: invalid YAML: expected ',' or ']'"),
    ("yaml_python_object.yaml", 2, "YAML tags that build Python objects are not allowed"),
    ("yaml_python_name.yaml", 2, "YAML tags that build Python objects are not allowed"),
    ("yaml_not_a_mapping.yaml", 2, "a pipeline file must be a mapping with a 'stages' list"),
    ("yaml_empty.yaml", 2, "a pipeline file must be a mapping with a 'stages' list"),
    ("yaml_not_utf8.yaml", 2, "file is not UTF-8"),
    ("yaml_duplicate_key.yaml", 2, "duplicate key 'count'"),
    ("yaml_unknown_top_level.yaml", 2, "unknown top-level key 'stage'; did you mean 'stages'?"),
    ("wrong_type_replicas.yaml", 2, "'replicas' must be an integer, got 'two'"),
    ("wrong_type_config.yaml", 2, "field 'count': expected an integer, got str '12'"),
    ("unknown_field.yaml", 2, "unknown field 'cuont'; did you mean 'count'?"),
    ("unknown_stage_type.yaml", 2, "unknown stage type 'Rnage'; did you mean 'Range'?"),
    ("module_path_as_type.yaml", 2, "unknown stage type 'os:system'"),
    ("unknown_stage_key.yaml", 2, "unknown stage key 'replica'; did you mean 'replicas'?"),
    ("missing_input.yaml", 2, "missing input: stage type 'Delay' needs an input"),
    ("dangling_input.yaml", 2, "dangling input: no stage named 'sorce'; did you mean 'source'?"),
    ("cycle.yaml", 2, "cycle: "),
    ("self_input.yaml", 2, "a stage cannot be its own input"),
    ("type_mismatch.yaml", 2, "type mismatch: 'source' emits SampleTable but 'padder' (Padder) accepts PlannedBatch"),
    ("input_from_sink.yaml", 2, "stage 'sink' (Discard) has no output"),
    ("duplicate_names.yaml", 2, "duplicate stage name 'source'"),
    ("bad_stage_name.yaml", 2, "may contain only letters, digits, '_' and '-'"),
    ("bad_device.yaml", 2, "bad device 'tpu:0'"),
    ("missing_gpu.yaml", 2, "cuda:97"),
    ("capacity_zero.yaml", 2, "runtime.capacity must be >= 1, got 0"),
    ("stage_capacity_negative.yaml", 2, "capacity must be >= 1, got -3"),
    ("replicas_zero.yaml", 2, "replicas must be >= 1, got 0"),
    ("negative_budget.yaml", 2, "'max_tokens' must be >= 1: -4096"),
    ("budget_smaller_than_sample.yaml", 2, "max_tokens=512 is smaller than one sample"),
    ("absurd_negative_timeout.yaml", 2, "runtime.stall_timeout_s must be >= 0"),
    ("negative_seed.yaml", 2, "'seed' must be a non-negative integer, got -1"),
    ("singleton_replicas.yaml", 2, "runs once per process; replicas must be 1"),
    ("bad_policy.yaml", 2, "unknown fan-out policy 'random'"),
    ("bad_choice.yaml", 2, "expected one of 'truncate', 'drop', got str 'wrap'"),
    ("checkpoint_negative.yaml", 2, "'every_steps' must be >= 0: -10"),
    ("export_dir_traversal.yaml", 2, "export_dir must be a relative path inside output_dir"),
    ("export_dir_absolute.yaml", 2, "export_dir must be a relative path inside output_dir"),
    ("no_such_pipeline.yaml", 2, "file not found"),
    # Several devices per replica (a target split over GPUs): the nesting, its counts and the target's depth.
    ("devices_nested_mixed.yaml", 2, "devices_nested_mixed.yaml:5, stage 'work', field 'devices': 'devices' mixes device strings and lists"),
    ("devices_nested_one_device_stage.yaml", 2, "device list 0 has 2 devices, but stage type 'Delay' runs each replica on one device"),
    ("devices_nested_count.yaml", 2, "devices gives 2 device lists (one per replica) but the stage has 3 replica(s)"),
    ("devices_nested_shared.yaml", 2, "devices_nested_shared.yaml:14, stage 'target', field 'devices': device lists 0 and 1 both use cuda:1"),
    ("devices_nested_twice.yaml", 2, "device cuda:0 appears twice in device list 0"),
    ("target_layer_too_deep.yaml", 2, "field 'model.target_layer_ids': target layer 12 does not exist: the target has 8 decoder layers (ids 0-7)"),
    ("target_split_too_wide.yaml", 2, "a replica spans 3 devices but the target runs only 2 layer(s) (up to layer 1)"),
    # Bounded work (reliability issue): each of these once hung, recursed or crashed. They are also timed
    # one by one in test_bounded_inputs_answer_quickly.
    ("replicas_huge.yaml", 2, "replicas must be <= 1024 (each replica is a thread), got 1000000000"),
    ("replicas_total_huge.yaml", 2, "the stages ask for 5002 replicas in all; one process runs at most 4096"),
    ("capacity_huge.yaml", 2, "runtime.capacity must be <= 65536"),
    ("seed_huge.yaml", 2, "'seed' must be < 2**63"),
    ("yaml_complex_key.yaml", 2, "yaml_complex_key.yaml:3: a mapping key must be a plain value such as a name, not a list"),
    ("yaml_complex_key_config.yaml", 2, "yaml_complex_key_config.yaml:7: a mapping key must be a plain value such as a name, not a mapping"),
    ("yaml_recursive_stage.yaml", 2, "yaml_recursive_stage.yaml:4: alias '*stage' refers to a node that contains it"),
    ("yaml_recursive_list.yaml", 2, "yaml_recursive_list.yaml:5: alias '*t' refers to a node that contains it"),
    ("yaml_bad_date.yaml", 2, "yaml_bad_date.yaml:2: invalid YAML: cannot read this value: month must be in 1..12"),
    ("yaml_long_number.yaml", 2, "yaml_long_number.yaml:3: a number literal of 5000 characters (at most 100)"),
    ("yaml_control_char.yaml", 2, "yaml_control_char.yaml:2: invalid YAML: character #x0000 is not allowed"),
    ("pipeline_name_traversal.yaml", 2, "'name' '../../outside' names the run directory (runs/NAME by default)"),
    ("stage_name_too_long.yaml", 2, "has 5000 characters; at most 100"),
    ("runtime_huge_timeout.yaml", 2, "runtime.stall_timeout_s must be <= 1000000000 (seconds; longer waits overflow the clock), got 1e+20"),
    # NaN and infinity are refused for every float field (unless it declares cfg(finite=False)).
    ("nonfinite_lr.yaml", 2, "nonfinite_lr.yaml:9, stage 'drafter', field 'lr': expected a finite number, got float .inf"),
    ("nonfinite_gamma.yaml", 2, "field 'gamma': expected a finite number, got float .inf"),
    ("nonfinite_max_grad_norm.yaml", 2, "field 'max_grad_norm': expected a finite number, got float .inf"),
    ("nonfinite_weight_decay.yaml", 2, "field 'weight_decay': expected a finite number, got float .inf"),
    ("nonfinite_interval_s.yaml", 2, "stage 'monitor', field 'interval_s': expected a finite number, got float .inf"),
    ("nonfinite_length_jitter.yaml", 2, "field 'length_jitter': expected a finite number, got float .inf"),
    ("nonfinite_nan_bound.yaml", 2, "field 'warmup_ratio': expected a finite number, got float .nan"),
    ("runtime_nan_grace.yaml", 2, "runtime_nan_grace.yaml:3, field 'runtime.shutdown_grace_s': expected a finite number, got float .nan"),
    ("runtime_inf_grace.yaml", 2, "field 'runtime.shutdown_grace_s': expected a finite number, got float .inf"),
]

# (data file, reader pipeline, on_bad_record, expected code, expected substring)
DATA_CASES = [
    ("no_such_data.jsonl", "read_tokens.yaml", "fail", 2, "no_such_data.jsonl: no such file"),
    ("data_empty.jsonl", "read_tokens.yaml", "fail", 2, "data_empty.jsonl: file is empty"),
    ("data_truncated.jsonl", "read_tokens.yaml", "fail", 2, "data_truncated.jsonl:3: file ends inside this record"),
    ("data_not_utf8.jsonl", "read_tokens.yaml", "fail", 2, "data_not_utf8.jsonl:1: not valid UTF-8"),
    ("data_invalid_json.jsonl", "read_tokens.yaml", "fail", 2, "data_invalid_json.jsonl:2: invalid JSON"),
    ("data_missing_fields.jsonl", "read_tokens.yaml", "fail", 2, "data_missing_fields.jsonl:2: missing field 'loss_mask'"),
    ("data_ids_out_of_vocab.jsonl", "read_tokens.yaml", "fail", 2, "input_ids[2] = 700000 is outside the vocabulary [0, 512)"),
    ("chat_empty_conversations.jsonl", "read_chat.yaml", "fail", 2, "'conversations' must be a non-empty list"),
    ("chat_no_assistant.jsonl", "read_chat.yaml", "fail", 2, "no assistant turn with content: nothing to supervise"),
    # The user chose skip: the run goes on; the bad rows are counted and each is reported with file:line.
    ("data_bad_rows_skipped.jsonl", "read_tokens.yaml", "skip", 0, "2 samples from 4 records in 1 file(s), bad=2"),
    ("data_invalid_json.jsonl", "read_tokens.yaml", "skip", 0, "data_invalid_json.jsonl:2: invalid JSON"),
    # Ids the int32 store cannot hold are refused even with no vocab_size, never wrapped by the cast.
    ("data_ids_int32_overflow.jsonl", "read_tokens_novocab.yaml", "fail", 2,
     "data_ids_int32_overflow.jsonl:2: input_ids[1] = 2147483648 is not a token id (ids must be in [0, 2**31)"),
    ("data_ids_uint64.jsonl", "read_tokens_novocab.yaml", "fail", 2,
     "data_ids_uint64.jsonl:1: input_ids[0] = 18446744073709551615 is not a token id"),
    ("data_huge_number.jsonl", "read_tokens_novocab.yaml", "fail", 2,
     "data_huge_number.jsonl:2: invalid JSON: Exceeds the limit (4300 digits) for integer string conversion"),
]

# (checkpoint given to --resume, expected code, expected substring)
CHECKPOINT_CASES = [
    ("ckpt_other_config", 2, "checkpoint was written by another configuration"),
    ("ckpt_corrupted", 2, "model.safetensors is corrupted (checksum mismatch)"),
    ("ckpt_no_manifest", 2, "no checkpoint in"),
    ("ckpt_nonexistent", 2, "no checkpoint at"),
    # Malformed manifests and states: one line `not a valid checkpoint: PATH: why`, never a traceback.
    ("ckpt_manifest_list", 2, "ckpt_manifest_list/step-00000002: MANIFEST.json must be a JSON object of file name -> sha256, got list"),
    ("ckpt_manifest_empty", 2, "not a valid checkpoint: " + str(HOSTILE / "ckpt_manifest_empty/step-00000002") + ": MANIFEST.json lists no files"),
    ("ckpt_manifest_zero_bytes", 2, "ckpt_manifest_zero_bytes/step-00000002: MANIFEST.json is not valid JSON"),
    ("ckpt_manifest_traversal", 2, "MANIFEST.json names '../../../etc/hostname', not a file of the checkpoint directory"),
    ("ckpt_manifest_no_state", 2, "ckpt_manifest_no_state/step-00000002: MANIFEST.json does not list state.json"),
    ("ckpt_state_list", 2, "ckpt_state_list/step-00000002: state.json: must be a JSON object, got list"),
    ("ckpt_state_no_step", 2, "ckpt_state_no_step/step-00000002: state.json: has no 'step'"),
    ("ckpt_state_bad_step", 2, "state.json: 'step' must be a non-negative integer, got 'two'"),
    ("ckpt_state_bad_stage_states", 2, "state.json: 'stage_states.source' must be a list of objects (one per replica)"),
    ("ckpt_state_deep", 2, "ckpt_state_deep/step-00000002: state.json is not valid JSON (RecursionError"),
]


# -- bounded work: generated inputs (built at test time, not committed) and --set values -------------
_PIPE = "stages:\n  - {name: source, type: Range}\n  - {name: sink, type: Discard, inputs: [source]}\n"


def _alias_bomb() -> str:
    """Nine levels of nine aliases: 9**9 strings once expanded ("billion laughs")."""
    lines = ["a0: &a0 [" + ", ".join(['"lol"'] * 9) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return "\n".join(lines) + "\n" + _PIPE


def _merge_bomb() -> str:
    """The same through merge keys: each level merges the previous one nine times."""
    lines = ["m0: &m0 {a: 1, b: 2, c: 3}"]
    lines += [f"m{i}: &m{i} {{<<: [" + ", ".join([f"*m{i - 1}"] * 9) + "]}" for i in range(1, 10)]
    return "\n".join(lines) + "\n" + _PIPE


def _alias_depth() -> str:
    """Each level 10 deep, nine levels of aliases: 90 deep only once expanded."""
    lines = ["d0: &d0 " + "[" * 10 + "1" + "]" * 10]
    lines += [f"d{i}: &d{i} " + "[" * 10 + f"*d{i - 1}" + "]" * 10 for i in range(1, 10)]
    return "\n".join(lines) + "\n" + _PIPE


def _deep_block() -> str:
    """Block-style (indented) nesting inside a stage config."""
    return _PIPE.replace("type: Range}", "type: Range, config: {count: 1}}") + "x:\n" + "".join(
        "  " * (i + 1) + f"k{i}:\n" for i in range(200)
    )


def _long_chain() -> str:
    """2000 stages in a chain closed into a cycle (deeper than Python's recursion limit: validation must
    walk it without recursing)."""
    body = "".join(f"  - {{name: s{i}, type: Delay, inputs: [s{i - 1}]}}\n" for i in range(1, 2000))
    return "stages:\n  - {name: s0, type: Delay, inputs: [s1999]}\n" + body


GENERATED_CASES = [
    ("alias_bomb.yaml", _alias_bomb, 2, "alias_bomb.yaml:5: the document stands for more than 20000 values once its aliases are expanded"),
    ("merge_bomb.yaml", _merge_bomb, 2, "more than 20000 values once its aliases are expanded"),
    ("deep_list.yaml", lambda: "x: " + "[" * 5000 + "]" * 5000 + "\n" + _PIPE, 2, "deep_list.yaml:1: lists and mappings nest deeper than 64 levels"),
    ("deep_mapping.yaml", lambda: "x: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n" + _PIPE, 2, "deep_mapping.yaml:1: lists and mappings nest deeper than 64 levels"),
    ("deep_block.yaml", _deep_block, 2, "lists and mappings nest deeper than 64 levels"),
    ("deep_by_alias.yaml", _alias_depth, 2, "deep_by_alias.yaml:7: lists and mappings nest deeper than 64 levels"),
    ("big_file.yaml", lambda: _PIPE + "# " + "x" * (300 * 1024) + "\n", 2, "the file is larger than 256 KiB"),
    ("many_values.yaml", lambda: "x: [" + ",".join(["1"] * 120_000) + "]\n" + _PIPE, 2, "many_values.yaml:1: the document stands for more than 20000 values (lists, mappings and scalars)"),
    ("base60_number.yaml", lambda: "seed: 1" + ":00" * 60_000 + "\n" + _PIPE, 2, "a number literal of 180001 characters"),
    ("long_chain.yaml", _long_chain, 2, "cycle: s1 -> s2 -> s3 -> ... -> s1999 -> s0 -> s1 (2000 stages)"),
]

# --set values get the file's loader and limits (they used to pass `validate` and crash `run`).
SET_BASE = "read_tokens.yaml"
SET_CASES = [
    ("stages.source.template=&a [*a]", 2, "--set stages.source.template: alias '*a' refers to a node that contains it"),
    ("stages.source.template=" + "[" * 5000 + "]" * 5000, 2, "--set stages.source.template: lists and mappings nest deeper than 64 levels"),
    ("stages.source.template={" + ", ".join([f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]).replace("*a0", "x") + "}",
     2, "more than 20000 values once its aliases are expanded"),
    (".".join(["k"] * 100) + "=1", 2, "a path of 100 keys (at most 64)"),
    ("stages.source.template={? [a, b]: 1}", 2, "a mapping key must be a plain value such as a name, not a list"),
    ("runtime.drain_timeout_s=.nan", 2, "field 'runtime.drain_timeout_s': expected a finite number, got float .nan"),
    ("stages.sink.replicas=1000000000", 2, "replicas must be <= 1024"),
]


def test_corpus_has_at_least_30_cases_and_every_file_is_used():
    cases = len(PIPELINE_CASES) + len(DATA_CASES) + len(CHECKPOINT_CASES)
    assert cases >= 30
    used = {c[0] for c in PIPELINE_CASES} | {c[0] for c in DATA_CASES} | {c[1] for c in DATA_CASES}
    used |= {c[0] for c in CHECKPOINT_CASES}
    on_disk = {p.name for p in HOSTILE.iterdir()}
    assert on_disk - used == set(), f"corpus files without a case: {sorted(on_disk - used)}"


def _commands(tmp_path: Path) -> list[tuple[str, list[str], int, str]]:
    from dflash_flow.embedded import embedded_target_path

    tokenizer = embedded_target_path()
    cmds = []
    for name, code, text in PIPELINE_CASES:
        cmds.append((name, ["validate", HOSTILE / name], code, text))
    for i, (name, reader, mode, code, text) in enumerate(DATA_CASES):
        args = ["run", HOSTILE / reader, "--set", f"stages.source.paths=[{HOSTILE / name}]",
                "--set", f"stages.source.on_bad_record={mode}", "--set", f"output_dir={tmp_path / f'data{i}'}"]
        if reader == "read_chat.yaml":
            args += ["--set", f"model.tokenizer={tokenizer}"]
        cmds.append((f"{name} ({mode})", args, code, text))
    for i, (name, code, text) in enumerate(CHECKPOINT_CASES):
        args = ["run", HOSTILE / "read_tokens.yaml", "--set", f"stages.source.paths=[{HOSTILE / 'data_bad_rows_skipped.jsonl'}]",
                "--set", f"output_dir={tmp_path / f'ckpt{i}'}", "--resume", HOSTILE / name]
        cmds.append((f"--resume {name}", args, code, text))
    return cmds


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_every_hostile_input_gets_a_clear_message_and_the_right_exit_code(tmp_path):
    cmds = _commands(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    # Two batches side by side: the light `validate` cases and the `run` cases.
    batches = [[c for c in cmds if c[1][0] == "validate"], [c for c in cmds if c[1][0] != "validate"]]

    def run_batch(i: int) -> list[dict]:
        spec, out = tmp_path / f"batch{i}.json", tmp_path / f"results{i}.json"
        spec.write_text(json.dumps([[str(a) for a in c[1]] for c in batches[i]]))
        proc = subprocess.run([sys.executable, str(HERE / "batch_cli.py"), str(spec), str(out)], cwd=cwd,
                              env=cli_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(out.read_text())

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = [r for batch in pool.map(run_batch, range(len(batches))) for r in batch]
    ordered = [c for batch in batches for c in batch]
    failures = []
    for (label, _args, code, text), res in zip(ordered, results, strict=True):
        problems = []
        if res["code"] != code:
            problems.append(f"exit {res['code']} != {code}")
        if text not in res["stderr"]:
            problems.append(f"message lacks {text!r}")
        if "Traceback" in res["stderr"] or "Traceback" in res["stdout"]:
            problems.append("traceback printed")
        if res["wall_s"] >= HANG_BOUND_S:  # a hang bound (the first case of a batch also pays the imports)
            problems.append(f"took {res['wall_s']:.1f} s")
        if problems:
            failures.append(f"{label}: {'; '.join(problems)}\n    stderr: {res['stderr'].strip()[-600:]}")
    assert not failures, "\n".join(failures)
    # The real CLI in its own process, once, as users run it (the batches call the same entry point).
    res = cli(["validate", HOSTILE / "yaml_python_object.yaml"], cwd=cwd, timeout=60)
    assert res.returncode == 2 and "YAML tags that build Python objects are not allowed" in res.stderr
    assert "Traceback" not in res.stderr
    # Nothing was executed by the YAML tags, and nothing was written where the processes ran.
    assert list(cwd.iterdir()) == []
    # The corrupted checkpoint was reported, not repaired or removed.
    assert (HOSTILE / "ckpt_corrupted" / "step-00000002" / "model.safetensors").is_file()


HANG_BOUND_S = 60.0  # a generous bound on purpose: it detects hangs, it does not measure speed


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bounded_inputs_answer_quickly(tmp_path):
    """Bombs, deep nestings, huge counts and big files end in exit 2 with one located message, no
    traceback, each well under HANG_BOUND_S through the real CLI in its own process."""
    cases = []
    for name, build, code, text in GENERATED_CASES:
        (tmp_path / name).write_text(build())
        cases.append((name, ["validate", tmp_path / name], code, text))
    start = PIPELINE_CASES.index(next(c for c in PIPELINE_CASES if c[0] == "replicas_huge.yaml"))
    cases += [(name, ["validate", HOSTILE / name], code, text) for name, code, text in PIPELINE_CASES[start:]]
    cases += [(f"--set {value[:40]}", ["validate", HOSTILE / SET_BASE, "--set", value], code, text)
              for value, code, text in SET_CASES]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    failures = []
    for label, args, code, text in cases:
        t0 = time.perf_counter()
        res = cli(args, cwd=cwd, timeout=60)
        wall = time.perf_counter() - t0
        problems = []
        if res.returncode != code:
            problems.append(f"exit {res.returncode} != {code}")
        if text not in res.stderr:
            problems.append(f"message lacks {text!r}")
        if "Traceback" in res.stderr or "Traceback" in res.stdout:
            problems.append("traceback printed")
        if wall >= HANG_BOUND_S:
            problems.append(f"took {wall:.1f} s")
        if problems:
            failures.append(f"{label}: {'; '.join(problems)}\n    stderr: {res.stderr.strip()[-600:]}")
    assert not failures, "\n".join(failures)
