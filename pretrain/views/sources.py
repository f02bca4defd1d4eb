"""The samples a view loader reads: a shard set's index, checked, split by rank.

Bad-data policy (the DALI decoder stops the whole pipeline on an undecodable JPEG, so bad samples
must never reach it):
1. `relicv2 shards build` decodes every image before writing it, so a fresh shard set is clean.
2. When a loader opens a shard set, every tar's index goes through the shard reader's one policy for
   bad members (`shards.reader.locate_samples`); then every sample is checked cheaply: exactly one
   image member (`IMAGE_MEMBERS`) must be non-empty and carry its format's signature and end marker
   (catches truncated, empty and mislabelled data); a `mask.png` member, when present, must carry
   the PNG signature. In a set without a manifest (another tool's), the image's and mask's headers
   are read too and pictures over `max_pixels` are left out ("too_large"), so a decompression bomb
   never reaches a decoder (sets from `shards build` and `saliency build-masks` were checked when
   written). `verify="decode"` additionally decodes every image and mask with the same decoder as
   DALI (exact, but as slow as an epoch of decoding).
3. Refused and failing samples are left out of a filtered copy of the index files (the tars are not
   touched), counted by reason in `SampleSet.skipped`, and reported once as a warning with a few keys.
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

import hashlib
import json
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.jobs.progress import tracked
from relicv2.jobs.workers import worker_pool
from relicv2.pretrain.views.sample_table import SampleRef, SampleTable, SampleTableBuilder
from relicv2.shards import ShardSet, index_path, resolve_shard_set
from relicv2.shards.images import header_problem
from relicv2.shards.index import format_index
from relicv2.shards.limits import DEFAULT_LIMITS
from relicv2.shards.reader import ReadReport, locate_samples
from relicv2.shards.sample import (
    IMAGE_MEMBERS,
    LABEL_MEMBER,
    MASK_MEMBER,
    label_text,
    missing_label,
)
from relicv2.shards.shardset import (
    INDEX_CACHE_ENV,
    Spec,
    cache_name,
    default_index_cache,
    file_identity,
)
from relicv2.shards.tario import member_file

PROGRESS_FROM = 100_000  # samples: a set this large takes seconds to check (a minute with headers)
DECODE_PROGRESS_FROM = 2_000  # samples: decoding them takes seconds
# (leading signature, trailing end marker) per image format; WebP has no end marker but a RIFF size.
JPEG_SOI, JPEG_EOI = b"\xff\xd8", b"\xff\xd9"
PNG_SIGNATURE, PNG_IEND = b"\x89PNG\r\n\x1a\n", b"IEND\xaeB`\x82"


@dataclass
class SampleSet:
    """The usable samples of a shard set in reader order, and the index files that list them."""

    source: ShardSet  # the set as the job resolved it: every tar, filtered or not
    tars: list[Path]  # the tars the index files list (without tars left empty by filtering)
    index_files: list[Path]
    samples: SampleTable
    skipped: Counter = field(default_factory=Counter)
    skipped_keys: list[str] = field(default_factory=list)
    has_masks: bool = False
    without_mask: int = 0  # usable samples that have no mask member (never masked)
    _tmp: tempfile.TemporaryDirectory | None = None  # owns filtered index files

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def directory(self) -> Path:
        """The set's folder (of its first tar for a pattern or a list)."""
        return self.source.directory or self.source.tars[0].parent


def samples_per_rank(count: int, world_size: int) -> int:
    """Samples each rank delivers per epoch (`ViewSource.epoch_size`): the smallest rank's share, so that
    every rank runs the same number of batches and none delivers one of the reader's padding duplicates."""
    return count // world_size


def structural_problem(sample: SampleRef, handle, headers: bool = False) -> str | None:
    """A short reason code when the sample's members are visibly broken, else None; with `headers`, also
    for pictures over `DEFAULT_LIMITS.max_pixels`, read from the headers of the image and the mask."""
    images = [ext for ext in IMAGE_MEMBERS if ext in sample.members]  # one at least: the reader refuses none
    if len(images) > 1:
        return "several_images"  # DALI's reader would refuse the sample: which one is the image?
    offset, size, _ = sample.members[images[0]]
    if size < 12:
        return "empty_image"
    head = os.pread(handle.fileno(), 12, offset)
    tail = os.pread(handle.fileno(), 8, offset + size - 8)
    if head.startswith(JPEG_SOI):  # the format from the image's content, not its member name
        truncated = not tail.endswith(JPEG_EOI)
    elif head.startswith(PNG_SIGNATURE):
        truncated = tail != PNG_IEND
    elif head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        truncated = int.from_bytes(head[4:8], "little") + 8 > size
    else:
        return "not_an_image"
    if truncated:
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


CHECK_VERSION = 2  # of `structural_problem`'s verdicts: bump it when they change, and cached ones are ignored
CHECKS_FOLDER = "checked"  # in the index cache: one JSON file of verdicts per checked tar


@dataclass(frozen=True)
class TarCheck:
    """The samples the shard reader accepts from an index (in order), those of them to leave out,
    {position: reason}, and those the reader refused, (key or member, reason)."""

    samples: list[SampleRef]
    left_out: dict[int, str]
    fresh: bool  # the samples were read now (else the verdicts came from the cache)
    stored: bool  # the verdicts are kept in the cache (read from it or written to it)
    refused: list[tuple[str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class SetCheck:
    """What `check_shard_set` did: tars of the set, tars of the part read now, tars whose verdicts
    could not be kept, and the samples the loaders will leave out of the part by reason."""

    tars: int
    fresh: int
    unstored: int
    left_out: Counter


DecodeCheck = Callable[[Sequence[SampleRef]], dict[str, str]]  # samples -> {key: reason} of those that fail to decode


def checker(headers: bool, decode: bool) -> str:
    """What a verdict depends on besides the tar: the check's version, its kind (headers read, images
    decoded) and the limits."""
    limits = f"{DEFAULT_LIMITS.max_member_bytes}/{DEFAULT_LIMITS.max_pixels}"
    return f"check v{CHECK_VERSION} headers={headers} decode={decode} limits={limits}"


def check_path(tar: Path, idx: Path, headers: bool, cache: Path, decode: bool = False) -> Path:
    """Where the verdicts on `tar`'s samples are kept: named after the tar, its index and the checker,
    so that a change to any of them means a new check."""
    return cache / CHECKS_FOLDER / f"{cache_name(tar, file_identity(idx), checker(headers, decode))}.json"


def tar_identity(tar: Path, idx: Path) -> dict:
    """What a kept verdict must name to be trusted: the tar's size and modification time and the
    digest of its index (a verdict file planted under the right name alone is not enough)."""
    stat = tar.stat()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "index_sha256": hashlib.sha256(Path(idx).read_bytes()).hexdigest()}


def _cached_verdicts(path: Path, count: int, identity: dict, check: str) -> dict[int, str] | None:
    """The verdicts kept at `path` for an index of `count` samples, when they name this tar's
    `identity` and this `check`; None otherwise (or the file is torn or not ours: the tar is then
    checked again)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if (not isinstance(data, dict) or data.get("samples") != count or not isinstance(data.get("left_out"), list)
            or data.get("identity") != identity or data.get("checker") != check):
        return None
    if not all(isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
               and 0 <= entry[0] < count and isinstance(entry[1], str) for entry in data["left_out"]):
        return None
    return dict(data["left_out"])


def check_tar(tar: Path, idx: Path, *, headers: bool, cache: Path, decode_check: DecodeCheck | None = None) -> TarCheck:
    """Check every sample of one tar with `structural_problem` (then `decode_check` on the sound
    ones when given), or read the verdicts a previous check kept in `cache` (any rank's or job's,
    on a shared folder); keep new verdicts there.

    The index is always parsed and checked against its tar by the shard reader (ValueError naming an
    index that does not fit its tar); only the per-sample reads are cached. A cache that cannot be
    written is not an error (`stored` is then False).
    """
    report = ReadReport()
    samples = locate_samples(tar, report, index=idx)
    refused = [(name, code) for (_, name, _), code in zip(report.rejected, report.codes, strict=True)]
    decode = decode_check is not None
    path, identity, check = check_path(tar, idx, headers, cache, decode), tar_identity(tar, idx), checker(headers, decode)
    verdicts = _cached_verdicts(path, len(samples), identity, check)
    if verdicts is not None:
        return TarCheck(samples, verdicts, fresh=False, stored=True, refused=refused)
    with open(tar, "rb") as handle:
        verdicts = {i: reason for i, ref in enumerate(samples)
                    if (reason := structural_problem(ref, handle, headers=headers)) is not None}
    if decode_check is not None:
        undecodable = decode_check([s for i, s in enumerate(samples) if i not in verdicts])
        verdicts.update({i: undecodable[s.key] for i, s in enumerate(samples) if i not in verdicts and s.key in undecodable})
    record = {"tar": str(tar), "identity": identity, "checker": check, "samples": len(samples),
              "left_out": sorted([i, r] for i, r in verdicts.items())}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(record).encode("utf-8"))
    except OSError:
        return TarCheck(samples, verdicts, fresh=True, stored=False, refused=refused)
    return TarCheck(samples, verdicts, fresh=True, stored=True, refused=refused)


def _check_tar_args(args: tuple[Path, Path, bool, Path, DecodeCheck | None]) -> tuple[bool, bool, Counter]:
    tar, idx, headers, cache, decode_check = args
    check = check_tar(tar, idx, headers=headers, cache=cache, decode_check=decode_check)
    return check.fresh, check.stored, Counter([*check.left_out.values(), *(code for _, code in check.refused)])


def _resolve(spec: Spec, index_cache: Path | None, decode_check: DecodeCheck | None,
             decode_foreign_only: bool) -> tuple[Path, ShardSet, DecodeCheck | None]:
    """The index cache, the resolved set and the decode check to run: none for a set from `shards build`
    or `saliency build-masks` with `decode_foreign_only` (they decoded every image when they wrote it)."""
    cache = default_index_cache(index_cache)
    shard_set = resolve_shard_set(spec, index_cache=cache)  # ShardSetError: one line naming the fix
    return cache, shard_set, None if decode_foreign_only and shard_set.manifest is not None else decode_check


def check_shard_set(
    spec: Spec, *, index_cache: Path | None = None, part: tuple[int, int] = (0, 1), workers: int = 1,
    progress: bool = True, decode_check: DecodeCheck | None = None, decode_foreign_only: bool = False,
) -> SetCheck:
    """Check the samples of part `index` of `parts` of the set's tars (every parts-th) ahead of
    the loaders, in `workers` processes, keeping the verdicts in the index cache; `decode_check`
    and `decode_foreign_only` as in `load_sample_set`.

    The ranks of a job each call it with their own part before a barrier, so that every tar is
    read once between them; `relicv2 shards index` calls it for the whole set. Tars checked before
    only have their index parsed and their verdicts read.
    """
    index, parts = part
    cache, shard_set, decode_check = _resolve(spec, index_cache, decode_check, decode_foreign_only)
    headers = shard_set.manifest is None
    todo = [(tar, idx, headers, cache, decode_check)
            for i, (tar, idx) in enumerate(zip(shard_set.tars, shard_set.index_files, strict=True)) if i % parts == index]
    desc = f"checking the samples of {len(shard_set.tars)} tars" + (f" (part {index + 1}/{parts})" if parts > 1 else "")
    progress = progress and any(not check_path(*args[:4], decode=decode_check is not None).is_file() for args in todo)
    if workers > 1 and len(todo) > 1:
        with worker_pool(min(workers, len(todo))) as pool:
            results = list(tracked(pool.map(_check_tar_args, todo), desc, len(todo), unit="tar", enabled=progress))
    else:
        results = [_check_tar_args(args) for args in tracked(todo, desc, len(todo), unit="tar", enabled=progress)]
    left_out = sum((reasons for _, _, reasons in results), Counter())
    return SetCheck(len(shard_set.tars), sum(fresh for fresh, _, _ in results),
                    sum(not stored for _, stored, _ in results), left_out)


def load_sample_set(spec: Spec, *, decode_check: DecodeCheck | None = None, decode_foreign_only: bool = False,
                    index_cache: Path | None = None) -> SampleSet:
    """Read and check a shard set; write filtered index files when samples must be left out.

    `spec` is anything `shards.resolve_shard_set` takes (a resolved `shards.ShardSet`, the job's one
    resolution, is used as it is; missing `.idx` files of plain tars are derived into `index_cache`).
    `decode_check(samples) -> {key: reason}` (e.g. `pretrain.views.dali.find_undecodable`) is run on
    the structurally sound samples when given; with `decode_foreign_only` only on sets without a
    manifest (sets from `shards build` and `saliency build-masks` decoded every image when writing it).
    The verdicts are kept per tar in the index cache (`check_tar`), so a restart, another rank
    or another job does not read or decode the samples again.
    """
    cache, shard_set, decode_check = _resolve(spec, index_cache, decode_check, decode_foreign_only)
    directory = shard_set.directory or shard_set.tars[0].parent
    tars = list(shard_set.tars)
    table = SampleTableBuilder()
    skipped: Counter = Counter()
    skipped_keys: list[str] = []
    headers = shard_set.manifest is None
    progress_from = PROGRESS_FROM if decode_check is None else DECODE_PROGRESS_FROM
    unstored = 0
    for tar, idx in tracked(zip(tars, shard_set.index_files, strict=True), f"checking the samples of {directory}",
                            len(tars), unit="tar", enabled=shard_set.samples >= progress_from):
        check = check_tar(tar, idx, headers=headers, cache=cache, decode_check=decode_check)
        left_out = [(check.samples[i].key, reason) for i, reason in sorted(check.left_out.items())]
        for name, reason in [*check.refused, *left_out]:
            skipped[reason] += 1
            skipped_keys.append(name)
        table.extend(s for i, s in enumerate(check.samples) if i not in check.left_out)
        unstored += not check.stored
    if unstored and shard_set.samples >= progress_from:
        warnings.warn(f"cannot keep the sample checks of {directory} in {cache / CHECKS_FOLDER}: every start "
                      f"checks the set again; set ${INDEX_CACHE_ENV} to a writable folder", stacklevel=2)
    samples = table.build()
    if not samples:
        raise ValueError(f"no usable samples in {spec} (left out: {dict(skipped)}); rebuild the shard set")
    sample_set = SampleSet(shard_set, tars, list(shard_set.index_files), samples, skipped, skipped_keys)
    masked = samples.with_member(MASK_MEMBER)
    sample_set.has_masks, sample_set.without_mask = bool(masked.any()), int((~masked).sum())
    if skipped:
        warnings.warn(f"{directory}: left out {sum(skipped.values())} bad samples {dict(skipped)}, "
                      f"e.g. {skipped_keys[:5]}; rebuild the shards to recover them", stacklevel=2)
        write_filtered_indexes(sample_set)
    return sample_set


def require_class_labels(samples: Sequence[SampleRef], source: Path | str) -> list[int]:
    """Every sample's class index; ValueError naming the first sample without one and the fix."""
    labels = []
    for sample in samples:
        label = sample.label
        if label is None:
            raw = sample.read(LABEL_MEMBER)
            what = missing_label(None if raw is None else label_text(raw))
            raise ValueError(f"{source}: sample {sample.key} in {sample.tar.name} has {what}; evaluation "
                             "needs integer class labels: build the set with `relicv2 shards build` from a "
                             "folder with class sub-folders")
        labels.append(label)
    return labels


def exclude_samples(sample_set: SampleSet, bad: dict[str, str]) -> None:
    """Leave the samples named in `bad` ({key: reason}) out of the set and its index files."""
    bad = {k: r for k, r in bad.items() if k not in sample_set.skipped_keys}
    if not bad:
        return
    sample_set.skipped.update(bad.values())
    sample_set.skipped_keys += sorted(bad)
    sample_set.samples = sample_set.samples.select([i for i, key in enumerate(sample_set.samples.keys())
                                                    if key not in bad])
    write_filtered_indexes(sample_set)


def write_filtered_indexes(sample_set: SampleSet) -> None:
    """Index files listing only the set's kept samples, in a temporary folder owned by the set.

    Tars left empty are dropped: DALI's reader rejects an index with no samples.
    """
    sample_set._tmp = tempfile.TemporaryDirectory(prefix="relicv2-index-")
    per_tar = sample_set.samples.by_tar()
    tars = [tar for tar in sample_set.source.tars if tar in per_tar]
    indexes = [Path(sample_set._tmp.name) / index_path(tar).name for tar in tars]
    for tar, path in zip(tars, indexes, strict=True):
        path.write_text(format_index([s.entries for s in per_tar[tar]]), encoding="utf-8")
    sample_set.tars, sample_set.index_files = tars, indexes
