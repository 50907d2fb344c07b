"""The standard acceptance suites (gsm8k, math500, humaneval, mbpp, mt-bench: what z-lab's ``benchmark.py`` measures
a DFlash drafter on), read from a local copy of their published data (any format of ``formats.iter_rows``, or a
``.json`` array) with z-lab's prompt conventions (``SUITES``); nothing is downloaded. A file of another suite is
refused with the suite it looks like. Prompts are rendered with the tokenizer's chat template and generation
prompt, ``enable_thinking`` as asked (z-lab: off)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from .formats import iter_rows
from .reports import DataError

__all__ = ["MATH_SUFFIX", "SUITES", "Suite", "SuitePrompt", "parse_suite_args", "read_suite", "suite_named",
           "template_ids", "thinking_switch"]

#: z-lab's suffix of the math prompts (gsm8k, math500).
MATH_SUFFIX = "Please reason step by step, and put your final answer within \\boxed{}."
_HUMANEVAL = "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{}\n```"


@attrs.frozen
class Suite:
    """One suite: its name, what it is published as, the fields that identify one of its rows, and how a
    row becomes the user turns (``turns(row)``; one turn except for mt-bench)."""

    name: str
    published: str
    fields: tuple[str, ...]
    turns: Callable[[dict], tuple[str, ...]]
    id_field: str | None = None
    multi_turn: bool = False


def _text(row: dict, field: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"field '{field}' must be a non-empty string, got {_show(value)}")
    return value


def _mt_turns(row: dict) -> tuple[str, ...]:
    field = "prompt" if "prompt" in row else "turns"
    value = row.get(field)
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(t, str) and t.strip() for t in value):
        raise ValueError(f"field '{field}' must be a non-empty list of non-empty strings (the turns), got {_show(value)}")
    return tuple(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


SUITES: dict[str, Suite] = {s.name: s for s in (
    Suite("gsm8k", "openai/gsm8k (config main, split test)", ("question", "answer"),
          lambda r: (f"{_text(r, 'question')}\n{MATH_SUFFIX}",)),
    Suite("math500", "HuggingFaceH4/MATH-500 (split test)", ("problem",),
          lambda r: (f"{_text(r, 'problem')}\n{MATH_SUFFIX}",), id_field="unique_id"),
    Suite("humaneval", "openai/openai_humaneval (split test)", ("prompt", "entry_point"),
          lambda r: (_HUMANEVAL.format(_text(r, "prompt")),), id_field="task_id"),
    Suite("mbpp", "google-research-datasets/mbpp (config sanitized, split test)", ("prompt", "test_list"),
          lambda r: (_text(r, "prompt"),), id_field="task_id"),
    Suite("mt-bench", "HuggingFaceH4/mt_bench_prompts (split train) or FastChat's question.jsonl",
          ("prompt|turns",), _mt_turns, id_field="prompt_id|question_id", multi_turn=True),
)}


def suite_named(name: str) -> Suite:
    """The suite called ``name``; an unknown name raises ValueError listing the known ones."""
    suite = SUITES.get(name.strip().lower())
    if suite is None:
        raise ValueError(f"unknown suite {name!r}; known suites: {', '.join(SUITES)}")
    return suite


def parse_suite_args(values: Sequence[str]) -> list[tuple[Suite, Path]]:
    """``--suite NAME=PATH`` values, in order: each NAME known, each PATH existing, no suite twice.
    Raises ValueError with one line saying what is wrong."""
    out: list[tuple[Suite, Path]] = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--suite {value!r}: expected NAME=PATH, e.g. gsm8k=data/gsm8k/test.jsonl "
                             f"(known suites: {', '.join(SUITES)})")
        suite = suite_named(name)
        if any(s.name == suite.name for s, _ in out):
            raise ValueError(f"--suite {suite.name} given twice")
        p = Path(path.strip()).expanduser()
        if not p.exists():
            raise ValueError(f"--suite {suite.name}={path}: no such file or directory")
        out.append((suite, p))
    return out


@attrs.frozen
class SuitePrompt:
    """One prompt of a suite: the user turns, in order (z-lab's conventions applied), where it was read
    (``file:line N`` / ``file:row N``) and its id (the row's own, else its location)."""

    suite: str
    id: str
    turns: tuple[str, ...]
    where: str


def _has(row: dict, field: str) -> bool:
    return any(f in row for f in field.split("|"))


def _looks_like(row: dict, but_not: str) -> str:
    others = [s.name for s in SUITES.values() if s.name != but_not and all(_has(row, f) for f in s.fields)]
    if but_not == "mbpp" and "text" in row and "prompt" not in row:
        return " (mbpp's full config, whose description is 'text'; the mbpp suite is the sanitized config)"
    return f" (it looks like {' or '.join(others)})" if others else ""


def read_suite(suite: Suite | str, path: str | Path, *, limit: int | None = None) -> list[SuitePrompt]:
    """The first ``limit`` prompts (None: all) of ``suite`` from ``path``, in file order. A row without
    the suite's fields, or with a field of the wrong kind, raises ``DataError`` naming ``path:line`` (or
    row), the fields it has and, when it matches another suite, that suite."""
    suite = suite_named(suite) if isinstance(suite, str) else suite
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    path = Path(path)
    out: list[SuitePrompt] = []
    for where, row in iter_rows(path):
        place = f"{path}:{where.split()[-1]}" if where.startswith("line") else f"{path}: {where}"
        if not isinstance(row, dict):
            raise DataError(f"{place}: a {type(row).__name__}, expected an object (a {suite.name} record)")
        missing = [f.replace("|", "' or '") for f in suite.fields if not _has(row, f)]
        if missing:
            raise DataError(f"{place}: not a {suite.name} record ({suite.published}): no field '{missing[0]}'; "
                            f"fields are {sorted(row)}{_looks_like(row, suite.name)}")
        try:
            turns = suite.turns(row)
        except ValueError as exc:
            raise DataError(f"{place}: {exc}") from None
        rid = next((row[f] for f in (suite.id_field or "").split("|") if f and row.get(f) is not None), None)
        out.append(SuitePrompt(suite.name, str(rid) if rid is not None else where.replace(" ", ":"), turns, place))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise DataError(f"{path}: no {suite.name} records")
    return out


def template_ids(tokenizer: Any, messages: Sequence[dict], *, enable_thinking: bool | None,
                 add_generation_prompt: bool = True) -> list[int]:
    """``messages`` rendered with the tokenizer's chat template (and its generation prompt), as token ids, with
    the template's thinking switch set to ``enable_thinking`` (None: not passed; a template without one ignores it)."""
    switch = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True,
                                        **switch)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def thinking_switch(tokenizer: Any) -> bool:
    """Whether the chat template reads ``enable_thinking``: a probe conversation renders differently with
    it on and off (Qwen3's does; ChatML without a reasoning block does not)."""
    probe = [{"role": "user", "content": "2 + 2?"}]
    try:
        on = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, enable_thinking=True)
        off = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False, enable_thinking=False)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe has no switch we can read
        return False
    return on != off
