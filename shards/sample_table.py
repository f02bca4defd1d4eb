"""Where a shard set's samples are: `SampleTable` for a set of them (`shards.reader.SampleRef` for one).

A loader holds every sample of its set for the whole run. As a list of SampleRef objects that
costs 0.8-1 KB per sample (a dataclass, a dict, and per member a tuple, a string and two
integers): 1.1-1.3 GB on every rank for ImageNet's 1.28 M images, ~10 GB on a node of 8 GPUs, and
more again in the reference backend, whose forked DataLoader workers copy those pages as soon as
they touch the objects' reference counts. `SampleTable` keeps the same facts in a few numpy arrays
and one byte string (~150 B per sample, measured by `benchmarks/bench_open.py`; nothing a forked
worker copies) and builds a SampleRef only for the sample asked for. Written by hand because
what it stores is the project's own index layout; numpy does the storing.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from relicv2.shards.index import name_key
from relicv2.shards.reader import SampleRef

CHUNK = 4096  # samples turned into Python objects at a time when iterating a table


class SampleTable(Sequence[SampleRef]):
    """An immutable sequence of samples in reader order, stored column-wise.

    Per sample: its tar (an index into `tars`) and where its members start; per member: its
    extension (an index into the distinct extensions), data offset, size and name (utf-8, in one
    byte string). Indexing gives a SampleRef, slicing and `select` give another table.
    """

    def __init__(self, tars: Sequence[Path], tar_ids: np.ndarray, starts: np.ndarray, exts: Sequence[str],
                 ext_ids: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, names: bytes, name_ends: np.ndarray):
        self.tars = list(tars)
        self._tar_ids, self._starts = tar_ids, starts  # starts: len + 1 member positions
        self._exts, self._ext_ids, self._offsets, self._sizes = list(exts), ext_ids, offsets, sizes
        self._names, self._name_ends = names, name_ends  # name j is names[name_ends[j - 1]:name_ends[j]]

    @classmethod
    def from_refs(cls, refs: Iterable[SampleRef]) -> SampleTable:
        builder = SampleTableBuilder()
        builder.extend(refs)
        return builder.build()

    def __len__(self) -> int:
        return len(self._tar_ids)

    def __getitem__(self, item):
        if isinstance(item, slice):
            return self.select(np.arange(len(self))[item])
        index = range(len(self))[item]  # IndexError and negative positions as for a list
        return self._refs(index, index + 1)[0]

    def __iter__(self) -> Iterator[SampleRef]:
        for start in range(0, len(self), CHUNK):
            yield from self._refs(start, min(start + CHUNK, len(self)))

    def __repr__(self) -> str:
        return f"SampleTable({len(self)} samples in {len(self.tars)} tars)"

    def __eq__(self, other) -> bool:
        if not isinstance(other, SampleTable):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    def _refs(self, start: int, stop: int) -> list[SampleRef]:
        first, last = int(self._starts[start]), int(self._starts[stop])
        bounds = self._starts[start : stop + 1].tolist()
        begins = self._name_begins(np.arange(first, last)).tolist()
        ends = self._name_ends[first:last].tolist()
        exts = [self._exts[i] for i in self._ext_ids[first:last].tolist()]
        offsets, sizes = self._offsets[first:last].tolist(), self._sizes[first:last].tolist()
        refs = []
        for tar_id, lo, hi in zip(self._tar_ids[start:stop].tolist(), bounds[:-1], bounds[1:], strict=True):
            members = {}
            for j in range(lo - first, hi - first):  # names are utf-8: sliced as bytes, then decoded
                members[exts[j]] = (offsets[j], sizes[j], self._names[begins[j] : ends[j]].decode("utf-8"))
            first_name = next(iter(members.values()))[2]
            refs.append(SampleRef(name_key(first_name), self.tars[tar_id], members))
        return refs

    def keys(self) -> Iterator[str]:
        """Every sample's key, in order (from its first member's name; no SampleRef built)."""
        first = self._starts[:-1]
        ends = self._name_ends[first].tolist() if len(self) else []
        begins = self._name_begins(first).tolist()
        return (name_key(self._names[a:b].decode("utf-8")) for a, b in zip(begins, ends, strict=True))

    def with_member(self, ext: str) -> np.ndarray:
        """Per sample, whether it has member `ext` (a boolean array)."""
        if ext not in self._exts:
            return np.zeros(len(self), bool)
        rows = np.repeat(np.arange(len(self)), np.diff(self._starts))
        return np.bincount(rows[self._ext_ids == self._exts.index(ext)], minlength=len(self)) > 0

    def by_tar(self) -> dict[Path, SampleTable]:
        """The samples of each tar that holds any, in order."""
        order = np.argsort(self._tar_ids, kind="stable")
        tar_ids, first = np.unique(self._tar_ids[order], return_index=True)
        groups = np.split(order, first[1:])
        return {self.tars[tar_id]: self.select(group) for tar_id, group in zip(tar_ids.tolist(), groups, strict=True)}

    def select(self, positions: Sequence[int] | np.ndarray) -> SampleTable:
        """A table of the samples at `positions` (in that order)."""
        positions = np.asarray(positions, np.int64).reshape(-1)
        counts = np.diff(self._starts)[positions]
        starts = np.zeros(len(positions) + 1, np.int64)
        np.cumsum(counts, out=starts[1:])
        members = np.repeat(self._starts[:-1][positions] - starts[:-1], counts) + np.arange(starts[-1])
        name_starts = self._name_begins(members)
        # One slice per member: at most a few million, each a short name (a numpy gather of every
        # byte would need 8 bytes of index per byte of name).
        pieces = [self._names[a:b] for a, b in zip(name_starts.tolist(), self._name_ends[members].tolist(), strict=True)]
        name_ends = np.cumsum([len(p) for p in pieces], dtype=np.int64)
        return SampleTable(self.tars, self._tar_ids[positions], starts, self._exts, self._ext_ids[members],
                           self._offsets[members], self._sizes[members], b"".join(pieces), name_ends)

    def _name_begins(self, members: np.ndarray) -> np.ndarray:
        """Where the names of `members` (member positions) start in the byte string."""
        return np.where(members > 0, self._name_ends[np.maximum(members - 1, 0)], 0)

    def nbytes(self) -> int:
        """The bytes the table's columns hold (what a loader keeps per set)."""
        columns = (self._tar_ids, self._starts, self._ext_ids, self._offsets, self._sizes, self._name_ends)
        return sum(c.nbytes for c in columns) + len(self._names)


class SampleTableBuilder:
    """Collects samples tar by tar into compact columns (`array`, not lists of Python ints)."""

    def __init__(self) -> None:
        self._tars: dict[Path, int] = {}
        self._exts: dict[str, int] = {}
        self._tar_ids, self._starts = array("i"), array("q", [0])
        self._ext_ids, self._offsets, self._sizes, self._name_ends = array("H"), array("q"), array("q"), array("q")
        self._names = bytearray()

    def extend(self, refs: Iterable[SampleRef]) -> None:
        for ref in refs:
            self._tar_ids.append(self._tars.setdefault(ref.tar, len(self._tars)))
            for ext, (offset, size, name) in ref.members.items():
                self._ext_ids.append(self._exts.setdefault(ext, len(self._exts)))
                self._offsets.append(offset)
                self._sizes.append(size)
                self._names += name.encode("utf-8")
                self._name_ends.append(len(self._names))
            self._starts.append(len(self._offsets))

    def build(self) -> SampleTable:
        return SampleTable(
            list(self._tars), np.array(self._tar_ids, np.int32), np.array(self._starts, np.int64),
            list(self._exts), np.array(self._ext_ids, np.uint16), np.array(self._offsets, np.int64),
            np.array(self._sizes, np.int64), bytes(self._names), np.array(self._name_ends, np.int64))
