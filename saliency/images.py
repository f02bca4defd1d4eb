"""Reading images and masks, writing 8-bit saliency maps (atomically)."""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".tif", ".tiff", ".webp", ".ppm", ".pgm")


class ImageReadError(ValueError):
    """An input image could not be decoded; the message names the file."""


def _to_rgb_array(image: Image.Image) -> np.ndarray:
    # Greyscale JPEGs become 3 identical channels, as MATLAB's imread-based codes see them;
    # palette, CMYK, 16-bit and alpha images are flattened to plain RGB by PIL.
    return np.asarray(image.convert("RGB"), dtype=np.uint8)


def decode_rgb(data: bytes, name: str) -> np.ndarray:
    """Decode encoded image bytes (e.g. a shard's ``jpg``) to uint8 HxWx3 RGB."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return _to_rgb_array(image)
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise ImageReadError(f"{name}: cannot decode image ({error}); skip or replace it") from error


def read_rgb(path: Path | str) -> np.ndarray:
    """Read an image file as uint8 HxWx3 RGB; :class:`ImageReadError` names the bad file."""
    path = Path(path)
    try:
        with Image.open(path) as image:
            return _to_rgb_array(image)
    except FileNotFoundError as error:
        raise ImageReadError(f"{path}: file not found") from error
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise ImageReadError(f"{path}: cannot decode image ({error}); skip or replace it") from error


def read_gray(path: Path | str) -> np.ndarray:
    """Read a map or mask as uint8 HxW (colour files are converted to luminance)."""
    path = Path(path)
    try:
        with Image.open(path) as image:
            if image.mode in ("I;16", "I;16B", "I"):
                data = np.asarray(image, dtype=np.float64)
                top = data.max() if data.size and data.max() > 0 else 1.0
                return np.clip(np.rint(data / top * 255.0), 0, 255).astype(np.uint8)
            return np.asarray(image.convert("L"), dtype=np.uint8)
    except FileNotFoundError as error:
        raise ImageReadError(f"{path}: file not found") from error
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as error:
        raise ImageReadError(f"{path}: cannot decode image ({error})") from error


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
