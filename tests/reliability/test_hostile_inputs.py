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
    ("type_mismatch.yaml", 2, "type mismatch: 'source' emits Sample but 'padder' (Padder) accepts PlannedBatch"),
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
]

# (checkpoint given to --resume, expected code, expected substring)
CHECKPOINT_CASES = [
    ("ckpt_other_config", 2, "checkpoint was written by another configuration"),
    ("ckpt_corrupted", 2, "model.safetensors is corrupted (checksum mismatch)"),
    ("ckpt_no_manifest", 2, "no checkpoint in"),
    ("ckpt_nonexistent", 2, "no checkpoint at"),
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
            args += ["--set", f"stages.source.tokenizer={tokenizer}"]
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
