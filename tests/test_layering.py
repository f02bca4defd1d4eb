"""The floors of docs/design.md, read from the code: who may import whom, and no import cycle.

`relicv2.jobs` imports no other package of the project; `shards` imports `jobs`; `models` (the networks and
their files) imports `jobs`; `saliency` and `pretrain` stand side by side on those three and never import
each other; `evaluation` may import `pretrain`, which never imports it; `cli` imports all and nothing
imports `cli` (but the namespace's `python -m relicv2`). Imports inside functions count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.paths import package_dirs

FLOORS = {
    "jobs": set(),
    "shards": {"jobs"},
    "models": {"jobs"},
    "saliency": {"jobs", "shards", "models"},
    "pretrain": {"jobs", "shards", "models"},
    "evaluation": {"jobs", "shards", "models", "pretrain"},
    "cli": {"jobs", "shards", "models", "saliency", "pretrain", "evaluation"},
}
ROOTS = {name.split(".")[1]: folder for name, folder in package_dirs().items() if name != "relicv2"}


def _module(package: str, path: Path) -> str:
    parts = path.relative_to(ROOTS[package]).with_suffix("").parts
    return ".".join(["relicv2", package, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def _is_module(name: str) -> bool:
    parts = name.split(".")
    if len(parts) < 2 or parts[0] != "relicv2" or parts[1] not in ROOTS:
        return False
    path = ROOTS[parts[1]].joinpath(*parts[2:])
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
    return {name for name in found if name == "relicv2" or name.startswith("relicv2.")}


def _graph() -> dict[str, set[str]]:
    return {_module(package, path): _imports(path) for package, root in ROOTS.items() for path in root.rglob("*.py")}


def _allowed(importer: str, imported: str) -> bool:
    package, target = importer.split(".")[1], imported.split(".")
    return len(target) > 1 and (target[1] == package or target[1] in FLOORS[package])


def test_every_package_has_its_floor():
    assert set(ROOTS) == set(FLOORS)


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


def test_the_namespace_root_imports_only_the_command():
    root = Path(package_dirs()["relicv2"])
    imported = {name for path in root.glob("*.py") for name in _imports(path)}
    assert imported <= {"relicv2.cli.main"}, imported


def test_the_checker_sees_a_forbidden_import():
    assert not _allowed("relicv2.saliency.network.weights", "relicv2.pretrain.checkpoint")
    assert not _allowed("relicv2.shards.reader", "relicv2.pretrain.views.loader")
    assert _allowed("relicv2.saliency.network.weights", "relicv2.models.checkpoint_file")
    assert not _allowed("relicv2.pretrain.run", "relicv2.evaluation.linear")
    assert not _allowed("relicv2.pretrain.run", "relicv2.saliency.batch")
    assert not _allowed("relicv2.models.resnet", "relicv2.pretrain.config")
    assert _allowed("relicv2.evaluation.linear", "relicv2.pretrain.distributed")
