"""The installed relicv2 version: the one answer for info.json, checkpoints and reports."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    """The installed relicv2 version, or "unknown" when run from a source tree that is not installed."""
    try:
        return metadata.version("relicv2")
    except metadata.PackageNotFoundError:
        return "unknown"
