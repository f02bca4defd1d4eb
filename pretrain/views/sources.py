"""The samples a view loader reads: a shard set's index, checked, split by rank.

Bad-data policy (the DALI decoder stops the whole pipeline on an undecodable JPEG, so bad samples
must never reach it):
1. `relicv2 shards build` decodes every image before writing it, so a fresh shard set is clean.
2. When a loader opens a shard set, every sample is checked cheaply from its index: exactly one
   image member (`IMAGE_MEMBERS`) must exist, be non-empty and carry its format's signature and
   end marker (catches truncated, empty and mislabelled data); a `mask.png` member, when present,
   must carry the PNG signature; no member may exceed `max_member_bytes`. In a set without a
   manifest (another tool's), the image's and mask's headers are read too and pictures over
   `max_pixels` are left out ("too_large"), so a decompression bomb never reaches a decoder (sets
   from `shards build` and `saliency build-masks` were checked when written). `verify="decode"`
   additionally decodes every image and mask with the same decoder as DALI (exact, but as slow as
   an epoch of decoding).
3. Failing samples are left out of a filtered copy of the index files (the tars are not touched),
   counted by reason in `SampleSet.skipped`, and reported once as a warning with a few keys.
4. If DALI still fails to decode during a run (corruption the cheap check cannot see), the DALI
   backend decodes every sample once to find the culprits, leaves them out as in 3 and rebuilds
   its pipeline at the same batch of the epoch (see `DaliBackend`). The left-out keys are part of
   the loader's state, so a resumed run leaves them out too.
An index file that does not describe its tar (offsets or sizes outside it, unsafe member names,
garbage fields) is refused with one error naming the file: it was not written by this project's
`shards.write_index`, and trusting it would read arbitrary bytes.
A sample without a `mask.png` member is valid: it is never masked (counted in `without_mask`).
A `cls` member that is not a class index (a class name, as some WebDataset tools write) leaves the
sample unlabelled: pretraining does not need labels; evaluation refuses such a set
(`require_class_labels`).
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shards import index_path, read_index, resolve_shard_set
from shards.images import header_problem
from shards.index import IndexFileError, entries_key, format_index, split_member_name
from shards.keys import UnsafeKeyError, check_key
from shards.limits import DEFAULT_LIMITS
from shards.progress import tracked
from shards.sample import (
    IMAGE_MEMBERS,
    LABEL_MEMBER,
    MASK_MEMBER,
    class_index,
    image_member_name,
    label_text,
    missing_label,
)
from shards.tario import member_file

PROGRESS_FROM = 100_000  # samples: a set this large takes seconds to check (a minute with headers)
# (leading signature, trailing end marker) per image format; WebP has no end marker but a RIFF size.
JPEG_SOI, JPEG_EOI = b"\xff\xd8", b"\xff\xd9"
PNG_SIGNATURE, PNG_IEND = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


@dataclass(frozen=True)
class SampleRef:
    """Where one sample's members are: the tar and, per extension, (offset, size, member name)."""

    key: str
    tar: Path
    members: dict[str, tuple[int, int, str]]

    @property
    def image_ext(self) -> str | None:
        """The extension of the sample's image member (one of IMAGE_MEMBERS), or None."""
        return image_member_name(self.members)

    def read_image(self) -> bytes | None:
        """The bytes of the image member, whatever its format."""
        ext = self.image_ext
        return None if ext is None else self.read(ext)

    @property
    def label(self) -> int | None:
        """The sample's class index, or None (no `cls` member, or one that is not a class index)."""
        return class_index(self.read(LABEL_MEMBER))

    def read(self, ext: str) -> bytes | None:
        """The bytes of member `ext`, or None when the sample has no such member."""
        if ext not in self.members:
            return None
        offset, size, _ = self.members[ext]
        with open(self.tar, "rb") as f:
            return os.pread(f.fileno(), size, offset)


@dataclass
class SampleSet:
    """The usable samples of a shard set in reader order, and the index files that list them."""

    directory: Path  # the set's folder (of its first tar for a pattern or a list)
    tars: list[Path]  # the tars the index files list (without tars left empty by filtering)
    index_files: list[Path]
    samples: list[SampleRef]
    skipped: Counter = field(default_factory=Counter)
    skipped_keys: list[str] = field(default_factory=list)
    all_tars: list[Path] = field(default_factory=list)  # every tar of the set, filtered or not
    has_masks: bool = False
    without_mask: int = 0  # usable samples that have no mask member (never masked)
    _tmp: tempfile.TemporaryDirectory | None = None  # owns filtered index files

    def __len__(self) -> int:
        return len(self.samples)


def samples_per_rank(count: int, world_size: int) -> int:
    """Samples each rank delivers per epoch (`ViewSource.epoch_size`): the smallest rank's share.

    Rounded down so that every rank runs the same number of batches and no rank ever delivers
    one of the reader's padding duplicates.
    """
    return count // world_size


def reader_samples_per_rank(count: int, world_size: int) -> int:
    """Samples DALI's reader yields per rank and epoch with `pad_last_batch` (the largest share)."""
    return -(-count // world_size)


def structural_problem(sample: SampleRef, handle, headers: bool = False) -> str | None:
    """A short reason code when the sample's members are visibly broken, else None.

    `headers`: also read the image's and the mask's headers (a few hundred bytes each) and refuse
    pictures over `DEFAULT_LIMITS.max_pixels` before any decoder sees them (sets from other tools;
    `shards build` and `saliency build-masks` checked theirs when writing them).
    """
    images = [ext for ext in IMAGE_MEMBERS if ext in sample.members]
    if not images:
        return "no_image"
    if len(images) > 1:
        return "several_images"  # DALI's reader would refuse the sample: which one is the image?
    if any(size > DEFAULT_LIMITS.max_member_bytes for _, size, _ in sample.members.values()):
        return "too_large"
    offset, size, _ = sample.members[images[0]]
    if size < 12:
        return "empty_image"
    head = os.pread(handle.fileno(), 12, offset)
    tail = os.pread(handle.fileno(), 8, offset + size - 8)
    kind = image_format(head)
    if kind is None:
        return "not_an_image"
    if kind == "jpeg" and not tail.endswith(JPEG_EOI):
        return "truncated_image"
    if kind == "png" and tail != PNG_IEND:
        return "truncated_image"
    if kind == "webp" and int.from_bytes(head[4:8], "little") + 8 > size:
        return "truncated_image"
    if MASK_MEMBER in sample.members:
        offset, size, _ = sample.members[MASK_MEMBER]
        if size < len(PNG_SIGNATURE) or os.pread(handle.fileno(), len(PNG_SIGNATURE), offset) != PNG_SIGNATURE:
            return "bad_mask"
    if headers:
        for ext in (images[0], MASK_MEMBER):
            if ext in sample.members:
                rejection = header_problem(member_file(handle, *sample.members[ext][:2]))
                if rejection is not None:
                    return rejection.reason if ext != MASK_MEMBER else "bad_mask"
    return None


def image_format(head: bytes) -> str | None:
    """"jpeg", "png" or "webp" from an image's first 12 bytes (its content, not its member name)."""
    if head.startswith(JPEG_SOI):
        return "jpeg"
    if head.startswith(PNG_SIGNATURE):
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return None


def index_samples(tar: Path, idx: Path) -> list[SampleRef]:
    """The samples an index file lists, each checked against its tar; ValueError naming `idx` if hostile.

    Offsets and sizes must lie inside the tar, and keys and member names must be safe relative
    names (`shards.keys.check_key`), with every member of a sample sharing its key.
    """
    fix = f"rewrite it with shards.write_index({tar.name}) (or rebuild the shard set)"
    try:
        entries_per_sample = read_index(idx)
    except IndexFileError:
        raise  # already one line naming the file and the fix
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise ValueError(f"{idx} is not a valid DALI index ({exc}); {fix}") from None
    tar_size = tar.stat().st_size
    refs = []
    for number, entries in enumerate(entries_per_sample):
        if not entries:
            raise ValueError(f"{idx}: sample {number} lists no member; {fix}")
        key = entries_key(entries)
        members = {}
        for ext, offset, size, name in entries:
            if offset < 0 or size < 0 or offset + size > tar_size:
                raise ValueError(
                    f"{idx}: member {name[:80]!r} claims bytes {offset}..{offset + size} of a {tar_size}-byte tar; {fix}"
                )
            try:
                check_key(name)
            except UnsafeKeyError as exc:
                raise ValueError(f"{idx}: {exc}; {fix}") from None
            member_key, member_ext = split_member_name(name)
            if member_key.rsplit("/", 1)[-1] != key or member_ext != ext:
                raise ValueError(f"{idx}: member {name[:80]!r} does not belong to sample {key!r} as {ext!r}; {fix}")
            members[ext] = (offset, size, name)
        refs.append(SampleRef(key, tar, members))
    return refs


def load_sample_set(
    spec: Path | str,
    *,
    decode_check: Callable[[Sequence[SampleRef]], dict[str, str]] | None = None,
    index_cache: Path | None = None,
) -> SampleSet:
    """Read and check a shard set; write filtered index files when samples must be left out.

    `spec` is anything `shards.resolve_shard_set` takes: a folder from `relicv2 shards build`
    (its manifest must agree with the index files), a folder of plain WebDataset tars (no manifest;
    missing `.idx` files are derived once into `index_cache`), a brace pattern or a tar.
    `decode_check(samples) -> {key: reason}` (e.g. `pretrain.views.dali.find_undecodable`) is run on the
    structurally sound samples when given.
    """
    shard_set = resolve_shard_set(spec, index_cache=index_cache)  # ShardSetError: one line naming the fix
    directory = shard_set.directory or shard_set.tars[0].parent
    tars = list(shard_set.tars)
    per_tar: list[list[SampleRef]] = []
    skipped: Counter = Counter()
    skipped_keys: list[str] = []
    headers = shard_set.manifest is None
    for tar, idx in tracked(zip(tars, shard_set.index_files, strict=True), f"checking the samples of {directory}",
                            len(tars), unit="tar", enabled=shard_set.samples >= PROGRESS_FROM):
        kept = []
        with open(tar, "rb") as handle:
            for ref in index_samples(tar, idx):
                reason = structural_problem(ref, handle, headers=headers)
                if reason is None:
                    kept.append(ref)
                else:
                    skipped[reason] += 1
                    skipped_keys.append(ref.key)
        per_tar.append(kept)
    if decode_check is not None:
        bad = decode_check([s for kept in per_tar for s in kept])
        for reason in bad.values():
            skipped[reason] += 1
        skipped_keys += sorted(bad)
        per_tar = [[s for s in kept if s.key not in bad] for kept in per_tar]
    samples = [s for kept in per_tar for s in kept]
    if not samples:
        raise ValueError(f"no usable samples in {spec} (left out: {dict(skipped)}); rebuild the shard set")
    sample_set = SampleSet(directory, tars, list(shard_set.index_files), samples, skipped, skipped_keys,
                           all_tars=list(tars))
    sample_set.has_masks = any(MASK_MEMBER in s.members for s in samples)
    sample_set.without_mask = sum(MASK_MEMBER not in s.members for s in samples)
    if skipped:
        warnings.warn(
            f"{directory}: left out {sum(skipped.values())} bad samples {dict(skipped)}, "
            f"e.g. {skipped_keys[:5]}; rebuild the shards to recover them",
            stacklevel=2,
        )
        write_filtered_indexes(sample_set, per_tar)
    return sample_set


def require_class_labels(samples: Sequence[SampleRef], source: Path | str) -> list[int]:
    """Every sample's class index; ValueError naming the first sample without one and the fix."""
    labels = []
    for sample in samples:
        label = sample.label
        if label is None:
            raw = sample.read(LABEL_MEMBER)
            what = missing_label(None if raw is None else label_text(raw))
            raise ValueError(
                f"{source}: sample {sample.key} in {sample.tar.name} has {what}; evaluation needs integer class "
                "labels: build the set with `relicv2 shards build` from a folder with class sub-folders"
            )
        labels.append(label)
    return labels


def exclude_samples(sample_set: SampleSet, bad: dict[str, str]) -> None:
    """Leave the samples named in `bad` ({key: reason}) out of the set and its index files."""
    bad = {k: r for k, r in bad.items() if k not in sample_set.skipped_keys}
    if not bad:
        return
    for reason in bad.values():
        sample_set.skipped[reason] += 1
    sample_set.skipped_keys += sorted(bad)
    sample_set.samples = [s for s in sample_set.samples if s.key not in bad]
    all_tars = sample_set.all_tars
    write_filtered_indexes(sample_set, [[s for s in sample_set.samples if s.tar == t] for t in all_tars], all_tars)


def write_filtered_indexes(
    sample_set: SampleSet, per_tar: list[list[SampleRef]], tars: list[Path] | None = None
) -> None:
    """Index files listing only the kept samples, in a temporary folder owned by the set.

    Tars left empty are dropped: DALI's reader rejects an index with no samples.
    """
    sample_set._tmp = tempfile.TemporaryDirectory(prefix="relicv2-index-")
    kept_tars, indexes = [], []
    for tar, kept in zip(sample_set.tars if tars is None else tars, per_tar, strict=True):
        if not kept:
            continue
        text = format_index([[(ext, *member) for ext, member in s.members.items()] for s in kept])
        path = Path(sample_set._tmp.name) / index_path(tar).name
        path.write_text(text, encoding="utf-8")
        kept_tars.append(tar)
        indexes.append(path)
    sample_set.tars, sample_set.index_files = kept_tars, indexes
