"""Typed telemetry, never rebuilt from strings: the composed metric names (``tau_h448``, ``accuracy_pos3``,
``trained-T0_7``) are made in one module, ``observe/names.py``, from typed records; no other module of the
run's telemetry (model/, stages/, observe/, app/) writes a piece of such a name or takes a metric name
apart (``rsplit``/``split``/``partition`` on one, a ``startswith``/``endswith`` test of a name prefix).

Parsed with ``ast`` (docstrings and comments are prose and may mention the names).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_flow"
CHECKED = ("model", "stages", "observe", "app")
NAMES_MODULE = PACKAGE / "observe" / "names.py"

# A piece of a composed name in a string literal (an f-string's constant parts included).
FRAGMENTS = re.compile(r"tau_h(?!<)|_h$|_h\{|accuracy_pos(?!<)|^-T|-T\d|^T$")  # "tau_h<H>" in a doc is prose
# Taking a name apart: the method called on a string, with an argument naming a composed piece.
SPLITTERS = {"rsplit", "split", "partition", "rpartition", "startswith", "endswith", "removeprefix",
             "removesuffix"}
PIECES = re.compile(r"^(_h|tau_h|accuracy_pos|accuracy|-T|T|-)$")


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def problems(source: str, where: str) -> list[str]:
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            if FRAGMENTS.search(node.value):
                found.append(f"{where}:{node.lineno}: composes a metric name ({node.value!r})")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in SPLITTERS
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
                and PIECES.match(node.args[0].value)):
            found.append(f"{where}:{node.lineno}: takes a metric name apart ({node.func.attr}({node.args[0].value!r}))")
    return found


def checked_files() -> list[Path]:
    return [p for layer in CHECKED for p in sorted((PACKAGE / layer).rglob("*.py")) if p != NAMES_MODULE]


def test_no_module_composes_or_parses_metric_names():
    found = [p for path in checked_files() for p in problems(path.read_text(encoding="utf-8"), path.relative_to(ROOT))]
    assert not found, "\n".join(found)


def test_the_check_catches_a_parse_and_a_composition():
    source = ('def f(name, h):\n    """tau_h448 in prose is fine."""\n'
              '    base, _, horizon = name.rpartition("_h")\n    return f"tau_h{h}"\n')
    found = problems(source, "sample.py")
    assert any("rpartition" in p for p in found) and any("sample.py:4" in p for p in found), found
    assert not any("sample.py:2" in p for p in found), found


def test_names_module_is_where_the_names_are_made():
    assert problems(NAMES_MODULE.read_text(encoding="utf-8"), "names.py"), "observe/names.py makes the names"
