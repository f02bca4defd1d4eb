"""The one sample reader over tars: index-based, with one policy for bad members, every loss in a report.

Tars are opened by the project itself (shards.tario): never through a URL opener, so no shard
path can run a `pipe:` command; compressed tars are refused. A tar is read through its index: the
`.idx` given (each member's header is checked as its data is read, so a stale or forged index reads
nothing it does not describe), or one derived from the tar's headers, which also names the members
an index leaves out. One policy, applied here for every job, turns each bad sample into a rejection
with a reason code in the :class:`ReadReport` the caller must pass:

- unsafe_member: a link or a device (never read);
- unsafe_key, duplicate_key: a member name or key that could name a file outside a folder, a second
  sample of a key;
- too_large: a member over `max_member_bytes` (from its header, before reading);
- no_image: no member of IMAGE_MEMBERS;
- bad_json, json_too_large, json_too_deep: a json member that is not JSON, is over `max_json_bytes`
  or nests deeper than `max_json_depth` (checked without parsing, so no depth exhausts a stack).

Members no job reads (not in USED_MEMBERS) are delivered, and counted and listed as unused.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relicv2.shards.index import (
    INDEX_FIX,
    IndexEntry,
    IndexFileError,
    index_path,
    name_key,
    read_index,
    read_refused,
    scan_tar,
    split_member_name,
)
from relicv2.shards.keys import UnsafeKeyError, check_key
from relicv2.shards.limits import DEFAULT_LIMITS, ImageLimits
from relicv2.shards.manifest import MANIFEST_NAME, read_manifest
from relicv2.shards.sample import (
    IMAGE_MEMBERS,
    LABEL_MEMBER,
    MAX_LABEL_BYTES,
    META_MEMBER,
    USED_MEMBERS,
    class_index,
    image_member_name,
    label_text,
)
from relicv2.shards.shardset import ShardSet, ShardSetError, Spec, shard_tars
from relicv2.shards.tario import TarReadError, header_fits, read_indexed_member

UNUSED_LISTED = 20  # unused members named one by one in a report; the rest only counted
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # a JSON string literal: brackets inside it do not nest


@dataclass
class ReadReport:
    """What a read delivered and what it lost, filled in while iterating.

    lost_shards: (tar, reason) for tars that could not be read, or were read only in part.
    rejected: (tar, member or key, reason) for members and samples left out; `reasons` counts their
      reason codes and `rows()` gives them as rejected-list rows.
    unused: members no job reads, by extension (delivered, not rejected); `unused_listed` names the first.
    listed: samples the indexes read list, delivered or rejected.
    expected: samples the manifest lists for the tars read (None without a manifest).
    """

    shards: int = 0
    samples: int = 0
    listed: int = 0
    lost_shards: list[tuple[str, str]] = field(default_factory=list)
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    codes: list[str] = field(default_factory=list)  # the reason code of each `rejected` entry
    unused: Counter = field(default_factory=Counter)
    unused_listed: list[tuple[str, str]] = field(default_factory=list)
    expected: int | None = None

    @property
    def reasons(self) -> Counter:
        """Rejections by reason code."""
        return Counter(self.codes)

    @property
    def missing(self) -> int:
        """Samples the manifest lists that were not delivered (0 without a manifest)."""
        return max(0, self.expected - self.samples) if self.expected is not None else 0

    @property
    def ok(self) -> bool:
        """Nothing was lost."""
        return not self.lost_shards and not self.rejected and not self.missing

    def summary(self) -> str:
        """One line: delivered, lost, unused members, and the first few losses by name."""
        text = f"{self.samples} samples read from {self.shards} shard(s)"
        if self.expected is not None:
            text += f" (manifest: {self.expected})"
        if self.unused:
            text += f"; members no job reads: {dict(self.unused)}, e.g. {self.unused_listed[0][1]!r}"
        if self.ok:
            return text
        lost = [f"{Path(t).name}: {r}" for t, r in self.lost_shards[:3]]
        lost += [f"{Path(t).name}/{m}: {r}" for t, m, r in self.rejected[: max(0, 3 - len(lost))]]
        return (
            f"{text}; lost {len(self.lost_shards)} shard(s), {len(self.rejected)} member(s)/sample(s) "
            f"{dict(self.reasons)}, {self.missing} sample(s) short of the manifest; e.g. " + "; ".join(lost)
        )

    def rows(self, start: int = 0) -> list[dict]:
        """Rejections from the `start`-th on as rejected-list rows: source (`tar:name`), reason, detail."""
        return [{"source": f"{Path(tar).name}:{name}", "reason": code, "detail": detail}
                for (tar, name, detail), code in zip(self.rejected[start:], self.codes[start:], strict=True)]

    def lose_shard(self, tar: Path, reason: str) -> None:
        self.lost_shards.append((str(tar), reason))

    def reject(self, tar: Path, name: str, code: str, detail: str) -> None:
        self.rejected.append((str(tar), name, detail))
        self.codes.append(code)

    def note_unused(self, tar: Path, name: str, ext: str) -> None:
        self.unused[ext or "(no extension)"] += 1
        if len(self.unused_listed) < UNUSED_LISTED:
            self.unused_listed.append((str(tar), name))


@dataclass(frozen=True, slots=True)
class SampleRef:
    """Where one sample's members are: the tar and, per extension, (offset, size, member name).
    `key` is the first member's name without folders and extension (the view loaders' key)."""

    key: str
    tar: Path
    members: dict[str, tuple[int, int, str]]

    @property
    def image_ext(self) -> str | None:
        """The extension of the sample's image member (one of IMAGE_MEMBERS), or None."""
        return image_member_name(self.members)

    def read_image(self) -> bytes | None:
        """The bytes of the image member, whatever its format."""
        return self.read(self.image_ext)

    @property
    def label(self) -> int | None:
        """The sample's class index, or None (no `cls` member, or one that is not a class index)."""
        return class_index(self.read(LABEL_MEMBER, MAX_LABEL_BYTES + 1))  # at most what a class index holds

    def read(self, ext: str | None, most: int | None = None) -> bytes | None:
        """The bytes of member `ext` (at most `most` of them), or None when the sample has no such member."""
        if ext not in self.members:
            return None
        offset, size, _ = self.members[ext]
        with open(self.tar, "rb") as f:
            return os.pread(f.fileno(), size if most is None else min(size, most), offset)

    @property
    def entries(self) -> list[IndexEntry]:
        """The sample's line of an index: (extension, offset, size, name) per member, in tar order."""
        return [(ext, *member) for ext, member in self.members.items()]


@dataclass(frozen=True)
class Sample:
    """One sample read whole: its members' bytes by extension in tar order, its label and json."""

    key: str
    tar: Path
    position: int  # of the sample in its tar's index (rejected samples count)
    members: dict[str, bytes]
    meta: object  # the parsed json member ({} without one)
    label: int | None

    @property
    def image_ext(self) -> str:
        return image_member_name(self.members)  # type: ignore[return-value] (the policy needs one)

    def as_dict(self) -> dict:
        """The sample as `iter_samples` yields it."""
        ext = self.image_ext
        sample = {"key": self.key, "shard": str(self.tar), "label": self.label, "meta": self.meta,
                  "image_ext": ext, "image": self.members[ext]}
        if self.label is None and LABEL_MEMBER in self.members:  # a class name (other tools write them)
            sample["label_text"] = label_text(self.members[LABEL_MEMBER])
        sample.update((name, value) for name, value in self.members.items() if name not in (LABEL_MEMBER, META_MEMBER))
        return sample


def json_problem(data: bytes, limits: ImageLimits) -> tuple[str, str] | tuple[None, object]:
    """(reason code, detail) for a json member (of at most `max_json_bytes`: the policy checked its
    size from the index) that the policy refuses, else (None, its parsed value)."""
    if data.count(b"[") + data.count(b"{") > limits.max_json_depth:  # only then can it nest too deep
        if (depth := deepest(data)) > limits.max_json_depth:
            return "json_too_deep", f"json member nests {depth} levels deep, deeper than the limit of {limits.max_json_depth}"
    try:
        return None, json.loads(data)
    except (ValueError, RecursionError) as exc:
        return "bad_json", f"json member is not valid JSON ({str(exc)[:80]})"


def deepest(data: bytes) -> int:
    """The deepest nesting of arrays and objects in JSON text, counted in one pass without recursion."""
    depth = top = 0
    for char in _JSON_STRING.sub(b"", data):
        if char in b"[{":
            depth += 1
            top = max(top, depth)
        elif char in b"]}":
            depth -= 1
    return top


def _check_line(tar: Path, index: Path, entries: list[IndexEntry]) -> None:
    """IndexFileError unless every member of an index line is one sample's (a forged or foreign index)."""
    key = split_member_name(entries[0][3])[0]
    for ext, _, _, name in entries:
        if split_member_name(name) != (key, ext):
            raise IndexFileError(f"{index}: lists member {name[:80]!r}, which does not belong to sample {key!r} as "
                                 f"{ext!r}; {INDEX_FIX}")


def _policy(tar: Path, entries: list[IndexEntry], seen: set[str], limits: ImageLimits,
            report: ReadReport) -> SampleRef | None:
    """The sample an index line describes, or None with its rejection in `report`."""
    key = split_member_name(entries[0][3])[0]
    members: dict[str, tuple[int, int, str]] = {}
    duplicate_member = None
    for ext, offset, size, name in entries:
        duplicate_member = duplicate_member or (ext if ext in members else None)
        members[ext] = (offset, size, name)
    report.listed += 1
    try:
        check_key(key)
    except UnsafeKeyError as exc:
        report.reject(tar, key, "unsafe_key", str(exc))
        return None
    refusal = None
    if key in seen:
        refusal = ("duplicate_key", f"duplicate key {key!r}: a second sample of it in this tar (keys are unique "
                   "and a sample's members adjacent); the later one is left out")
    elif duplicate_member is not None:
        refusal = ("duplicate_key", f"member {key}.{duplicate_member} appears twice in one sample")
    elif big := [(ext, size) for ext, (_, size, _) in members.items() if size > limits.max_member_bytes]:
        refusal = ("too_large", f"member {key}.{big[0][0]} is {big[0][1]} bytes, over the limit of {limits.max_member_bytes}")
    elif META_MEMBER in members and members[META_MEMBER][1] > limits.max_json_bytes:
        refusal = ("json_too_large", f"json member is {members[META_MEMBER][1]} bytes, over the limit of "
                   f"{limits.max_json_bytes}")
    elif image_member_name(members) is None:
        refusal = ("no_image", f"no image member (one of {', '.join(IMAGE_MEMBERS)}; has {', '.join(sorted(members))})")
    seen.add(key)
    if refusal is not None:
        report.reject(tar, key, *refusal)
        return None
    for ext, (_, _, name) in members.items():
        if ext not in USED_MEMBERS:
            report.note_unused(tar, name, ext)
    return SampleRef(name_key(entries[0][3]), tar, members)


def _index(tar: Path, index: Path | None, limits: ImageLimits, report: ReadReport) -> list[list[IndexEntry]]:
    """The index lines of `tar`: from the file `index`, or derived from the tar's headers (then the
    members an index leaves out are rejections, and a cut-off tar a lost shard)."""
    if index is not None:
        lines = read_index(index, tar)
        for entries in lines:  # every line before any verdict: a bad index changes nothing in `report`
            _check_line(tar, index, entries)
        for name, code, detail in read_refused(index, limits):  # what its derivation left out of it
            report.reject(tar, name, code, detail)
        return lines
    lines, skipped = scan_tar(tar, limits)
    for item in skipped:
        if item.name is None or item.reason == "truncated":
            report.lose_shard(tar, item.detail)
        else:
            report.reject(tar, item.name, item.reason, item.detail)
    return lines


def _located(tar: Path, index: Path | None, limits: ImageLimits, report: ReadReport) -> list[tuple[int, SampleRef]]:
    seen: set[str] = set()
    return [(line, ref) for line, entries in enumerate(_index(tar, index, limits, report))
            if (ref := _policy(tar, entries, seen, limits, report)) is not None]


def check_in_place(handle, index: Path, samples: Sequence[SampleRef]) -> None:
    """IndexFileError (naming the index and the fix) unless, in the open tar, the header before each member
    of `samples` (located through `index`) names that member with that size (`shards.tario.header_fits`):
    an index pointing one sample's image at another's bytes would deliver the wrong image. A read of a
    block a member: what `relicv2 shards verify` finds by comparing the index with the tar's, cheaply."""
    for ref in samples:
        for _, offset, size, name in ref.entries:
            if not header_fits(handle.fileno(), offset, size, name):
                raise IndexFileError(f"{index}: lists member {name[:80]!r} at byte {offset} ({size} bytes), where no "
                                     f"header of {ref.tar.name} puts it; {INDEX_FIX}")


def locate_samples(tar: Path, report: ReadReport, *, index: Path | None = None,
                   limits: ImageLimits = DEFAULT_LIMITS) -> list[SampleRef]:
    """The samples of one tar the policy accepts, in order, located (nothing but headers read);
    rejections in `report`. Raises IndexFileError (a ValueError naming the file) for an index that
    does not fit its tar, TarReadError for a tar that cannot be read at all."""
    return [ref for _, ref in _located(tar, index, limits, report)]


def read_samples(tar: Path, report: ReadReport, *, index: Path | None = None,
                 limits: ImageLimits = DEFAULT_LIMITS) -> Iterator[Sample]:
    """The samples of one tar read whole (`locate_samples`, then each member's bytes and the json
    policy), in order. A tar that cannot be read, or whose index does not fit it, is a lost shard in
    `report`; nothing raises."""
    scanned = index is None  # the members' places come from the tar's own headers, read just now
    try:
        try:
            refs = _located(tar, index, limits, report)
        except IndexFileError:
            # An index that does not fit its tar (a tar cut short, an index of another tar): the tar's
            # own headers give every complete sample, and name the loss.
            refs, scanned = _located(tar, None, limits, report), True
        handle = open(tar, "rb")  # noqa: SIM115 (closed below)
    except (TarReadError, IndexFileError, OSError) as exc:
        report.lose_shard(tar, str(exc))
        return
    with handle:
        for position, ref in refs:
            members = {}
            for ext, (offset, size, name) in ref.members.items():
                data = read_indexed_member(handle.fileno(), offset, size, header_read=scanned, name=name)
                if data is None:
                    report.lose_shard(tar, f"changed while it was read, at member {name!r}; rerun" if scanned else
                                      f"its index {index} does not describe it at member {name!r}; {INDEX_FIX}")
                    return
                members[ext] = data
            key = split_member_name(name)[0]  # folders kept: they name outputs
            reason, meta = json_problem(members[META_MEMBER], limits) if META_MEMBER in members else (None, {})
            if reason is not None:
                report.reject(tar, key, reason, meta)
                continue
            report.samples += 1
            yield Sample(key, tar, position, members, meta, class_index(members.get(LABEL_MEMBER)))


def list_shards(directory: Path) -> list[Path]:
    """The shard tars of a folder (`*-NNNNNN.tar`, 4-6 digits), sorted by name."""
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"shard folder {directory} does not exist; check the path")
    try:
        return shard_tars(directory)[0]
    except ShardSetError as exc:  # a folder without shards
        raise FileNotFoundError(str(exc)) from None


def iter_samples(
    source: Spec,
    *,
    report: ReadReport,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> Iterator[dict]:
    """Iterate the samples of a shard folder, a tar, a brace pattern, a list of tars or a resolved set
    (`shards.ShardSet`, whose manifest is then used, and the tars its resolution lost first), in shard order.

    Each item: `key`, `image` (bytes of the jpg/jpeg/png/webp member), `image_ext` (its member name),
    `label` (a class index, or None: no `cls`, or one holding a class name, then kept as `label_text`),
    `meta` (the json), `shard` (tar path) and every other member by extension, e.g. `"mask.png"`
    (the image too, under its own name). Each tar is read through the `.idx` beside it, or an index
    derived from its headers. Bad shards and samples are recorded in `report` (required: a loss is
    never silent) and skipped. With a folder holding a manifest, the count read is checked against it.
    No node or worker splitting: callers that run on several ranks pass each its own tars.
    """
    try:
        tars, directory = shard_tars(source)
    except ShardSetError as exc:
        raise FileNotFoundError(str(exc)) from None
    if isinstance(source, ShardSet):  # the tars its resolution lost are read first (shard_tars), or lost here
        report.lost_shards += [(str(tar), why) for tar, why in source.lost if not tar.is_file()]
        if source.manifest is not None:
            report.expected = (report.expected or 0) + source.manifest.num_rows
    elif directory is not None and (directory / MANIFEST_NAME).is_file():
        try:
            names = read_manifest(directory).column("shard").to_pylist()
        except (OSError, ValueError, KeyError) as exc:
            report.lose_shard(directory / MANIFEST_NAME, f"manifest cannot be read ({exc})")
        else:
            report.expected = (report.expected or 0) + len(names)
            for name in sorted(set(names) - {t.name for t in tars}):
                report.lose_shard(directory / name, "listed in the manifest but missing")
    for tar in tars:
        report.shards += 1
        beside = index_path(tar)
        for sample in read_samples(tar, report, index=beside if beside.is_file() else None, limits=limits):
            yield sample.as_dict()
