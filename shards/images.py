"""Decode-verify one input image and turn it into the bytes of a `{key}.jpg` member.

A valid RGB JPEG passes through byte-for-byte; any other readable image is converted to RGB and
encoded as JPEG (quality 95 by default). Every image is fully decoded once (PIL `load()`, no
`draft()` shortcut), so truncated or corrupt files are caught here rather than in training.
This module runs inside worker processes: it stays light (PIL and numpy only).
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

# JPEG-coded formats PIL may report for a valid JPEG file (MPO: camera multi-picture JPEG,
# whose first frame is what every JPEG decoder reads).
JPEG_FORMATS = ("JPEG", "MPO")
SIXTEEN_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")


@dataclass(frozen=True)
class PreparedImage:
    """The `.jpg` member of a sample and what the json/manifest say about it."""

    jpg: bytes
    width: int
    height: int
    converted: bool
    source_format: str
    source_mode: str


@dataclass(frozen=True)
class Rejection:
    """Why an input was not written: a short code and one sentence."""

    reason: str
    detail: str


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL image -> 8-bit RGB; transparency is composited over white."""
    mode = image.mode
    if mode in SIXTEEN_BIT_MODES:
        # PIL's convert("L") clips 16-bit values at 255; scale the full 0..65535 range instead.
        values = np.asarray(image, dtype=np.int64)
        image = Image.fromarray((np.clip(values, 0, 65535) // 257).astype(np.uint8), "L")
    elif mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def decode(data: bytes) -> Image.Image:
    """Fully decode image bytes; raises on anything PIL cannot decode completely."""
    image = Image.open(io.BytesIO(data))
    with warnings.catch_warnings():
        # PIL warns (not raises) on oversized images; the hard limit still raises.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        image.load()
    return image


def classify_error(exc: Exception) -> Rejection:
    """A decode exception -> rejection reason."""
    # Object addresses in messages would make rejected.parquet differ from run to run.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(exc)) or type(exc).__name__
    if isinstance(exc, UnidentifiedImageError):
        return Rejection("not_an_image", "content is not an image format PIL can identify")
    if isinstance(exc, Image.DecompressionBombError):
        return Rejection("too_large", f"image exceeds PIL's pixel limit ({text})")
    if "truncated" in text.lower() or isinstance(exc, EOFError):
        return Rejection("truncated", f"image data is truncated ({text})")
    return Rejection("corrupt", f"image cannot be decoded ({type(exc).__name__}: {text})")


def prepare_image(data: bytes, *, min_side: int = 32, quality: int = 95) -> PreparedImage | Rejection:
    """Decode-verify image bytes; return the `.jpg` member (passed through or converted) or why not."""
    if not data:
        return Rejection("empty_file", "file is empty (0 bytes)")
    try:
        image = decode(data)
    except Exception as exc:  # any decoder failure is a per-file rejection, never a job failure
        return classify_error(exc)
    width, height = image.size
    if min(width, height) < min_side:
        return Rejection("too_small", f"image is {width}x{height}, smaller than the minimum side {min_side}")
    fmt, mode = image.format or "unknown", image.mode
    if fmt in JPEG_FORMATS and mode == "RGB":
        return PreparedImage(data, width, height, False, fmt, mode)
    try:
        out = io.BytesIO()
        to_rgb(image).save(out, "JPEG", quality=quality)
    except Exception as exc:
        return Rejection("unconvertible", f"{fmt} image in mode {mode} cannot be converted to RGB ({exc})")
    return PreparedImage(out.getvalue(), width, height, True, fmt, mode)


def prepare_file(path: str, *, min_side: int = 32, quality: int = 95) -> PreparedImage | Rejection:
    """Read and prepare one file; unreadable files become rejections too."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        return Rejection("unreadable", f"file cannot be read ({exc.strerror or exc})")
    return prepare_image(data, min_side=min_side, quality=quality)
