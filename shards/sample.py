"""One sample of a shard set, and the rules its key and member names follow (docs/design.md, Formats)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Container
from dataclasses import dataclass, field

# Keys become tar member names `{key}.{ext}`; webdataset and DALI split a name at its first dot,
# and ustar headers hold 100 bytes, so keys are short ASCII words without dots.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,80}")
EXT_PATTERN = re.compile(r"[a-z0-9_]+(\.[a-z0-9_]+)*")
# Member names an image may have in a sample, in order of preference: what `shards build` writes
# (jpg) and what other WebDataset tools write. The one list every reader uses.
IMAGE_MEMBERS = ("jpg", "jpeg", "png", "webp")
# The saliency mask member (`saliency build-masks`): 8-bit, at the image's displayed size (EXIF
# orientation applied) or a scaled copy of it.
MASK_MEMBER = "mask.png"
# A mask covering less of its image than this is written but never applied in pretraining (too little
# foreground to remove the background around): build-masks counts them, the views skip them.
MIN_MASK_COVERAGE = 0.05
# A soft mask's pixel at or above this level is foreground wherever a mask is binarised (coverage, the
# backgrounds test's composites).
MASK_FOREGROUND_LEVEL = 128
# A `cls` member holds a class index in ASCII decimal (what `shards build` writes); other WebDataset
# tools also write class names there, which readers keep as unlabelled rather than refuse.
LABEL_MEMBER = "cls"
MAX_LABEL_BYTES = 20  # a class index with room for whitespace; anything longer is not one
MAX_CLASS_DIGITS = 9  # a longer number is no class index (and overflows the integers a loader or head uses)
META_MEMBER = "json"
GENERATED_MEMBERS = (LABEL_MEMBER, META_MEMBER)  # written by the writer from `label` and `meta`
# Every member some job of the project reads; the reader counts and lists the others as unused.
USED_MEMBERS = (*IMAGE_MEMBERS, MASK_MEMBER, *GENERATED_MEMBERS)


def image_member_name(members: Container[str]) -> str | None:
    """The member holding a sample's image: the first of IMAGE_MEMBERS among `members`, or None."""
    return next((ext for ext in IMAGE_MEMBERS if ext in members), None)


def label_text(raw: bytes) -> str:
    """A `cls` member as text for messages and metadata (class names are kept, not refused)."""
    return raw.decode("utf-8", "replace").strip()[:200]


def label_refusal(sample: str, text: str | None, who: str) -> str:
    """Why `who` refuses `sample` (its key, and where it is) that has no class index, and the fix: one
    sentence; `text` is its `cls` member's text (None: it has none)."""
    what = "no class label (.cls)" if text is None else f"cls {text[:40]!r}, not a class index"
    return (f"sample {sample} has {what}; {who} needs integer class labels: build the set with "
            "`relicv2 shards build` from a folder with class sub-folders")


def class_index(raw: bytes | None) -> int | None:
    """The class index a `cls` member holds, or None (no member, empty, or not a decimal number of at most
    MAX_CLASS_DIGITS digits)."""
    if raw is None or len(raw) > MAX_LABEL_BYTES:
        return None
    text = raw.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= MAX_CLASS_DIGITS else None


@dataclass(frozen=True)
class ShardSample:
    """A sample to write: `key`, image and other members by extension, class index, json metadata.

    `members` maps an extension to bytes, e.g. {"jpg": ..., "mask.png": ...}; the writer adds
    `{key}.cls` from `label` (absent when None) and `{key}.json` from `meta` itself.
    `meta` must be JSON-serialisable; its scalar entries (width, height, source, status, mask
    coverage, ...) also become manifest columns.
    """

    key: str
    members: dict[str, bytes]
    label: int | None = None
    meta: dict = field(default_factory=dict)


def unwritable_key(key: str) -> str | None:
    """Why `key` cannot name a sample this project writes (KEY_PATTERN), or None."""
    return None if KEY_PATTERN.fullmatch(key) else f"key {key!r} is not 1-80 characters of [A-Za-z0-9_-]"


def check_sample(sample: ShardSample) -> None:
    """Raise ValueError naming the sample when its key or members break the format rules."""
    if (problem := unwritable_key(sample.key)) is not None:
        raise ValueError(f"sample {problem}; normalise it (shards.sources.normalise_stem does) before writing")
    if not sample.members:
        raise ValueError(f"sample {sample.key!r} has no members")
    for ext, data in sample.members.items():
        if ext in GENERATED_MEMBERS:
            raise ValueError(
                f"sample {sample.key!r}: member {ext!r} is generated from label/meta; do not pass it"
            )
        if not EXT_PATTERN.fullmatch(ext):
            raise ValueError(f"sample {sample.key!r}: member extension {ext!r} is not lower-case [a-z0-9_.]")
        if not isinstance(data, bytes | bytearray | memoryview):
            raise ValueError(f"sample {sample.key!r}: member {ext!r} is {type(data).__name__}, not bytes")
    if sample.label is not None and (isinstance(sample.label, bool) or not isinstance(sample.label, int)):
        raise ValueError(f"sample {sample.key!r}: label {sample.label!r} is not an int or None")


def sample_members(sample: ShardSample) -> list[tuple[str, bytes]]:
    """All members of a sample as (extension, bytes), sorted by extension: the order in the tar."""
    members = {ext: bytes(data) for ext, data in sample.members.items()}
    if sample.label is not None:
        members[LABEL_MEMBER] = str(sample.label).encode("ascii")
    try:
        members[META_MEMBER] = json.dumps(sample.meta, sort_keys=True, separators=(",", ":"),
                                          ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"sample {sample.key!r}: meta is not JSON-serialisable ({exc})") from exc
    return sorted(members.items())


def content_hash(members: list[tuple[str, bytes]]) -> str:
    """SHA-256 over a sample's members in tar order (extension, length, bytes): what verify recomputes."""
    h = hashlib.sha256()
    for ext, data in members:
        h.update(ext.encode("ascii") + b"\0" + len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()
