"""Reading shard sets back in Python: samples as dicts, with every lost shard and sample accounted for.

Tars are opened by the project itself (shards.tario): never through a URL opener, so no shard
path can run a `pipe:` command; compressed tars, link/device members, unsafe names and oversized
members are refused with a reason. Pass a :class:`ReadReport` to learn what was lost (truncated
or unreadable shards, refused members, samples without an image, counts short of the manifest)
so a job can exit non-zero; without one, each loss is a warning.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from shards.index import split_member_name
from shards.limits import DEFAULT_LIMITS, ImageLimits
from shards.manifest import MANIFEST_NAME, read_manifest
from shards.sample import (
    GENERATED_MEMBERS,
    IMAGE_MEMBERS,
    LABEL_MEMBER,
    class_index,
    image_member_name,
    label_text,
)
from shards.shardset import SHARD_PATTERN, ShardSetError, list_shard_files, shard_tars
from shards.tario import Member, Skipped, TarReadError, iter_tar

__all__ = ["SHARD_PATTERN", "ReadReport", "iter_samples", "list_shards"]


@dataclass
class ReadReport:
    """What a read delivered and what it lost, filled in while iterating.

    lost_shards: (tar, reason) for tars that could not be read, or were read only in part.
    rejected: (tar, member or key, reason) for members and samples left out.
    expected: samples the manifest lists for the tars read (None without a manifest).
    """

    shards: int = 0
    samples: int = 0
    lost_shards: list[tuple[str, str]] = field(default_factory=list)
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    expected: int | None = None

    @property
    def missing(self) -> int:
        """Samples the manifest lists that were not delivered (0 without a manifest)."""
        return max(0, self.expected - self.samples) if self.expected is not None else 0

    @property
    def ok(self) -> bool:
        """Nothing was lost."""
        return not self.lost_shards and not self.rejected and not self.missing

    def summary(self) -> str:
        """One line: delivered, lost, and the first few losses by name."""
        text = f"{self.samples} samples read from {self.shards} shard(s)"
        if self.expected is not None:
            text += f" (manifest: {self.expected})"
        if self.ok:
            return text
        lost = [f"{Path(t).name}: {r}" for t, r in self.lost_shards[:3]]
        lost += [f"{Path(t).name}/{m}: {r}" for t, m, r in self.rejected[: max(0, 3 - len(lost))]]
        return (
            f"{text}; lost {len(self.lost_shards)} shard(s), {len(self.rejected)} member(s)/sample(s), "
            f"{self.missing} sample(s) short of the manifest; e.g. " + "; ".join(lost)
        )

    def _lose_shard(self, tar: Path, reason: str, warn: bool) -> None:
        self.lost_shards.append((str(tar), reason))
        if warn:
            warnings.warn(f"lost shard data in {tar}: {reason}", stacklevel=4)

    def _reject(self, tar: Path, name: str, reason: str, warn: bool) -> None:
        self.rejected.append((str(tar), name, reason))
        if warn:
            warnings.warn(f"skipped {name!r} in {tar}: {reason}", stacklevel=4)


def list_shards(directory: Path, prefix: str | None = None) -> list[Path]:
    """The shard tars of a folder (`*-NNNNNN.tar`, 4-6 digits; optionally of one prefix), sorted by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"shard folder {directory} does not exist; check the path")
    tars = [p for p in list_shard_files(directory) if prefix is None or p.name.startswith(prefix + "-")]
    if not tars:
        what = f"{prefix}-NNNNNN.tar" if prefix else "*-NNNNNN.tar"
        raise FileNotFoundError(f"no shards ({what}) in {directory}; build them with relicv2 shards build")
    return tars


def image_member(members: dict[str, bytes]) -> tuple[str, bytes] | None:
    """The image of a sample: the first member named like an image (jpg, jpeg, png, webp), or None."""
    ext = image_member_name(members)
    return None if ext is None else (ext, members[ext])


def make_sample(tar: Path, key: str, members: dict[str, bytes]) -> dict:
    """A sample dict from its members; raises ValueError with the reason for an unusable sample."""
    image = image_member(members)
    if image is None:
        raise ValueError(f"no image member (one of {', '.join(IMAGE_MEMBERS)}; has {', '.join(sorted(members))})")
    label = class_index(members.get(LABEL_MEMBER))
    try:
        meta = json.loads(members["json"]) if "json" in members else {}
    except ValueError as exc:
        raise ValueError(f"json member is not valid JSON ({exc})") from None
    sample = {"key": key, "shard": str(tar), "label": label, "meta": meta, "image_ext": image[0], "image": image[1]}
    if label is None and LABEL_MEMBER in members:  # a class name (other tools write them): kept, unlabelled
        sample["label_text"] = label_text(members[LABEL_MEMBER])
    for name, value in members.items():
        if name not in GENERATED_MEMBERS:
            sample[name] = value
    return sample


def _tar_samples(tar: Path, limits: ImageLimits, report: ReadReport, warn: bool) -> Iterator[dict]:
    key: str | None = None
    members: dict[str, bytes] = {}
    seen: set[str] = set()

    def finish() -> Iterator[dict]:
        if key is None:
            return
        try:
            sample = make_sample(tar, key, members)
        except ValueError as exc:
            report._reject(tar, key, str(exc), warn)
            return
        report.samples += 1
        yield sample

    try:
        for item in iter_tar(tar, limits):
            if isinstance(item, Skipped):
                if item.name is None:
                    report._lose_shard(tar, item.detail, warn)
                else:
                    report._reject(tar, item.name, item.detail, warn)
                continue
            assert isinstance(item, Member) and item.data is not None
            k, ext = split_member_name(item.name)
            if not k or k.endswith("/") or not ext:
                continue  # hidden files and extension-less members are not sample members
            if k != key:
                yield from finish()
                if k in seen:
                    report._reject(tar, k, "members of this sample are not adjacent; later ones left out", warn)
                    key, members = None, {}
                    continue
                seen.add(k)
                key, members = k, {}
            members[ext] = item.data
        yield from finish()
    except TarReadError as exc:
        report._lose_shard(tar, str(exc), warn)


def iter_samples(
    source: str | Path | Sequence[str | Path],
    *,
    report: ReadReport | None = None,
    limits: ImageLimits = DEFAULT_LIMITS,
) -> Iterator[dict]:
    """Iterate the samples of a shard folder, a tar, a brace pattern or a list of tars, in shard order.

    Each item: `key`, `image` (bytes of the jpg/jpeg/png/webp member), `image_ext` (its member name),
    `label` (a class index, or None: no `cls`, or one holding a class name, then kept as `label_text`),
    `meta` (the json dict), `shard` (tar path) and every other member by extension, e.g. `"mask.png"`
    (the image too, under its own name). Bad shards and samples are recorded in `report` (warnings when
    None) and skipped. With a folder holding a manifest, the count read is checked against it.
    No node or worker splitting: callers that run on several ranks pass each its own tars.
    """
    warn = report is None
    report = ReadReport() if report is None else report
    try:
        tars, directory = shard_tars(source)
    except ShardSetError as exc:
        raise FileNotFoundError(str(exc)) from None
    if directory is not None and (directory / MANIFEST_NAME).is_file():
        try:
            names = read_manifest(directory).column("shard").to_pylist()
        except (OSError, ValueError, KeyError) as exc:
            report._lose_shard(directory / MANIFEST_NAME, f"manifest cannot be read ({exc})", warn)
        else:
            report.expected = (report.expected or 0) + len(names)
            for name in sorted(set(names) - {t.name for t in tars}):
                report._lose_shard(directory / name, "listed in the manifest but missing", warn)
    for tar in tars:
        report.shards += 1
        yield from _tar_samples(tar, limits, report, warn)
    if warn and report.missing:
        warnings.warn(f"{directory}: {report.summary()}", stacklevel=2)
