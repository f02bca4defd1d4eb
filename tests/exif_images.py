"""Test images carrying an EXIF orientation, shared by the shards, saliency and chain tests."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

ORIENTATION_TAG = 0x0112


def orientation6_stored() -> np.ndarray:
    """The stored pixels: 200 wide x 100 high, red left half, blue right half."""
    stored = np.zeros((100, 200, 3), np.uint8)
    stored[:, :100, 0] = 255
    stored[:, 100:, 2] = 255
    return stored


def orientation6_displayed() -> np.ndarray:
    """What a viewer shows for :func:`orientation6_jpeg`: 100 wide x 200 high, red on top, blue below
    (orientation 6: rotate 90 degrees clockwise, so the stored left edge becomes the top)."""
    return np.ascontiguousarray(np.rot90(orientation6_stored(), k=-1))


def orientation6_jpeg() -> bytes:
    """Stored 200 wide x 100 high, red left half, blue right; EXIF orientation 6 (rotate 90 clockwise)."""
    exif = Image.Exif()
    exif[ORIENTATION_TAG] = 6
    out = io.BytesIO()
    Image.fromarray(orientation6_stored()).save(out, "JPEG", quality=95, exif=exif)
    return out.getvalue()


def upright_jpeg() -> bytes:
    """The displayed image of :func:`orientation6_jpeg` encoded upright, without EXIF."""
    out = io.BytesIO()
    Image.fromarray(orientation6_displayed()).save(out, "JPEG", quality=95)
    return out.getvalue()
