"""One job per output folder: an exclusive lock file (`.relicv2.lock`, created with O_EXCL, naming its
holder) taken before anything in the folder is read; a lock left by a dead process on this host is taken
over with a note. Not `fcntl`: its locks do not hold across the nodes of a shared file system (NFS,
Lustre) and vanish silently on some of them, and a file is visible to a person listing the folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".relicv2.lock"


class FolderLockedError(RuntimeError):
    """Another live job holds the output folder."""


@dataclass(frozen=True)
class LockHolder:
    host: str
    pid: int
    started: float
    job: str

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"{self.job!r} (host {self.host}, pid {self.pid}, started {when})"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a zombie counts: its parent has not reaped it yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _read_holder(path: Path) -> LockHolder | None:
    """The holder written in a lock file, or None when the file is gone or unreadable."""
    try:
        data = json.loads(path.read_text())
        return LockHolder(str(data["host"]), int(data["pid"]), float(data["started"]), str(data["job"]))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        # Half-written by a process killed between create and write: treat as stale only if old.
        return LockHolder("?", -1, path.stat().st_mtime if path.exists() else 0.0, "unknown")


def acquire(folder: Path, job: str) -> Path:
    """Take the lock of ``folder`` (created if missing) for ``job``; return the lock path. Raises
    :class:`FolderLockedError` when a live job holds it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_NAME
    me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(), "job": job}
    for _ in range(3):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            holder = _read_holder(path)
            if holder is None:
                continue  # released between our open and read: try again
            stale_unknown = holder.pid == -1 and time.time() - holder.started > 60
            if stale_unknown or (holder.host == me["host"] and not pid_alive(holder.pid)):
                print(f"note: taking over the lock of {folder} left by {holder.describe()}, "
                      "which is no longer running", file=sys.stderr)
                path.unlink(missing_ok=True)
                continue
            raise FolderLockedError(
                f"{folder} is in use by {holder.describe()}; wait for that job to finish or stop it, "
                f"or choose another output folder (if you are sure no job is running, delete {path})"
            ) from None
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return path
    raise FolderLockedError(f"could not take the lock {path}: it keeps changing; is another job starting?")


def release(path: Path) -> None:
    """Remove a lock this process holds (a lock another process holds is left alone)."""
    holder = _read_holder(path)
    if holder is not None and holder.pid == os.getpid() and holder.host == socket.gethostname():
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def folder_lock(folder: Path, job: str, *, enabled: bool = True) -> Iterator[None]:
    """Hold the lock of ``folder`` for the life of the block (``enabled=False``: a no-op, for ranks > 0)."""
    path = acquire(folder, job) if enabled else None
    try:
        yield
    finally:
        if path is not None:
            release(path)
