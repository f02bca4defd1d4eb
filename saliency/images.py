"""Reading images and masks for saliency work, through shards' one image loader (writing: saliency.maps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from relicv2.shards.images import ImageLoadError, load_gray, load_rgb, read_bytes
from relicv2.shards.sources import IMAGE_EXTENSIONS

# Reading goes through the project's one image loader (shards.images): pixel limits checked from
# the header, EXIF orientation applied, 16-bit scaled, transparency over white, GIF/palette/CMYK to RGB.
ImageReadError = ImageLoadError
# Image bytes (e.g. a shard's image member) and the name errors give -> uint8 HxWx3 RGB as displayed.
decode_rgb = load_rgb


def read_rgb(path: Path | str) -> np.ndarray:
    """Read an image file as uint8 HxWx3 RGB as displayed; :class:`ImageReadError` names the bad file."""
    return load_rgb(read_bytes(path), str(path))


def read_gray(path: Path | str) -> np.ndarray:
    """Read a map or mask as uint8 HxW (colour converted to luminance; 16-bit scaled to its maximum)."""
    return load_gray(read_bytes(path), str(path))


def list_images(folder: Path | str) -> list[Path]:
    """Image files directly inside ``folder`` (by extension, case-insensitive), sorted by name."""
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
