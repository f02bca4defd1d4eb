"""DALI index files (`wds2idx` format v1.2) for WebDataset tars: the one owner of the index text.

Hand-written rather than calling DALI's `wds2idx` script: that script shells out to GNU tar and is
not importable as a library, while Python's tarfile gives each member's exact data offset directly.
Format: a first line `v1.2 <samples>`, then one line per sample listing, for each member,
`<extension> <data offset> <size> <member name>`; members of a sample are adjacent in the tar.
Index files may come from someone else: :func:`read_index` checks every field.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.shards.keys import UnsafeKeyError, check_key
from relicv2.shards.limits import DEFAULT_LIMITS, ImageLimits
from relicv2.shards.tario import Skipped, TarReadError, iter_tar

INDEX_VERSION = "v1.2"
REFUSED_SUFFIX = ".refused.json"

IndexEntry = tuple[str, int, int, str]  # (extension, data offset, size, member name)
# The way out of an index that does not fit its tar, as commands: the build rewrites its own shards' indexes,
# `shards index` derives a plain tar's missing one.
INDEX_FIX = ("delete it, then rerun the `relicv2 shards build` that made the set, or run `relicv2 shards index` "
             "on a set of plain tars (it derives the index from the tar)")


class IndexFileError(ValueError):
    """An index file that is not a valid DALI index (or does not fit its tar)."""


def index_path(tar: Path) -> Path:
    """The DALI index file beside a tar: `images-000000.tar` -> `images-000000.idx`."""
    return Path(tar).with_suffix(".idx")


def shard_files(names: Iterable[str]) -> set[str]:
    """The tar and index file names of the given shard names."""
    return {n for name in names for n in (name, index_path(Path(name)).name)}


def split_member_name(name: str) -> tuple[str, str]:
    """Split a member name into (key, extension) at the first dot of its base name, as DALI does."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :]


def name_key(name: str) -> str:
    """The key of the sample a member belongs to: its name without folders and extension."""
    return split_member_name(name)[0].rsplit("/", 1)[-1]


def format_index(samples: Sequence[Sequence[IndexEntry]]) -> str:
    """The text of an index listing `samples` (each a list of member entries: `ext offset size name`)."""
    lines = (" ".join(f"{ext} {offset} {size} {name}" for ext, offset, size, name in s) for s in samples)
    return "\n".join([f"{INDEX_VERSION} {len(samples)}", *lines]) + "\n"


def scan_tar(tar: Path, limits: ImageLimits = DEFAULT_LIMITS) -> tuple[list[list[IndexEntry]], list[Skipped]]:
    """The samples of `tar` as index entries, from its member headers alone (no data read), and the
    members left out: links, devices, unsafe names, oversized members, and truncation (`name` None or
    reason "truncated"). Hidden files are left out silently, as DALI's own indexer does. Raises
    TarReadError when the file is not a readable tar at all."""
    members: list[tuple[str, IndexEntry]] = []
    skipped: list[Skipped] = []
    for item in iter_tar(tar, limits):
        if isinstance(item, Skipped):
            skipped.append(item)
            continue
        key, ext = split_member_name(item.name)
        if key and not key.endswith("/"):  # hidden files are skipped, as DALI's own indexer does
            members.append((key, (ext, item.offset_data, item.size, item.name)))
    # A sample is a run of adjacent members with one key.
    samples = [[entry for _, entry in run] for _, run in itertools.groupby(members, key=lambda m: m[0])]
    return samples, skipped


def derive_index(tar: Path) -> tuple[str, list[Skipped]]:
    """The index of `tar` as text, without the members a reader refuses and hidden files, and the members
    it refused (links, devices, unsafe names, oversized); TarReadError (a ValueError) naming the file when
    it is not a readable tar."""
    samples, skipped = scan_tar(tar)
    cut = next((item for item in skipped if item.name is None or item.reason == "truncated"), None)
    if cut is not None:  # cut short: an index would hide the loss
        raise TarReadError(f"{tar}: {cut.detail}; rebuild or remove this shard")
    _check_members_together(tar, samples)
    return format_index(samples), skipped


def index_text(tar: Path) -> str:
    """The text of `derive_index`."""
    return derive_index(tar)[0]


def refused_path(index: Path) -> Path:
    """Beside a derived index: the members of its tar that the derivation left out, for the reader to
    report (a derived index cannot name them, and no job may lose them silently)."""
    return index.with_suffix(REFUSED_SUFFIX)


def write_refused(index: Path, refused: Sequence[Skipped]) -> None:
    """Keep the members `derive_index` refused beside the index derived into a cache (none: no file)."""
    if refused:
        atomic_write_bytes(refused_path(index), json.dumps([[s.name, s.reason, s.detail] for s in refused]).encode())


def read_refused(index: Path, limits: ImageLimits = DEFAULT_LIMITS) -> list[tuple[str, str, str]]:
    """The refused members kept beside `index` as (name, reason code, detail); none when there is no such
    file, or it is not one `write_refused` wrote (over the json limit, or other fields)."""
    path = refused_path(index)
    try:
        if path.stat().st_size > limits.max_json_bytes:
            return []
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return []
    if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) == 3 and all(isinstance(v, str) for v in e) for e in entries):
        return []
    return [tuple(e) for e in entries]


def _check_members_together(tar: Path, samples: list[list[IndexEntry]]) -> None:
    """TarReadError when a sample's members are split over several places of the tar (written as
    `tar cf x.tar *.jpg *.cls`): DALI's reader, like webdataset, takes a sample from one run of
    members, so every sample would lose its label or its image. (Two runs with the same extensions
    are two samples that share a key, which the readers take as they are.)"""
    runs: dict[str, list[set[str]]] = {}
    for entries in samples:
        runs.setdefault(name_key(entries[0][3]), []).append({entry[0] for entry in entries})
    for key, extensions in runs.items():
        if len(extensions) > 1 and sum(map(len, extensions)) == len(set().union(*extensions)):
            raise TarReadError(
                f"{tar}: the members of sample {key!r} are not next to each other (as `tar cf x.tar *.jpg *.cls` "
                "writes them); write the tar in key order (`tar cf x.tar $(ls | sort)`, or webdataset.ShardWriter)"
            )


def write_index(tar: Path) -> Path:
    """Write the DALI index of `tar` beside it atomically and return its path."""
    atomic_write_bytes(index_path(tar), index_text(tar).encode("utf-8"))
    return index_path(tar)


def _entry(path: Path, number: int, fields: list[str], i: int, tar_size: int) -> IndexEntry:
    ext, offset, size, name = fields[i : i + 4]
    try:
        offset, size = int(offset), int(size)
    except ValueError:
        raise IndexFileError(f"{path} line {number}: offset/size {fields[i + 1]!r}/{fields[i + 2]!r} are not integers; "
                             f"{INDEX_FIX}") from None
    if offset < 0 or size < 0:
        raise IndexFileError(f"{path} line {number}: negative offset or size ({offset}, {size}); {INDEX_FIX}")
    if offset + size > tar_size:
        raise IndexFileError(f"{path} line {number}: member {name!r} at {offset}+{size} lies beyond the tar's {tar_size} "
                             "bytes: the tar is cut short or the index belongs to another tar; check the set with "
                             "`relicv2 shards verify` and rebuild it (rerun `relicv2 shards build`)")
    try:
        check_key(name)
    except UnsafeKeyError as exc:
        raise IndexFileError(f"{path} line {number}: unsafe member name ({exc}); {INDEX_FIX}") from None
    return ext, offset, size, name


def read_index(path: Path, tar: Path) -> list[list[IndexEntry]]:
    """The index file of `tar` as per-sample lists of (extension, offset, size, name), every field
    checked (count, integers, safe names, members inside the tar); ValueError naming a bad one."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise IndexFileError(f"{path}: cannot be read as an index ({exc}); {INDEX_FIX}") from None
    head = lines[0].split() if lines else []
    if len(head) != 2 or head[0] != INDEX_VERSION or not head[1].isdigit():
        raise IndexFileError(f"{path} is not a DALI {INDEX_VERSION} index (first line must be '{INDEX_VERSION} <count>'); {INDEX_FIX}")
    count = int(head[1])
    tar_size = os.path.getsize(tar)
    samples = []
    for number, line in enumerate(lines[1:], start=2):
        fields = line.split(" ")
        if not line or len(fields) % 4:
            raise IndexFileError(f"{path} line {number}: malformed {line[:80]!r}; {INDEX_FIX}")
        samples.append([_entry(path, number, fields, i, tar_size) for i in range(0, len(fields), 4)])
    if len(samples) != count:
        raise IndexFileError(f"{path} announces {count} samples but lists {len(samples)}; {INDEX_FIX}")
    return samples
