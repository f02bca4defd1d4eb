"""DALI index files (`wds2idx` format v1.2) for WebDataset tars.

Hand-written rather than calling DALI's `wds2idx` script: that script shells out to GNU tar and is
not importable as a library, while Python's tarfile gives each member's exact data offset directly.
Format: a first line `v1.2 <samples>`, then one line per sample listing, for each member,
`<extension> <data offset> <size> <member name>`; members of a sample are adjacent in the tar.
"""

from __future__ import annotations

import tarfile
from collections.abc import Sequence
from pathlib import Path

from shards.atomic import atomic_write_bytes

INDEX_VERSION = "v1.2"


def index_path(tar: Path) -> Path:
    """The DALI index file beside a tar: `images-000000.tar` -> `images-000000.idx`."""
    return Path(tar).with_suffix(".idx")


def split_member_name(name: str) -> tuple[str, str]:
    """Split a member name into (key, extension) at the first dot of its base name, as DALI does."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def index_text(tar: Path) -> str:
    """The index of `tar` as text; raises ValueError naming the file when it is not a readable tar."""
    samples: list[list[str]] = []
    last_key = None
    try:
        with tarfile.open(tar, "r:") as archive:
            for member in archive:
                if not member.isreg():
                    continue
                key, ext = split_member_name(member.name)
                if not key or key.endswith("/"):
                    continue  # hidden files, skipped by DALI's own indexer too
                entry = (ext, member.offset_data, member.size, member.name)
                if key != last_key:
                    samples.append([entry])
                    last_key = key
                else:
                    samples[-1].append(entry)
    except (tarfile.TarError, OSError) as exc:
        raise ValueError(f"{tar} is not a readable tar file ({exc}); rebuild the shard") from exc
    return format_index(samples)


def format_index(samples: Sequence[Sequence[tuple[str, int, int, str]]]) -> str:
    """Index text for per-sample lists of (extension, offset, size, name), as `read_index` returns them."""
    lines = [f"{INDEX_VERSION} {len(samples)}"]
    lines += [" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in sample) for sample in samples]
    return "\n".join(lines) + "\n"


def write_index(tar: Path, out: Path | None = None) -> Path:
    """Write the DALI index of `tar` (default: beside it) atomically and return its path."""
    out = index_path(tar) if out is None else Path(out)
    atomic_write_bytes(out, index_text(tar).encode("utf-8"))
    return out


def read_index(path: Path) -> list[list[tuple[str, int, int, str]]]:
    """Parse an index file into per-sample lists of (extension, offset, size, name)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines or not lines[0].startswith(INDEX_VERSION + " "):
        raise ValueError(f"{path} is not a DALI {INDEX_VERSION} index; rewrite it with write_index")
    count = int(lines[0].split()[1])
    samples = []
    for line in lines[1:]:
        fields = line.split(" ")
        if len(fields) % 4:
            raise ValueError(f"{path}: malformed line {line[:80]!r}; rewrite it with write_index")
        samples.append(
            [(fields[i], int(fields[i + 1]), int(fields[i + 2]), fields[i + 3]) for i in range(0, len(fields), 4)]
        )
    if len(samples) != count:
        raise ValueError(f"{path} announces {count} samples but lists {len(samples)}; rewrite it")
    return samples
