"""The evaluation package imports as a tree: no module needs one that needs it back."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from relicv2 import evaluation

PACKAGE = Path(evaluation.__file__).parent


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> set[str]:
    """Modules of the package imported anywhere that runs (functions included; type-checking blocks,
    which only name types for annotations, left out)."""
    found: set[str] = set()
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("relicv2.evaluation"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("relicv2.evaluation"))
        found |= _imports(node)
    return found


def _graph() -> dict[str, set[str]]:
    modules = {f"relicv2.evaluation.{path.stem}": path for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    return {name: _imports(ast.parse(path.read_text())) & set(modules) for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of module names, or None."""
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for imported in sorted(graph[name]):
            if (cycle := visit(imported, [*path, name])) is not None:
                return cycle
        done.add(name)
        return None

    for name in sorted(graph):
        if (cycle := visit(name, [])) is not None:
            return cycle
    return None


def test_the_eval_package_has_no_import_cycle():
    graph = _graph()
    assert "relicv2.evaluation.supervised" in graph["relicv2.evaluation.linear"]  # the graph sees imports
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph) or [])}"
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]  # and finds one when there is


@pytest.mark.slow
def test_every_eval_module_imports_in_a_fresh_interpreter():
    names = sorted(_graph())
    done = subprocess.run([sys.executable, "-c", "; ".join(f"import {name}" for name in names)],
                          capture_output=True, text=True, cwd=PACKAGE.parent.parent)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]
