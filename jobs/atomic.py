"""Atomic file output: write to a hidden temporary name, fsync, rename over the final name. Every job may be
killed at any moment (docs/design.md), so a final name must only ever hold a complete file; a temporary name
starts with "." so directory listings of shards ignore it."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path


class OutputError(ValueError):
    """An output path a job cannot write; its message names the path and the option that gave it."""


TEMP_MARK = ".tmp-"


def temp_path_for(path: Path) -> Path:
    """A hidden temporary name beside `path`, unique per process and host (ranks share a file system)."""
    return path.with_name(f".{path.name}{TEMP_MARK}{socket.gethostname()}-{os.getpid()}")


def fsync_dir(directory: Path) -> None:
    """Make a rename inside `directory` durable (POSIX needs the directory itself synced)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_output(path: Path) -> Iterator[Path]:
    """Yield a temporary path to write; on success fsync it and rename it to `path`, on an exception
    remove it (`path` untouched)."""
    path = Path(path)
    tmp = temp_path_for(path)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)


def remove_stale_temps(directory: Path, names: set[str] | Callable[[str], bool] | None = None, *,
                       recursive: bool = False, older_suffix: str | None = None) -> int:
    """Delete temporary files left by killed writers for the final names in `names` (a set, or a test of the
    final name; None: all), in the folders below `directory` too when `recursive` (links not followed), and
    hidden files ending in `older_suffix` (an earlier writer's temporaries); the count. Call it only while
    holding the folder's lock (jobs.lock), and under torchrun only for the caller's own final names: other
    ranks may be writing other files in the same folder."""
    removed = 0
    folders = (Path(d) for d, _, _ in os.walk(directory)) if recursive else [Path(directory)]
    for folder in folders:
        for p in folder.glob(".*"):
            if TEMP_MARK in p.name:
                final = p.name[1 : p.name.index(TEMP_MARK)]
                stale = names is None or (names(final) if callable(names) else final in names)
            else:
                stale = older_suffix is not None and p.name.endswith(older_suffix)
            if stale:
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    removed += 1
    return removed
