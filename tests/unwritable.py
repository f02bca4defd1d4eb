"""Outputs a job cannot write, made for tests that run as root (where a chmod does not stop a write)."""

from __future__ import annotations

import contextlib
import resource
import shutil
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def immutable(folder: Path) -> Iterator[Path]:
    """`folder` with the immutable attribute for the block: nothing, root included, creates files in it."""
    if shutil.which("chattr") is None:
        pytest.skip("chattr is not installed")
    if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode != 0:
        pytest.skip(f"this file system does not take the immutable attribute ({folder})")
    try:
        yield folder
    finally:
        subprocess.run(["chattr", "-i", str(folder)], check=True)


def small_disk(limit: int):
    """A `preexec_fn` that lets the child write files of at most `limit` bytes (a full disk, as the job
    sees it: a write fails with EFBIG rather than ENOSPC, SIGXFSZ ignored)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply
