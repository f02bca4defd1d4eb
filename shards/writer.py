"""Writing WebDataset tars (byte-reproducible, atomic) with their DALI index files and manifests."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from relicv2.jobs.atomic import atomic_write_bytes, fsync_dir, remove_stale_temps, temp_path_for
from relicv2.jobs.version import package_version
from relicv2.shards.index import IndexEntry, format_index, index_path, shard_files
from relicv2.shards.manifest import CORE_COLUMNS, manifest_shards, write_manifest
from relicv2.shards.sample import ShardSample, check_sample, content_hash, sample_members


def shard_name(prefix: str, number: int) -> str:
    """`images-000012.tar` for prefix "images" and shard 12."""
    return f"{prefix}-{number:06d}.tar"


def manifest_row(sample: ShardSample, members: list[tuple[str, bytes]]) -> dict:
    """The manifest row of a sample, without its place (shard, position): core columns plus the
    scalar entries of its meta."""
    row = {
        "key": sample.key,
        "label": sample.label,
        "width": sample.meta.get("width"),
        "height": sample.meta.get("height"),
        "byte_size": sum(len(data) for _, data in members),
        "content_hash": content_hash(members),
        "status": sample.meta.get("status", "ok"),
    }
    row.update((name, value) for name, value in sample.meta.items()
               if name not in CORE_COLUMNS and (value is None or isinstance(value, str | int | float | bool)))
    return row


@dataclass(frozen=True)
class SampleRecord:
    """A sample serialised for a tar: its member blocks, manifest row and index entries
    (extension, data offset relative to the record's start, size). Built wherever the sample is
    made (e.g. in a worker process) so the process writing the tar only copies bytes."""

    key: str
    blob: bytes
    row: dict
    entries: tuple[tuple[str, int, int], ...]


def sample_record(sample: ShardSample) -> SampleRecord:
    """Serialise a sample into ustar blocks: per member a 512-byte header, then data padded to 512
    (the blob's length is what the sample takes in a tar)."""
    check_sample(sample)
    members = sample_members(sample)
    parts, entries, offset = [], [], 0
    for ext, data in members:
        info = tarfile.TarInfo(f"{sample.key}.{ext}")
        info.size = len(data)
        # Fixed header fields make a rebuilt tar byte-identical (docs/design.md: mtime 0, fixed owner).
        info.mtime = 0
        info.mode = 0o444
        info.uid = info.gid = 0
        info.uname = info.gname = "relicv2"
        header = info.tobuf(tarfile.USTAR_FORMAT, "utf-8", "strict")
        padding = -len(data) % tarfile.BLOCKSIZE
        parts += [header, data, b"\0" * padding]
        entries.append((ext, offset + len(header), len(data)))
        offset += len(header) + len(data) + padding
    return SampleRecord(sample.key, b"".join(parts), manifest_row(sample, members), tuple(entries))


class TarShard:
    """One tar being written under a temporary name; `close()` publishes it with its index.

    Assembled from SampleRecords rather than through tarfile.TarFile so that records can be serialised
    in worker processes; the bytes equal what tarfile writes. The index is renamed into place first,
    then the tar, so a final tar name always has an index beside it. The SHA-256 of both files is
    computed as they are written, for the engine's done record (`sha256`, `index_sha256`, set by `close()`).
    """

    def __init__(self, tar: Path):
        self.path = Path(tar)
        self.tmp = temp_path_for(self.path)
        self._file = open(self.tmp, "wb")  # noqa: SIM115 (closed in close/abort)
        self._hash = hashlib.sha256()
        self.sha256: str | None = None
        self.index_sha256: str | None = None
        self.size = 0
        self.rows: list[dict] = []
        self.keys: set[str] = set()
        self._index: list[list[IndexEntry]] = []

    def add_record(self, record: SampleRecord) -> None:
        """Append a serialised sample; its manifest row gets its shard and position."""
        if record.key in self.keys:
            raise ValueError(f"duplicate key {record.key!r} in {self.path.name}; keys must be unique")
        self._index.append([(ext, self.size + off, size, f"{record.key}.{ext}") for ext, off, size in record.entries])
        self._file.write(record.blob)
        self._hash.update(record.blob)
        self.size += len(record.blob)
        self.rows.append({**record.row, "shard": self.path.name, "position": len(self.rows)})
        self.keys.add(record.key)

    def close(self) -> list[dict]:
        """Finish the tar, fsync, write its index, rename both into place; return the rows."""
        # End of archive as tarfile writes it: two zero blocks, then zeros up to a whole record.
        end = 2 * tarfile.BLOCKSIZE
        end += -(self.size + end) % tarfile.RECORDSIZE
        self._file.write(b"\0" * end)
        self._hash.update(b"\0" * end)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        index = format_index(self._index).encode("utf-8")
        atomic_write_bytes(index_path(self.path), index)
        self.sha256, self.index_sha256 = self._hash.hexdigest(), hashlib.sha256(index).hexdigest()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return self.rows

    def abort(self) -> None:
        """Drop the partial tar, whatever closing it says (on a full disk the close's flush fails)."""
        try:
            self._file.close()
        except OSError:
            pass  # the file is dropped: the bytes it could not write are of no use
        finally:
            self.tmp.unlink(missing_ok=True)


def write_info(directory: Path, info: dict) -> None:
    """Write `info.json` (sorted keys, so equal content gives equal bytes) atomically."""
    path = Path(directory) / "info.json"
    atomic_write_bytes(path, (json.dumps(info, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def write_shard_set(
    samples: Iterable[ShardSample],
    out_dir: Path,
    *,
    prefix: str = "images",
    max_bytes: int = 1 << 30,
    max_count: int | None = None,
) -> list[Path]:
    """Write samples, in the given order, as `{prefix}-000000.tar ...` shards in `out_dir` (each with its
    `.idx`), `manifest.parquet` and `info.json`, every file atomically; return the tar paths. A new shard
    starts when the next sample would push the current one past `max_bytes` (tar bytes) or `max_count`
    samples. Shards the folder's previous manifest lists that this set does not overwrite are removed;
    no other file is touched."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    previous = manifest_shards(out_dir) or set()
    if max_bytes <= 0 or (max_count is not None and max_count <= 0):
        raise ValueError("max_bytes and max_count must be positive")
    written: list[Path] = []
    rows: list[dict] = []
    keys: set[str] = set()
    current: TarShard | None = None
    try:
        for sample in samples:
            record = sample_record(sample)
            if sample.key in keys:
                raise ValueError(f"duplicate key {sample.key!r}; keys must be unique in a shard set")
            keys.add(sample.key)
            if current is not None and (
                current.size + len(record.blob) > max_bytes
                or (max_count is not None and len(current.rows) >= max_count)
            ):
                rows += current.close()
                current = None
            if current is None:
                current = TarShard(out_dir / shard_name(prefix, len(written)))
                written.append(current.path)
            current.add_record(record)
        if current is not None:
            rows += current.close()
            current = None
    finally:
        if current is not None:
            current.abort()
    if not written:
        raise ValueError(f"no samples to write into {out_dir}")
    # Remove the shards (and indexes) of the set this folder held before that the new set does not
    # reuse: only files the previous manifest listed, never anything else in the folder.
    keep = {p.name for p in written}
    for name in shard_files(previous - keep):
        (out_dir / name).unlink(missing_ok=True)
    remove_stale_temps(out_dir, shard_files(keep))
    write_manifest(rows, out_dir)
    write_info(out_dir, {
        "prefix": prefix,
        "shards": len(written),
        "samples": len(rows),
        "bytes": sum(p.stat().st_size for p in written),
        "labelled": sum(r["label"] is not None for r in rows),
        "version": package_version(),
    })
    return written

