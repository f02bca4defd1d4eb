"""Images as the view pipeline sees them, resized squares for the network, and seeded sampling from shards.

Orientation: DALI's image decoder applies the EXIF orientation tag (`adjust_orientation`, on by
default), so a mask must be computed on the displayed image and stored at the displayed size, or
image and mask disagree in training. Decoding goes through the project's one image loader
(`shards.images`), which applies the orientation and the pixel limits.
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np

from shards.images import ImageLoadError, exif_orientation, load_rgb
from shards.index import read_index
from shards.keys import UnsafeKeyError, check_key
from shards.sample import (
    IMAGE_MEMBERS,
    KEY_PATTERN,
    LABEL_MEMBER,
    image_member_name,
    read_class_index,
)
from shards.shardset import resolve_shard_set

# A shard sample whose image cannot be decoded (a ValueError); the message names the sample and the
# reason. The loader's own error, so callers catching either catch both.
SampleDecodeError = ImageLoadError


def decode_displayed(data: bytes, name: str) -> np.ndarray:
    """Encoded image bytes -> uint8 [H, W, 3] RGB in the displayed orientation (EXIF applied);
    :class:`SampleDecodeError` names `name`."""
    return load_rgb(data, name)


def has_rotation(data: bytes) -> bool:
    """True when the image carries an EXIF orientation other than 1 (its pixels are stored rotated)."""
    return exif_orientation(data) != 1


def resize_square(rgb: np.ndarray, size: int) -> np.ndarray:
    """uint8 [H, W, 3] -> uint8 [size, size, 3], bicubic (docs/design.md: fixed square input, no augmentation)."""
    return cv2.resize(rgb, (size, size), interpolation=cv2.INTER_CUBIC)


def resize_map(values: np.ndarray, width: int, height: int) -> np.ndarray:
    """A float map to (height, width), bilinear."""
    return cv2.resize(np.asarray(values, dtype=np.float32), (width, height), interpolation=cv2.INTER_LINEAR)


def member_key(name: str) -> str:
    """The sample key of a tar member name as webdataset and DALI see it: everything before the
    first dot of the base name, folders included (`a/b.c.jpg` -> `a/b`). Untrusted: callers
    validate it with `shards.keys.check_key` before it names anything."""
    folder, _, base = name.rpartition("/")
    stem = base.split(".", 1)[0]
    return f"{folder}/{stem}" if folder else stem


@dataclass(frozen=True)
class SampleLocation:
    """Where a sample's image lies: tar, byte offset and size of its image member, that member's
    name (one of IMAGE_MEMBERS), and its label (None without a readable `cls`)."""

    key: str
    tar: Path
    offset: int
    size: int
    label: int | None
    ext: str = "jpg"


def _locations(tar: Path, index_file: Path) -> list[SampleLocation]:
    """Every sample of one tar with an image member, from its DALI index; keys validated."""
    out = []
    with open(tar, "rb") as handle:
        for entries in read_index(index_file, tar):
            members = {ext: (off, size) for ext, off, size, _ in entries}
            key = member_key(entries[0][3])
            try:
                check_key(key)
                if not KEY_PATTERN.fullmatch(key):
                    raise UnsafeKeyError(f"key {key!r} is not 1-80 characters of [A-Za-z0-9_-]")
            except UnsafeKeyError:
                print(f"saliency: skipping a sample of {tar.name} with an unusable key {key!r}", file=sys.stderr)
                continue  # a hostile name never becomes a file name
            image = image_member_name(members)
            if image is None:
                continue
            label = read_class_index(handle, *members[LABEL_MEMBER]) if LABEL_MEMBER in members else None
            out.append(SampleLocation(key, tar, *members[image], label, image))
    return out


def sample_locations(shards: Path | str, count: int, seed: int, *, index_cache: Path | None = None) -> list[SampleLocation]:
    """`count` samples drawn without replacement (seeded) from a shard set; all when it has fewer.

    `shards`: a folder (ours, or plain WebDataset tars without manifest or index), a brace pattern
    or a tar; indexes missing beside the tars are derived once into `index_cache`
    (`shards.shardset.resolve_shard_set`). Raises ValueError naming the set when it holds no image.
    """
    shard_set = resolve_shard_set(shards, index_cache=index_cache)
    everything = [loc for tar, idx in zip(shard_set.tars, shard_set.index_files, strict=True)
                  for loc in _locations(tar, idx)]
    if not everything:
        raise ValueError(f"{shards} holds no samples with an image member ({', '.join(IMAGE_MEMBERS)})")
    chosen = sorted(random.Random(seed).sample(range(len(everything)), min(count, len(everything))))
    return [everything[i] for i in chosen]


def read_member(location: SampleLocation) -> bytes:
    with open(location.tar, "rb") as handle:
        return os.pread(handle.fileno(), location.size, location.offset)
