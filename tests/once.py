"""Work that a costly module fixture does once per test session, shared by pytest-xdist's workers."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from filelock import FileLock


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, filled by `build(folder)` in the first worker that asks and read by the others.

    Under xdist every worker runs a module fixture on its own, so a fixture whose tests landed on two
    workers ran twice; the lock (filelock, as pytest-xdist's documentation does it) makes the second wait
    for the first's folder. The tests that use it must only read it.
    """
    base = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        base = base.parent  # this session's folder, above each worker's own (one process: its own already)
    folder = base / name
    with FileLock(f"{folder}.lock"):
        done = folder / ".built"
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
            build(folder)
            done.touch()
    return folder
