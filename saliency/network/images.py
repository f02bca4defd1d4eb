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

from shards import index_path, list_shards, read_index
from shards.images import ImageLoadError, exif_orientation, load_rgb
from shards.keys import UnsafeKeyError, check_key
from shards.sample import KEY_PATTERN

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
    """uint8 [H, W, 3] -> uint8 [size, size, 3], bicubic (DESIGN.md: fixed square input, no augmentation)."""
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
    """Where a sample's image lies: tar, byte offset and size of its `jpg` member, its label."""

    key: str
    tar: Path
    offset: int
    size: int
    label: int | None


def _locations(tar: Path) -> list[SampleLocation]:
    """Every sample of one tar with a `jpg` member, from its DALI index; keys validated."""
    out = []
    with open(tar, "rb") as handle:
        for entries in read_index(index_path(tar)):
            members = {ext: (off, size) for ext, off, size, _ in entries}
            key = member_key(entries[0][3])
            try:
                check_key(key)
                if not KEY_PATTERN.fullmatch(key):
                    raise UnsafeKeyError(f"key {key!r} is not 1-80 characters of [A-Za-z0-9_-]")
            except UnsafeKeyError:
                print(f"saliency: skipping a sample of {tar.name} with an unusable key {key!r}", file=sys.stderr)
                continue  # a hostile name never becomes a file name
            if "jpg" not in members:
                continue
            label = None
            if "cls" in members:
                off, size = members["cls"]
                text = os.pread(handle.fileno(), size, off).decode("ascii", "replace").strip()
                label = int(text) if text.isdigit() else None
            out.append(SampleLocation(key, tar, *members["jpg"], label))
    return out


def sample_locations(shards: Path, count: int, seed: int) -> list[SampleLocation]:
    """`count` samples drawn without replacement (seeded) from a shard set; all when it has fewer."""
    everything = [loc for tar in list_shards(Path(shards)) for loc in _locations(tar)]
    if not everything:
        raise ValueError(f"{shards} holds no samples with a jpg member")
    chosen = sorted(random.Random(seed).sample(range(len(everything)), min(count, len(everything))))
    return [everything[i] for i in chosen]


def read_member(location: SampleLocation) -> bytes:
    with open(location.tar, "rb") as handle:
        return os.pread(handle.fileno(), location.size, location.offset)
