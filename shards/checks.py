"""The cheap checks of a shard set's samples that keep bad data from a decoder, and their verdicts kept per tar.

The DALI decoder stops the whole pipeline on an undecodable image, so bad samples must never reach it.
Every tar's index first goes through the shard reader's one policy for bad members
(`shards.reader.locate_samples`); then every sample is checked cheaply (`structural_problem`: members,
image signatures and end markers, and in a set without a manifest the picture size from its header, so
a decompression bomb never reaches a decoder). A decode check (`pretrain.views.dali.find_undecodable`)
can be run on the sound samples as well: exact, but as slow as an epoch of decoding. The verdicts are
kept per tar in the index cache (`check_tar`); `shards.sample_set.load_sample_set` leaves the refused
samples out.
"""

from __future__ import annotations

import functools
import json
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from relicv2.jobs.atomic import atomic_write_bytes
from relicv2.shards.images import PNG_SIGNATURE, header_problem
from relicv2.shards.job import input_tar_identity
from relicv2.shards.limits import DEFAULT_LIMITS
from relicv2.shards.reader import ReadReport, SampleRef, check_in_place, locate_samples
from relicv2.shards.sample import IMAGE_MEMBERS, MASK_MEMBER
from relicv2.shards.shardset import (
    ShardSet,
    Spec,
    cache_name,
    default_index_cache,
    file_identity,
    in_workers,
    resolve_shard_set,
)
from relicv2.shards.tario import member_file

# (leading signature, trailing end marker) per image format; WebP has no end marker but a RIFF size.
JPEG_SOI, JPEG_EOI = b"\xff\xd8", b"\xff\xd9"
PNG_IEND = b"IEND\xaeB`\x82"


def structural_problem(sample: SampleRef, handle, headers: bool = False) -> str | None:
    """A short reason code when the sample's members are visibly broken, else None; with `headers`, also
    for pictures over `DEFAULT_LIMITS.max_pixels`, read from the headers of the image and the mask."""
    images = [ext for ext in IMAGE_MEMBERS if ext in sample.members]  # one at least: the reader refuses none
    if len(images) > 1:
        return "several_images"  # DALI's reader would refuse the sample: which one is the image?
    offset, size, _ = sample.members[images[0]]
    if size < 12:  # shorter than any image's header: nothing, or something else
        return "empty_image" if size == 0 else "not_an_image"
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


CHECK_VERSION = 3  # of `structural_problem`'s verdicts: bump it when they change, and cached ones are ignored
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
    index that does not fit its tar; the first check also reads the header of every member it lists:
    `shards.reader.check_in_place`); only the per-sample reads are cached. A cache that cannot be
    written is not an error (`stored` is then False).
    """
    report = ReadReport()
    samples = locate_samples(tar, report, index=idx)
    refused = [(name, code) for (_, name, _), code in zip(report.rejected, report.codes, strict=True)]
    decode = decode_check is not None
    path, identity, check = check_path(tar, idx, headers, cache, decode), input_tar_identity(tar, idx), checker(headers, decode)
    verdicts = _cached_verdicts(path, len(samples), identity, check)
    if verdicts is not None:
        return TarCheck(samples, verdicts, fresh=False, stored=True, refused=refused)
    with open(tar, "rb") as handle:
        check_in_place(handle, idx, samples)  # the index against the tar's headers: once, then cached
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


def _check_counts(tar: Path, idx: Path, **options) -> tuple[bool, bool, Counter]:
    check = check_tar(tar, idx, **options)
    return check.fresh, check.stored, Counter([*check.left_out.values(), *(code for _, code in check.refused)])


def resolve_checks(spec: Spec, index_cache: Path | None, decode_check: DecodeCheck | None,
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
    and `decode_foreign_only` as in `load_sample_set`. Tars checked before only have their index
    parsed and their verdicts read.
    """
    index, parts = part
    cache, shard_set, decode_check = resolve_checks(spec, index_cache, decode_check, decode_foreign_only)
    headers = shard_set.manifest is None
    tars, idxs = shard_set.tars[index::parts], shard_set.index_files[index::parts]
    desc = f"checking the samples of {len(shard_set.tars)} tars" + (f" (part {index + 1}/{parts})" if parts > 1 else "")
    decode = decode_check is not None
    progress = progress and any(not check_path(*pair, headers, cache, decode).is_file() for pair in zip(tars, idxs, strict=True))
    check = functools.partial(_check_counts, headers=headers, cache=cache, decode_check=decode_check)
    results = in_workers(check, tars, idxs, workers=workers, desc=desc, unit="tar", enabled=progress)
    left_out = sum((reasons for _, _, reasons in results), Counter())
    return SetCheck(len(shard_set.tars), sum(fresh for fresh, _, _ in results),
                    sum(not stored for _, stored, _ in results), left_out)
