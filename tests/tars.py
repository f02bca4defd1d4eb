"""Hand-made tar files for tests: members exactly as given (names, order, bytes), nothing checked."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A plain (ustar) tar at `path` holding `members` (name, bytes) in order."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path
