"""Manifest and rejection tables of a shard set (parquet, docs/design.md Formats)."""

from __future__ import annotations

import io
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from relicv2.jobs.atomic import atomic_write_bytes

MANIFEST_NAME = "manifest.parquet"
REJECTED_NAME = "rejected.parquet"

MANIFEST_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("shard", pa.string()),  # tar file name, relative to the shard set's folder
        ("position", pa.int32()),  # index of the sample inside its tar
        ("label", pa.int64()),
        ("width", pa.int32()),
        ("height", pa.int32()),
        ("byte_size", pa.int64()),  # payload bytes of all members of the sample
        ("content_hash", pa.string()),  # shards.sample.content_hash of the members
        ("status", pa.string()),
    ]
)

REJECTED_SCHEMA = pa.schema(
    [
        ("source", pa.string()),
        ("reason", pa.string()),  # a short code, e.g. "truncated", "too_small"
        ("detail", pa.string()),  # one human sentence
    ]
)

CORE_COLUMNS = set(MANIFEST_SCHEMA.names)


def manifest_table(rows: Sequence[dict]) -> pa.Table:
    """Manifest rows -> table: the core columns typed, extra scalar columns inferred, sorted by name."""
    extras = sorted({k for row in rows for k in row} - CORE_COLUMNS)
    core = pa.Table.from_pylist([{k: row.get(k) for k in MANIFEST_SCHEMA.names} for row in rows], MANIFEST_SCHEMA)
    for name in extras:
        values = [row.get(name) for row in rows]
        try:
            column = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # One key with mixed types (foreign json members: "3" here, 3 there) is kept as JSON text,
            # so a long job never fails at its last step; each sample's json member keeps the values.
            column = pa.array([None if v is None else json.dumps(v) for v in values], pa.string())
        core = core.append_column(name, column)
    return core


def concat_manifests(tables: Sequence[pa.Table]) -> pa.Table:
    """The manifest tables of a set's shards as one, sorted by (shard, position), with the layout of
    `manifest_table`: the core columns, then the extra ones by name (absent in a shard: null)."""
    if not tables:
        return manifest_table([])
    try:
        table = pa.concat_tables(tables, promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        # An extra column typed differently in two shards: the row-wise build keeps it as JSON text.
        table = manifest_table([row for t in tables for row in t.to_pylist()])
    extras = sorted(set(table.column_names) - CORE_COLUMNS)
    table = table.select([*MANIFEST_SCHEMA.names, *extras])
    return table.sort_by([("shard", "ascending"), ("position", "ascending")]).combine_chunks()


def rejected_table(rows: Iterable[dict]) -> pa.Table:
    """Rejection rows (source, reason, detail) -> table."""
    return pa.Table.from_pylist([{k: r.get(k) for k in REJECTED_SCHEMA.names} for r in rows], REJECTED_SCHEMA)


def write_table(table: pa.Table, path: Path) -> None:
    """Write a table as parquet atomically; the same table gives the same bytes (no timestamps are stored)."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    atomic_write_bytes(Path(path), sink.getvalue())


def write_manifest(rows: Sequence[dict], directory: Path) -> None:
    """Write `manifest.parquet` for the rows (sorted by shard, position) into `directory`."""
    ordered = sorted(rows, key=lambda r: (r["shard"], r["position"]))
    write_table(manifest_table(ordered), Path(directory) / MANIFEST_NAME)


def read_manifest(directory: Path) -> pa.Table:
    """The manifest of a shard set; a clear error when the folder has none."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist; build the shard set first (relicv2 shards build) "
            "or, after a multi-rank build, run relicv2 shards merge"
        )
    return pq.read_table(path)


def is_plain_tar_name(name: object) -> bool:
    """A file name directly inside the set's folder, ending in .tar: the only shard names a manifest
    or build plan may list (anything else could make a job read or delete outside the folder)."""
    return (isinstance(name, str) and name.endswith(".tar") and not name.startswith(".")
            and not any(c in name for c in ("/", "\\", "\0")))


def manifest_shards(directory: Path) -> set[str] | None:
    """The shard file names the manifest in `directory` lists (plain names only), or None when it
    has no readable manifest: what a later job may delete as this set's own files."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        names = pq.read_table(path, columns=["shard"]).column("shard").to_pylist()
    except (OSError, pa.ArrowException, KeyError):
        return None
    return {n for n in names if is_plain_tar_name(n)}


def read_rejected(directory: Path) -> pa.Table:
    """The rejection list of a shard set (empty when the set has none)."""
    path = Path(directory) / REJECTED_NAME
    return pq.read_table(path) if path.is_file() else rejected_table([])
