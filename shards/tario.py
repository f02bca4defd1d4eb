"""Reading tar files the project opens itself: no URL opener, no decompression, no links, capped members.

A shard may come from anyone (docs/design.md): the tar is opened as a local file (never a `pipe:` URL),
compressed archives are refused (a 1 MB gzip can expand to GBs), each member's size is checked
from its header before a byte is read, link/device members and unsafe names are skipped with a
reason, and a tar that ends before its end-of-archive blocks is reported as truncated.
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from relicv2.shards.keys import member_refusal
from relicv2.shards.limits import DEFAULT_LIMITS, ImageLimits

# Magic numbers of the compressions tarfile (or webdataset's `r|*`) would silently undo.
COMPRESSED_MAGIC = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
    (b"\x28\xb5\x2f\xfd", "zstd"),
)
BLOCK = tarfile.BLOCKSIZE


class TarReadError(ValueError):
    """A whole tar cannot be read (missing, compressed, not a tar); the message names it and the fix."""


@dataclass(frozen=True)
class Skipped:
    """A member left out, or a problem with the rest of the tar (`name` None): with the reason."""

    name: str | None
    reason: str  # short code: "unsafe_member" (link, device), "unsafe_key" (name), "too_large", "truncated"
    detail: str


def iter_tar(path: Path, limits: ImageLimits = DEFAULT_LIMITS) -> Iterator[tarfile.TarInfo | Skipped]:
    """The members of a local tar in order, from their headers (no data is read); refused members and
    truncation come as :class:`Skipped`. Raises :class:`TarReadError` when the file is missing, empty,
    compressed or not a tar at all."""
    try:
        handle = open(path, "rb")  # noqa: SIM115 (closed below)
    except OSError as exc:
        raise TarReadError(f"{path}: cannot be opened ({exc.strerror or exc}); check the path") from None
    with handle:
        size = os.fstat(handle.fileno()).st_size
        if size == 0:
            raise TarReadError(f"{path}: is empty (0 bytes), not a tar; rebuild or remove this shard")
        head = handle.read(8)
        compression = next((name for magic, name in COMPRESSED_MAGIC if head.startswith(magic)), None)
        if compression is not None:
            raise TarReadError(
                f"{path}: is {compression}-compressed; compressed shards are refused (they can expand "
                f"without bound); decompress it into a plain .tar first"
            )
        handle.seek(0)
        try:
            archive = tarfile.open(fileobj=handle, mode="r:")
        except tarfile.TarError as exc:
            raise TarReadError(f"{path}: is not a readable tar ({exc}); rebuild or remove this shard") from None
        end = 0
        try:
            for info in archive:
                end = info.offset_data + -(-info.size // BLOCK) * BLOCK
                if info.isdir():
                    continue
                while info.name.startswith("./"):  # what `tar -cf x.tar .` writes: same file, plain name
                    info.name = info.name[2:]
                refusal = member_refusal(info)
                if refusal is not None:  # a regular file refused for its name, else a link or a device
                    yield Skipped(info.name, "unsafe_key" if info.isreg() else "unsafe_member", refusal)
                elif info.size > limits.max_member_bytes:
                    yield Skipped(info.name, "too_large", f"member {info.name!r} is {info.size} bytes, over "
                                  f"the limit of {limits.max_member_bytes}")
                elif info.offset_data + info.size > size:
                    yield Skipped(info.name, "truncated",
                                  f"member {info.name!r} is cut off: the tar ends inside it")
                    return
                else:
                    yield info
        except (tarfile.TarError, EOFError, OSError) as exc:
            yield Skipped(None, "truncated", f"the tar cannot be read past byte {end} ({exc})")
            return
        # tarfile stops quietly at a header cut short; a complete tar ends with two zero blocks.
        handle.seek(end)
        if handle.read(2 * BLOCK) != b"\0" * (2 * BLOCK):
            yield Skipped(None, "truncated", f"the tar ends at byte {size} without its end-of-archive blocks "
                          "(cut short?)")


def read_indexed_member(fd: int, offset: int, size: int, *, header_read: bool = False,
                        name: str | None = None) -> bytes | None:
    """The `size` data bytes at `offset` of an open tar, read with the member's header in one call;
    None unless `header_fits` (an index that does not describe this tar: stale, foreign or forged). With
    `header_read` (the caller took the place from this tar's own headers) the data alone: parsing each
    header twice cost a reading job ~5% of its CPU."""
    if header_read:
        data = os.pread(fd, size, offset)
        return data if len(data) == size else None
    if offset < BLOCK:
        return None
    raw = os.pread(fd, BLOCK + size, offset - BLOCK)
    return raw[BLOCK:] if len(raw) == BLOCK + size and _fits(raw[:BLOCK], size, name) else None


def header_fits(fd: int, offset: int, size: int, name: str | None = None) -> bool:
    """Whether the header block before `offset` of an open tar is a valid regular-file header of exactly
    `size` bytes, and of that `name` when given (an ASCII name of under 100 characters: a longer or other
    one is held in an extended header before it). An index whose member fails it is stale, foreign or
    forged: one sample's image pointed at another's bytes, say. One read of a block, no data."""
    return offset >= BLOCK and _fits(os.pread(fd, BLOCK, offset - BLOCK), size, name)


def _fits(block: bytes, size: int, name: str | None) -> bool:
    # The fields read in place (type, size, name and ustar prefix): TarInfo.frombuf parses every field and
    # the checksum, ~15 us a header, which the loaders' first check of a set paid three times a sample.
    if len(block) != BLOCK or block[156:157] not in tarfile.REGULAR_TYPES:
        return False
    try:
        if tarfile.nti(block[124:136]) != size:
            return False
    except tarfile.HeaderError:
        return False
    if name is None or not name.isascii() or len(name) >= 100:
        return True
    held = block[:100].split(b"\0", 1)[0]
    if block[257:262] == b"ustar" and (prefix := block[345:500].split(b"\0", 1)[0]):
        held = prefix + b"/" + held
    while held.startswith(b"./"):  # as iter_tar reads such names
        held = held[2:]
    return held == name.encode()


class MemberReader(io.RawIOBase):
    """Bytes `offset`..`offset + size` of an open file as a seekable read-only file, read on demand:
    PIL opens an image member through it and reads only its header. (The standard library has no
    view of a file slice; tarfile's own member file needs the member's parsed header.)"""

    def __init__(self, handle, offset: int, size: int) -> None:
        super().__init__()
        self.fd, self.offset, self.size, self.position = handle.fileno(), offset, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        count = max(0, min(len(buffer), self.size - self.position))
        data = os.pread(self.fd, count, self.offset + self.position) if count else b""
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.size}[whence]
        self.position = max(0, base + position)
        return self.position


def member_file(handle, offset: int, size: int) -> io.BufferedReader:
    """A buffered :class:`MemberReader` (header reads cost one or two small reads)."""
    return io.BufferedReader(MemberReader(handle, offset, size), buffer_size=16384)
