"""The layer rule, as a test (in the spirit of SpecForge's tests/test_architecture).

Every module of ``dflash_flow`` is parsed with ``ast`` (nothing is imported), every import it makes --
at module level or inside a function, under ``TYPE_CHECKING`` or not -- is resolved to a module of the
package, and each edge is checked against ``RULES``: the one table of which layer may import which.
The same table is printed in docs/architecture.md (a test keeps the two equal).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "dflash_flow"

# layer -> layers it may import (itself implied). A layer is a subpackage or a top-level module.
# Bottom to top: util; core; items; data, model, observe; embedded; services; stages; app; cli.
RULES: dict[str, set[str]] = {
    "util": set(),
    "core": set(),
    "items": set(),
    "data": {"core", "items", "util"},
    "model": {"core", "items", "data", "util"},
    "observe": {"core", "items", "util"},
    "engine": {"core", "items", "data", "model", "util"},
    "embedded": {"core", "items", "data", "model", "engine", "util"},
    "services": {"core", "model", "observe"},
    "stages": {"core", "items", "data", "model", "observe", "engine", "embedded", "services", "util"},
    "app": {"core", "items", "data", "model", "observe", "engine", "embedded", "services", "stages", "util"},
    "cli": {"app", "core"},
    "__main__": {"cli"},
    "__init__": set(),
}

# Third-party packages that cost seconds to import: only inside functions, except in these layers, so that
# `dflash-flow --help`, `validate`, `graph` and `stages` never load them.
HEAVY = {"torch", "transformers", "mlflow", "matplotlib", "safetensors", "psutil", "tokenizers"}
HEAVY_AT_MODULE_LEVEL_OK = {"model"}
# ... and the one module of `model` that must stay light (the lock every model-building stage imports).
LIGHT_MODEL_MODULES = {"dflash_flow.model", "dflash_flow.model.spec",
                       "dflash_flow.model.facts"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path) -> list[tuple[str, int, bool, list[str]]]:
    """(imported module, line, at module level, names) for every import statement of the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    top = {id(n) for n in tree.body}
    # statements nested in module-level if/try blocks are still module level
    for node in tree.body:
        if isinstance(node, (ast.If, ast.Try)):
            top |= {id(n) for n in ast.walk(node)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                out.append((alias.name, node.lineno, id(node) in top, []))
        elif isinstance(node, ast.ImportFrom):
            target = node.module
            if node.level:
                target = _resolve_relative(module, is_package, node.level, node.module)
            names = [a.name for a in node.names]
            out.append((target, node.lineno, id(node) in top, names))
    return out


def internal_target(name: str, names: list[str], modules: dict[str, Path]) -> list[str]:
    """The package modules an import statement reaches (``from pkg import submodule`` counts)."""
    if not (name == "dflash_flow" or name.startswith("dflash_flow.")):
        return []
    hits = []
    for n in names:
        if f"{name}.{n}" in modules:
            hits.append(f"{name}.{n}")
    if not hits or len(hits) < len(names):
        hits.append(name)
    return hits


def edges() -> list[tuple[str, str, int, bool, list[str]]]:
    modules = all_modules()
    out = []
    for module, path in modules.items():
        for name, line, top, names in imports_of(module, path):
            for target in internal_target(name, names, modules):
                out.append((module, target, line, top, names))
    return out


def violations(rules: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, dst, line, _top, _names in edges():
        a, b = layer_of(src), layer_of(dst)
        if a == b:
            if a == "stages" and src != dst and dst not in ("dflash_flow.stages",):
                bad.append(f"{src}:{line} imports {dst}: a stage file imports no other stage file")
            continue
        if b not in rules[a]:
            bad.append(f"{src}:{line} imports {dst}: layer '{a}' may import only {sorted(rules[a]) or 'nothing'}")
    return bad


def test_every_module_is_in_a_layer():
    unknown = sorted({layer_of(m) for m in all_modules()} - set(RULES))
    assert not unknown, f"modules in no layer of RULES: {unknown}"


def test_no_forbidden_import_edge():
    bad = violations(RULES)
    assert not bad, "forbidden imports:\n" + "\n".join(bad)


def test_the_rule_check_catches_an_added_edge():
    """The check must be able to fail: forbid an edge that exists and it must be reported."""
    strict = {k: set(v) for k, v in RULES.items()}
    strict["stages"].discard("model")
    assert any("layer 'stages' may import only" in v for v in violations(strict))


def test_no_private_names_across_modules():
    bad = []
    for src, dst, line, _top, names in edges():
        if src == dst:
            continue
        private = [n for n in names if n.startswith("_") and not n.startswith("__") and f"{dst}.{n}" not in all_modules()]
        if private:
            bad.append(f"{src}:{line} imports private {private} from {dst}")
    assert not bad, "\n".join(bad)


def test_no_import_cycles_between_modules():
    """Imports form no cycle between modules, counting function-level and TYPE_CHECKING imports too (a
    deferred import that loops back is still a route that doubles back). A package's ``__init__``
    importing its own submodules is not a cycle."""
    graph: dict[str, set[str]] = {}
    for src, dst, _line, _top, _names in edges():
        if src != dst and not dst.startswith(src + "."):
            graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    cycles = []

    def visit(n: str, stack: list[str]) -> None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n, [])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_heavy_libraries_are_imported_lazily():
    bad = []
    for module, path in all_modules().items():
        layer = layer_of(module)
        heavy_ok = layer in HEAVY_AT_MODULE_LEVEL_OK and module not in LIGHT_MODEL_MODULES
        for name, line, top, _names in imports_of(module, path):
            root = name.split(".")[0] if name else ""
            if top and root in HEAVY and not heavy_ok:
                bad.append(f"{module}:{line} imports {name} at module level")
    assert not bad, "\n".join(bad)


def test_docs_show_the_same_rule_table():
    """docs/architecture.md prints RULES as a table `| layer | may import |`."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = dict(re.findall(r"^\| `([\w_]+)` \| ([^|]*) \|$", text, flags=re.M))
    documented = {k: {x.strip(" `") for x in v.split(",") if x.strip(" `") and x.strip() != "nothing"} for k, v in rows.items()}
    assert documented == RULES, "docs/architecture.md's rule table differs from tests/architecture/test_layers.py"


@pytest.mark.parametrize("command", [["--help"], ["stages"]])
def test_cli_start_imports_no_heavy_library(command):
    import subprocess
    import sys

    code = (
        f"import sys, runpy; sys.argv = ['dflash-flow', *{command!r}]\n"
        "try:\n    runpy.run_module('dflash_flow', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        f"print(sorted(m for m in {sorted(HEAVY)!r} if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
