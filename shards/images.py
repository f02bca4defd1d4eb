"""The one image loader for untrusted images, and decode-verification for `shards build`.

Every reader goes through :func:`_open` (the pixel limit checked from the header before any pixel is
decoded, then a full decode, so truncated or corrupt files are caught here rather than in training) and
:func:`displayed` (EXIF orientation applied, 8-bit RGB). It runs in worker processes: PIL and numpy only.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from relicv2.shards.limits import DEFAULT_LIMITS, ImageLimits

# JPEG-coded formats PIL may report for a valid JPEG file (MPO: camera multi-picture JPEG,
# whose first frame is what every JPEG decoder reads).
JPEG_FORMATS = ("JPEG", "MPO")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIXTEEN_BIT_MODES = ("I", "I;16", "I;16B", "I;16L", "I;16N")
ORIENTATION_TAG = 0x0112
# What PIL raises for undecodable data (SyntaxError: some plugins' header parsers).
DECODE_ERRORS = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


@dataclass(frozen=True)
class PreparedImage:
    """The `.jpg` member of a sample and what the json/manifest say about it."""

    jpg: bytes
    width: int  # as displayed (EXIF orientation applied)
    height: int
    converted: bool
    source_format: str
    orientation: int = 1  # the source's EXIF orientation (1: none); the output is always upright


@dataclass(frozen=True)
class Rejection:
    """Why an input was not written: a short code and one sentence."""

    reason: str
    detail: str


class ImageLoadError(ValueError):
    """An image could not be loaded: `name` (file or sample), a reason code and one sentence."""

    def __init__(self, name: str, rejection: Rejection):
        super().__init__(f"{name}: {rejection.detail}")
        self.name = name
        self.reason = rejection.reason
        self.detail = rejection.detail


def to_rgb(image: Image.Image) -> Image.Image:
    """Any PIL image -> 8-bit RGB; 16-bit scaled over its full range, transparency composited over white."""
    if image.mode in SIXTEEN_BIT_MODES:
        # PIL's convert("L") clips 16-bit values at 255; scale the full 0..65535 range instead.
        values = np.asarray(image, dtype=np.int64)
        image = Image.fromarray((np.clip(values, 0, 65535) // 257).astype(np.uint8), "L")
    elif image.mode == "F":
        image = Image.fromarray(np.clip(np.asarray(image), 0, 255).astype(np.uint8), "L")
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def to_gray(image: Image.Image) -> Image.Image:
    """A map or mask -> 8-bit L; 16-bit maps are scaled so their maximum becomes 255 (masks stored as 0/1 too)."""
    if image.mode in SIXTEEN_BIT_MODES:
        data = np.asarray(image, dtype=np.float64)
        top = data.max() if data.size and data.max() > 0 else 1.0
        return Image.fromarray(np.clip(np.rint(data / top * 255.0), 0, 255).astype(np.uint8), "L")
    return image.convert("L")


def orientation_of(image: Image.Image) -> int:
    """The EXIF orientation (1..8) of an opened image; 1 when absent or invalid."""
    try:
        value = image.getexif().get(ORIENTATION_TAG, 1)
    except DECODE_ERRORS:  # a broken EXIF block must not make a readable image unreadable
        return 1
    return value if isinstance(value, int) and 1 <= value <= 8 else 1


def classify_error(exc: BaseException) -> Rejection:
    """A decode exception -> rejection reason."""
    # Object addresses in messages would make rejected.parquet differ from run to run.
    text = re.sub(r" at 0x[0-9a-fA-F]+", "", str(exc)) or type(exc).__name__
    if isinstance(exc, UnidentifiedImageError):
        return Rejection("not_an_image", "content is not an image format PIL can identify")
    if isinstance(exc, Image.DecompressionBombError):
        return Rejection("too_large", f"image exceeds the pixel limit ({text})")
    if "truncated" in text.lower() or isinstance(exc, EOFError):
        return Rejection("truncated", f"image data is truncated ({text})")
    return Rejection("corrupt", f"image cannot be decoded ({type(exc).__name__}: {text})")


@contextlib.contextmanager
def _own_pixel_limit():
    """PIL's global bomb check off while we open: ours (ImageLimits, checked from the header) decides."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


@contextlib.contextmanager
def _decoding(name: str) -> Iterator[None]:
    """PIL's errors inside the block -> ImageLoadError naming `name` with the reason."""
    try:
        yield
    except ImageLoadError:
        raise
    except DECODE_ERRORS as exc:  # also raised by lazy plugins while converting
        raise ImageLoadError(name, classify_error(exc)) from None


def header_problem(file: BinaryIO, limits: ImageLimits = DEFAULT_LIMITS) -> Rejection | None:
    """Why an image (an open binary file) must not be decoded, from its header alone, or None:
    over `limits.max_pixels`, or a header PIL cannot read. No pixel is decoded."""
    try:
        with _own_pixel_limit(), Image.open(file) as image:
            width, height = image.size
    except DECODE_ERRORS as exc:
        return classify_error(exc)
    return _pixels_problem(width, height, limits)


def _pixels_problem(width: int, height: int, limits: ImageLimits) -> Rejection | None:
    if width * height > limits.max_pixels:
        return Rejection("too_large", f"image is {width}x{height} = {width * height} pixels, over the limit of "
                                      f"{limits.max_pixels} (raise max_pixels to accept it)")
    return None


def _open(data: bytes, name: str, limits: ImageLimits, *, max_side: int | None = None,
          min_side: int | None = None) -> tuple[Image.Image, tuple[int, int]]:
    """(image, its full stored size from the header): refused (ImageLoadError naming `name`) when over
    the limits, before decoding, then decoded fully; JPEGs at the smallest DCT scale (1/2, 1/4, 1/8)
    keeping the longer side >= `max_side`, or each side >= `min_side`."""
    if not data:
        raise ImageLoadError(name, Rejection("empty_file", "file is empty (0 bytes)"))
    if len(data) > limits.max_member_bytes:
        raise ImageLoadError(name, Rejection(
            "too_large", f"{len(data)} bytes exceed the limit of {limits.max_member_bytes}"))
    with _decoding(name), _own_pixel_limit():
        image = Image.open(io.BytesIO(data))  # the header only: checked before any pixel is decoded
        width, height = image.size
        if (rejection := _pixels_problem(width, height, limits)) is not None:
            raise ImageLoadError(name, rejection)
        if max_side is not None and max(width, height) > max_side:
            scale = max_side / max(width, height)
            image.draft("RGB", (math.ceil(width * scale), math.ceil(height * scale)))
        elif min_side is not None:
            image.draft("RGB", (min_side, min_side))
        image.load()
    return image, (width, height)


def displayed_size(image: Image.Image, size: tuple[int, int] | None = None) -> tuple[int, int]:
    """(width, height) of an opened image as displayed (EXIF orientations 5..8 swap the axes);
    `size` (stored width, height) instead of the image's current size, e.g. the size before a draft."""
    width, height = image.size if size is None else size
    return (height, width) if orientation_of(image) >= 5 else (width, height)


def _upright(image: Image.Image) -> Image.Image:
    return ImageOps.exif_transpose(image) if orientation_of(image) != 1 else image


def displayed(image: Image.Image, *, max_side: int | None = None) -> Image.Image:
    """An opened image as a person sees it: EXIF orientation applied, 8-bit RGB, at most `max_side`."""
    rgb = to_rgb(_upright(image))
    if max_side is not None and max(rgb.size) > max_side:
        scale = max_side / max(rgb.size)
        size = (max(1, round(rgb.width * scale)), max(1, round(rgb.height * scale)))
        rgb = rgb.resize(size, Image.Resampling.BILINEAR, reducing_gap=2.0)
    return rgb


@contextlib.contextmanager
def _image_file(path: Path | str, limits: ImageLimits) -> Iterator[BinaryIO]:
    """An image file opened for reading; ImageLoadError naming it when missing, unreadable or over the size limit."""
    try:
        with open(path, "rb") as file:
            if (size := os.fstat(file.fileno()).st_size) > limits.max_member_bytes:
                raise ImageLoadError(str(path), Rejection(
                    "too_large", f"file is {size} bytes, over the limit of {limits.max_member_bytes}"))
            yield file
    except FileNotFoundError:
        raise ImageLoadError(str(path), Rejection("missing", "file not found")) from None
    except OSError as exc:
        raise ImageLoadError(str(path), Rejection("unreadable", f"file cannot be read ({exc.strerror or exc})")) from None


def read_bytes(path: Path | str, limits: ImageLimits = DEFAULT_LIMITS) -> bytes:
    """A file's bytes, refused (ImageLoadError) when missing, unreadable or over the size limit."""
    with _image_file(path, limits) as file:
        return file.read()


def load_image(data: bytes, name: str, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Image bytes -> displayed 8-bit RGB PIL image (downscaled to `limits.max_side` when set);
    :class:`ImageLoadError` naming `name` with the reason (too_large, truncated, corrupt ...)."""
    with _decoding(name):
        image, _ = _open(data, name, limits, max_side=limits.max_side)
        return displayed(image, max_side=limits.max_side)


@dataclass(frozen=True)
class ScaledImage:
    """An image decoded at a reduced scale, as displayed, with the displayed size of the full image."""

    rgb: np.ndarray  # uint8 H x W x 3 in the displayed orientation
    width: int  # the full image as displayed (EXIF orientation applied)
    height: int


def load_scaled(data: bytes, name: str, min_side: int, limits: ImageLimits = DEFAULT_LIMITS) -> ScaledImage:
    """Image bytes -> the displayed image decoded no smaller than `min_side` on each side, and the
    displayed full width and height: for work at a small fixed size (a saliency network's square
    input) whose output must match the full image as displayed. ImageLoadError names `name`."""
    with _decoding(name):
        image, stored = _open(data, name, limits, min_side=min_side)
        return ScaledImage(np.asarray(displayed(image), dtype=np.uint8), *displayed_size(image, stored))


def exif_orientation(data: bytes) -> int:
    """The EXIF orientation (1..8) of encoded image bytes, read from the header only; 1 when absent
    or when the bytes are not a readable image."""
    try:
        with _own_pixel_limit(), Image.open(io.BytesIO(data)) as image:
            return orientation_of(image)
    except DECODE_ERRORS:
        return 1


def load_rgb(data: bytes, name: str, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Image bytes -> uint8 HxWx3 RGB array as displayed; ImageLoadError names `name`."""
    return np.asarray(load_image(data, name, limits), dtype=np.uint8)


def load_gray(data: bytes, name: str, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """Map or mask bytes -> uint8 HxW (colour converted to luminance, EXIF orientation applied)."""
    with _decoding(name):
        upright = _upright(_open(data, name, limits)[0])
        if upright.mode in ("RGBA", "LA", "PA", "P", "CMYK", "YCbCr", "F"):
            upright = to_rgb(upright)
        return np.asarray(to_gray(upright), dtype=np.uint8)


def header_size(path: Path | str, limits: ImageLimits = DEFAULT_LIMITS) -> tuple[int, int]:
    """(width, height) of an image file as displayed, from its header alone; ImageLoadError naming the file
    when it is missing, unreadable, over the limits or not an image."""
    with _image_file(path, limits) as file, _decoding(str(path)), _own_pixel_limit(), Image.open(file) as image:
        if (rejection := _pixels_problem(*image.size, limits)) is not None:
            raise ImageLoadError(str(path), rejection)
        return displayed_size(image)


def load_index_mask(data: bytes, name: str, limits: ImageLimits = DEFAULT_LIMITS) -> np.ndarray:
    """An index mask (a palette or 8-bit grey PNG whose values are class indices, as VOC and Cityscapes
    store them) -> uint8 HxW of those indices; ImageLoadError naming `name` for any other kind of image."""
    with _decoding(name):
        image = _upright(_open(data, name, limits)[0])
        if image.mode not in ("P", "L"):
            raise ImageLoadError(name, Rejection("not_index_mask", f"a {image.mode} image is not an index mask "
                                                 "(a palette or 8-bit grey PNG of class indices)"))
        return np.asarray(image, dtype=np.uint8)


def decode(data: bytes, limits: ImageLimits = DEFAULT_LIMITS) -> Image.Image:
    """Fully decode image bytes within the limits; raises ImageLoadError("image", ...) otherwise."""
    return _open(data, "image", limits)[0]


def prepare_file(path: str, *, min_side: int = 32, quality: int = 95,
                 limits: ImageLimits = DEFAULT_LIMITS) -> PreparedImage | Rejection:
    """Read and decode-verify one file: its `.jpg` member (passed through or converted), or why not."""
    try:
        data = read_bytes(path, limits)
        image, _ = _open(data, "image", limits)
    except ImageLoadError as exc:
        return Rejection(exc.reason, exc.detail)
    orientation = orientation_of(image)
    width, height = displayed_size(image)
    if min(width, height) < min_side:
        return Rejection("too_small", f"image is {width}x{height}, smaller than the minimum side {min_side}")
    fmt, mode = image.format or "unknown", image.mode
    if fmt in JPEG_FORMATS and mode == "RGB" and orientation == 1:
        return PreparedImage(data, width, height, False, fmt)
    try:
        out = io.BytesIO()
        # Re-encoded upright and without EXIF: DALI, PIL and every other decoder show the same pixels.
        displayed(image).save(out, "JPEG", quality=quality)
    except DECODE_ERRORS as exc:
        return Rejection("unconvertible", f"{fmt} image in mode {mode} cannot be converted to RGB ({exc})")
    return PreparedImage(out.getvalue(), width, height, True, fmt, orientation)
