"""Sample keys and tar member names from untrusted shards, made safe before they name a file.

A shard made by someone else may hold members named ``/etc/x.jpg`` or ``../../x.jpg``; every
place that turns a key, a member name or a manifest field into a path goes through
:func:`safe_relative_path` (docs/design.md "Keys and member names from any tar are untrusted").
"""

from __future__ import annotations

import re
import tarfile
from pathlib import Path

# A control character or a backslash (a Windows separator that would mean something else elsewhere).
_FORBIDDEN = re.compile(r"[\x00-\x1f\\]")


class UnsafeKeyError(ValueError):
    """A key or member name that would name a file outside its folder (or no file at all)."""


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative name (non-empty, relative, no ``..``, ``.`` or empty
    component, no control character or backslash), else raise :class:`UnsafeKeyError` saying why."""
    if not isinstance(key, str) or not key:
        raise UnsafeKeyError("empty key")
    if _FORBIDDEN.search(key):
        raise UnsafeKeyError(f"key {key!r} holds a control character or a backslash")
    if key.startswith("/"):
        raise UnsafeKeyError(f"key {key!r} is an absolute path")
    parts = key.split("/")
    if "" in parts or "." in parts or ".." in parts:
        raise UnsafeKeyError(f"key {key!r} has an empty, '.' or '..' component")
    return key


def safe_relative_path(root: Path, key: str, suffix: str = "") -> Path:
    """``root / (key + suffix)``, after :func:`check_key`; the result is always inside ``root``."""
    check_key(key)
    if suffix and ("/" in suffix or "\0" in suffix):
        raise UnsafeKeyError(f"suffix {suffix!r} must be a plain extension")
    root = Path(root)
    path = root / (key + suffix)
    # Belt and braces: the checks above already exclude every way out of root.
    if not path.resolve(strict=False).is_relative_to(root.resolve(strict=False)):
        raise UnsafeKeyError(f"key {key!r} resolves outside {root}")
    return path


def member_refusal(member: tarfile.TarInfo) -> str | None:
    """Why a tar member must not be read (a link, a device, a fifo, an unsafe name), or None."""
    if member.issym() or member.islnk():
        return f"member {member.name!r} is a link"
    if not (member.isfile() or member.isdir()):
        return f"member {member.name!r} is not a regular file"
    try:
        check_key(member.name)
    except UnsafeKeyError as exc:
        return str(exc)
    return None
