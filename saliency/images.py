"""Image files of saliency work: images and masks read through shards' one image loader (pixel limits
checked from the header, EXIF orientation applied, 16-bit scaled, transparency over white, GIF/palette/CMYK
to RGB), and maps written as 8-bit single-channel PNGs through ``jobs.atomic`` (a killed job never leaves
a half-written map under a final name)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image

from relicv2.jobs.atomic import atomic_output
from relicv2.shards.images import load_gray, load_rgb, read_bytes
from relicv2.shards.keys import safe_relative_path
from relicv2.shards.sources import IMAGE_EXTENSIONS


def read_rgb(path: Path | str) -> np.ndarray:
    """Read an image file as uint8 HxWx3 RGB as displayed; ``shards.images.ImageLoadError`` names a bad file."""
    return load_rgb(read_bytes(path), str(path))


def read_gray(path: Path | str) -> np.ndarray:
    """Read a map or mask as uint8 HxW (colour converted to luminance; 16-bit scaled to its maximum)."""
    return load_gray(read_bytes(path), str(path))


def list_images(folder: Path | str) -> list[Path]:
    """Image files directly inside ``folder`` (by extension, case-insensitive), sorted by name."""
    folder = Path(folder)
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)


def map_to_uint8(saliency: np.ndarray) -> np.ndarray:
    """A [0, 1] float map as 8-bit (rounded, clipped, NaN -> 0)."""
    values = np.nan_to_num(np.asarray(saliency, dtype=np.float64), nan=0.0)
    return np.clip(np.rint(values * 255.0), 0, 255).astype(np.uint8)


def map_path(output: Path, method: str, name: str) -> Path:
    """Where the map of input ``name`` by ``method`` is written; :class:`UnsafeKeyError` when
    ``name`` (an untrusted shard key) would lead outside ``output/method``."""
    return safe_relative_path(Path(output) / method, name, ".png")


def write_png(path: Path | str, array: np.ndarray) -> None:
    """Write a uint8 HxW or HxWx3 array as a PNG, atomically (parent folders are created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(path) as temporary:
        # format given explicitly: the temporary name does not end in .png
        Image.fromarray(np.ascontiguousarray(array)).save(temporary, format="PNG")


def write_map(path: Path | str, saliency: np.ndarray) -> None:
    """Write a [0, 1] saliency map as an 8-bit single-channel PNG (atomically)."""
    write_png(path, map_to_uint8(saliency))
