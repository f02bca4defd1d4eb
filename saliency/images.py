"""Reading images and masks (through shards' one image loader), writing 8-bit saliency maps (atomically)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

from shards.images import ImageLoadError, load_gray, load_rgb, read_bytes
from shards.limits import DEFAULT_LIMITS, ImageLimits
from shards.sources import IMAGE_EXTENSIONS

# Reading goes through the project's one image loader (shards.images): pixel limits checked from
# the header, EXIF orientation applied, 16-bit scaled, transparency over white, GIF/palette/CMYK to RGB.
ImageReadError = ImageLoadError


def decode_rgb(data: bytes, name: str, *, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Decode encoded image bytes (e.g. a shard's image member) to uint8 HxWx3 RGB as displayed.

    :class:`ImageReadError` names ``name`` and the reason; ``limits.max_side`` downscales large images.
    """
    return load_rgb(data, name, limits)


def read_rgb(path: Path | str, *, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Read an image file as uint8 HxWx3 RGB as displayed; :class:`ImageReadError` names the bad file."""
    return load_rgb(read_bytes(path, limits), str(path), limits)


def read_gray(path: Path | str, *, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Read a map or mask as uint8 HxW (colour converted to luminance; 16-bit scaled to its maximum)."""
    return load_gray(read_bytes(path, limits), str(path), limits)


def map_to_uint8(saliency: np.ndarray) -> np.ndarray:
    """A [0, 1] float map as 8-bit (rounded, clipped, NaN -> 0)."""
    values = np.nan_to_num(np.asarray(saliency, dtype=np.float64), nan=0.0)
    return np.clip(np.rint(values * 255.0), 0, 255).astype(np.uint8)


def write_png(path: Path | str, array: np.ndarray) -> None:
    """Write a uint8 HxW or HxWx3 array as PNG under a temporary name, fsync, then rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png.tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            Image.fromarray(np.ascontiguousarray(array)).save(stream, format="PNG")
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def write_map(path: Path | str, saliency: np.ndarray) -> None:
    """Write a [0, 1] saliency map as an 8-bit single-channel PNG (atomically)."""
    write_png(path, map_to_uint8(saliency))


def list_images(folder: Path | str) -> list[Path]:
    """Image files directly inside ``folder`` (by extension, case-insensitive), sorted by name."""
    folder = Path(folder)
    return sorted(
        p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS
    )


__all__ = ["IMAGE_EXTENSIONS", "ImageReadError", "decode_rgb", "list_images", "map_to_uint8", "read_gray",
           "read_rgb", "write_map", "write_png"]
