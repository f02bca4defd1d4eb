"""The module boundaries of docs/design.md, read from the code: who may import whom, and no import cycle.

`jobs` imports no other package of the project; `shards` imports `jobs` only; `pretrain` imports `shards`
and `jobs`; `saliency` imports those and, of `pretrain`, only its model package (the ResNet and the leaf that
reads untrusted weight and checkpoint files); nothing imports `cli`. Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import REPO

PACKAGES = ("jobs", "shards", "pretrain", "saliency", "cli")
ALLOWED = {
    "jobs": set(),
    "shards": {"jobs"},
    "pretrain": {"jobs", "shards"},
    "saliency": {"jobs", "shards", "pretrain.model"},
    "cli": {"jobs", "shards", "pretrain", "saliency"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    path = REPO.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _imports(path: Path) -> set[str]:
    """The project modules `path` imports (absolute imports; the project uses no relative ones);
    `from package import module` counts as importing that module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names}
            found |= {name for name in submodules if _is_module(name)} or {node.module}
    return {name for name in found if name.split(".")[0] in PACKAGES}


def _graph() -> dict[str, set[str]]:
    return {_module(path): _imports(path) for package in PACKAGES for path in (REPO / package).rglob("*.py")}


def _allowed(importer: str, imported: str) -> bool:
    package = importer.split(".")[0]
    if imported.split(".")[0] == package:
        return True
    return any(imported == target or imported.startswith(target + ".") for target in ALLOWED[package])


def test_every_import_follows_the_design():
    wrong = sorted(f"{importer} imports {imported}" for importer, imported_set in _graph().items()
                   for imported in imported_set if not _allowed(importer, imported))
    assert not wrong, "imports the design does not allow:\n" + "\n".join(wrong)


def test_no_import_cycle_between_modules():
    graph = _graph()
    modules = set(graph)
    # An import of a package counts as an import of its __init__ module; of a name's module otherwise.
    edges = {m: {i for i in imported if i in modules and i != m} for m, imported in graph.items()}
    seen: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        seen[module] = 1
        for target in sorted(edges[module]):
            if seen.get(target) == 1:
                return [*path[path.index(target):], target] if target in path else [module, target]
            if target not in seen:
                cycle = visit(target, [*path, target])
                if cycle:
                    return cycle
        seen[module] = 2
        return None

    for module in sorted(modules):
        if module not in seen:
            cycle = visit(module, [module])
            assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_a_forbidden_import():
    assert not _allowed("saliency.network.weights", "pretrain.checkpoint")
    assert not _allowed("shards.reader", "pretrain.views.sources")
    assert _allowed("saliency.network.weights", "pretrain.model.checkpoint_file")
