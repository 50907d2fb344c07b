"""The standard suites read from records written here in their published formats (no download): the
fields each publisher uses, z-lab's prompt conventions, every file kind, and the errors a wrong file gets."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from golden_cases import write_datasets_dir

from dflash_flow.data.reports import DataError
from dflash_flow.data.suites import (
    MATH_SUFFIX,
    SUITES,
    parse_suite_args,
    read_suite,
    suite_named,
    template_ids,
    thinking_switch,
)

# Rows shaped as each suite's publisher ships them (field names and kinds; the texts are ours).
GSM8K = [{"question": "Ann has 3 pens and buys 4 more. How many pens?", "answer": "3 + 4 = 7\n#### 7"},
         {"question": "A box holds 6 eggs. How many in 5 boxes?", "answer": "6 * 5 = 30\n#### 30"}]
MATH500 = [{"problem": "What is $1 + 1$?", "solution": "It is $2$.", "answer": "2", "subject": "Prealgebra",
            "level": 1, "unique_id": "test/prealgebra/1.json"}]
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
              "canonical_solution": "    return a + b\n", "test": "def check(f):\n    assert f(1, 2) == 3\n",
              "entry_point": "add"}]
MBPP_SANITIZED = [{"source_file": "Benchmark Questions Verification V2.ipynb", "task_id": 2,
                   "prompt": "Write a function to find the shared elements from the given two lists.",
                   "code": "def similar_elements(a, b):\n    return tuple(set(a) & set(b))",
                   "test_imports": [], "test_list": ["assert similar_elements((1, 2), (2, 3)) == (2,)"]},
                  {"source_file": "Mike's Copy of Benchmark Questions Verification V2.ipynb", "task_id": 3,
                   "prompt": "Write a python function to identify non-prime numbers.",
                   "code": "def is_not_prime(n):\n    return n < 2", "test_imports": ["import math"],
                   "test_list": ["assert is_not_prime(1)"]}]
MBPP_FULL = [{"task_id": 601, "text": "Write a function to find the longest chain.", "code": "pass",
              "test_list": ["assert True"], "test_setup_code": "", "challenge_test_list": []}]
MT_BENCH_HF = [{"prompt": ["Compose a travel blog post about Hawaii.", "Rewrite it starting every sentence with A."],
                "prompt_id": 81, "category": "writing", "reference": []}]
MT_BENCH_FASTCHAT = [{"question_id": 101, "category": "reasoning",
                      "turns": ["You pass the second person in a race. Where are you?", "And if you pass the last?"]}]


def write_jsonl(path: Path, rows: list[dict], *, gz: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in rows)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_gsm8k_parquet_gets_the_math_suffix(tmp_path):
    prompts = read_suite("gsm8k", write_parquet(tmp_path / "test-00000-of-00001.parquet", GSM8K))
    assert [p.turns for p in prompts] == [(f"{r['question']}\n{MATH_SUFFIX}",) for r in GSM8K]
    assert MATH_SUFFIX == "Please reason step by step, and put your final answer within \\boxed{}."
    assert prompts[1].id == "row:2" and prompts[1].where.endswith(": row 2")  # gsm8k rows carry no id


def test_math500_jsonl_uses_problem_and_unique_id(tmp_path):
    (p,) = read_suite("math500", write_jsonl(tmp_path / "test.jsonl", MATH500))
    assert p.turns == (f"What is $1 + 1$?\n{MATH_SUFFIX}",) and p.id == "test/prealgebra/1.json"
    assert p.where == f"{tmp_path / 'test.jsonl'}:1"


def test_humaneval_gz_and_parquet_wrap_the_code_as_z_lab_does(tmp_path):
    want = ("Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            + HUMANEVAL[0]["prompt"] + "\n```",)
    from_gz = read_suite("humaneval", write_jsonl(tmp_path / "HumanEval.jsonl.gz", HUMANEVAL, gz=True))
    from_pq = read_suite("humaneval", write_parquet(tmp_path / "he.parquet", HUMANEVAL))
    assert [p.turns for p in from_gz] == [p.turns for p in from_pq] == [want]
    assert from_gz[0].id == "HumanEval/0"


def test_mbpp_sanitized_json_array_and_datasets_directory(tmp_path):
    array = tmp_path / "sanitized-mbpp.json"
    array.write_text(json.dumps(MBPP_SANITIZED, indent=2))  # google-research's original file: one JSON array
    from_array = read_suite("mbpp", array)
    from_dir = read_suite("mbpp", write_datasets_dir(tmp_path / "mbpp-test", pa.Table.from_pylist(MBPP_SANITIZED)))
    assert [p.turns for p in from_array] == [p.turns for p in from_dir] == [(r["prompt"],) for r in MBPP_SANITIZED]
    assert [p.id for p in from_dir] == ["2", "3"] and from_array[1].where.endswith("item 2")


def test_mt_bench_both_publications_keep_every_turn(tmp_path):
    (hf,) = read_suite("mt-bench", write_parquet(tmp_path / "mt.parquet", MT_BENCH_HF))
    (fc,) = read_suite("MT-Bench", write_jsonl(tmp_path / "question.jsonl", MT_BENCH_FASTCHAT))
    assert hf.turns == tuple(MT_BENCH_HF[0]["prompt"]) and hf.id == "81"
    assert fc.turns == tuple(MT_BENCH_FASTCHAT[0]["turns"]) and fc.id == "101"
    assert SUITES["mt-bench"].multi_turn and not SUITES["gsm8k"].multi_turn


def test_limit_takes_the_first_rows_in_file_order(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K * 3)
    assert [p.where.rsplit(":", 1)[1] for p in read_suite("gsm8k", path, limit=4)] == ["1", "2", "3", "4"]
    with pytest.raises(ValueError, match="limit must be at least 1"):
        read_suite("gsm8k", path, limit=0)


def test_a_file_of_another_suite_is_named(tmp_path):
    gsm = write_jsonl(tmp_path / "gsm.jsonl", GSM8K)
    with pytest.raises(DataError, match=r"gsm\.jsonl:1: not a math500 record .*no field 'problem'.*looks like gsm8k"):
        read_suite("math500", gsm)
    he = write_jsonl(tmp_path / "he.jsonl", HUMANEVAL)
    with pytest.raises(DataError, match=r"not a mbpp record .*no field 'test_list'.*looks like humaneval"):
        read_suite("mbpp", he)
    full = write_jsonl(tmp_path / "mbpp-full.jsonl", MBPP_FULL)
    with pytest.raises(DataError, match="mbpp's full config, whose description is 'text'"):
        read_suite("mbpp", full)
    with pytest.raises(DataError, match="no field 'prompt' or 'turns'"):
        read_suite("mt-bench", gsm)


def test_bad_rows_name_the_file_and_line(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(GSM8K[0]) + "\n{not json\n")
    with pytest.raises(DataError, match=r"broken\.jsonl:2: invalid JSON"):
        read_suite("gsm8k", broken)
    empty_q = write_jsonl(tmp_path / "e.jsonl", [GSM8K[0], {"question": "  ", "answer": "x"}])
    with pytest.raises(DataError, match=r"e\.jsonl:2: field 'question' must be a non-empty string"):
        read_suite("gsm8k", empty_q)
    one_turn = write_jsonl(tmp_path / "mt.jsonl", [{"question_id": 1, "turns": "just a string"}])
    with pytest.raises(DataError, match="must be a non-empty list of non-empty strings"):
        read_suite("mt-bench", one_turn)
    with pytest.raises(DataError, match="no such file"):
        read_suite("gsm8k", tmp_path / "missing.jsonl")


def test_unknown_suite_names_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match="unknown suite 'gsm9k'; known suites: gsm8k, math500, humaneval, mbpp, mt-bench"):
        suite_named("gsm9k")
    path = write_jsonl(tmp_path / "g.jsonl", GSM8K)
    assert [(s.name, p) for s, p in parse_suite_args([f"gsm8k={path}"])] == [("gsm8k", path)]
    for bad, msg in ((["gsm8k"], "expected NAME=PATH"), ([f"humaneval2={path}"], "known suites"),
                     ([f"gsm8k={path}", f"GSM8K={path}"], "given twice"),
                     ([f"gsm8k={tmp_path / 'nope.jsonl'}"], "no such file or directory")):
        with pytest.raises(ValueError, match=msg):
            parse_suite_args(bad)


def test_the_thinking_switch_is_read_and_recorded(chatml_tokenizer, qwen3_tokenizer):
    turns = [{"role": "user", "content": "2 + 3?"}]
    assert thinking_switch(qwen3_tokenizer) is True and thinking_switch(chatml_tokenizer) is False
    on = template_ids(qwen3_tokenizer, turns, enable_thinking=True)
    off = template_ids(qwen3_tokenizer, turns, enable_thinking=False)
    assert on != off and qwen3_tokenizer.decode(off).rstrip().endswith("</think>")  # the empty think block
    assert template_ids(chatml_tokenizer, turns, enable_thinking=True) == template_ids(chatml_tokenizer, turns,
                                                                                        enable_thinking=False)
