"""Where the tests find the repository and the team's shared real images (absent in a user's clone)."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
# RELICV2_SHARED_DATA points elsewhere (e.g. from a git worktree that is not beside shared/).
SHARED_DATA = Path(os.environ.get("RELICV2_SHARED_DATA", REPO.parent / "shared" / "data"))
CONFIGS = REPO / "pretrain" / "presets"  # the pretraining presets shipped in the package


def setuptools_table() -> dict:
    """`pyproject.toml`'s [tool.setuptools]: the one owner of the installed layout."""
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]


def package_dirs() -> dict[str, Path]:
    """The installed packages' folders (the package-dir mapping)."""
    return {name: REPO / folder for name, folder in setuptools_table()["package-dir"].items()}


def load_benchmark(name: str) -> ModuleType:
    """`benchmarks/NAME.py` imported as module NAME (registered first: its dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
