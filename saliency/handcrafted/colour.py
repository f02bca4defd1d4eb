"""Colour handling shared by the handcrafted methods: input images to RGB, RGB to CIE Lab.

Conventions: images are ``uint8 HxWx3`` RGB after :func:`as_rgb` (greyscale and RGBA accepted
there); Lab is CIE L*a*b* under D65 with L in [0, 100] (the scale of the authors' MATLAB
``colorspace`` / OpenCV float conversion, and of SLIC's compactness).
"""

from __future__ import annotations

import cv2
import numpy as np

RGB_TO_XYZ = np.array([[0.412453, 0.357580, 0.180423],
                       [0.212671, 0.715160, 0.072169],
                       [0.019334, 0.119193, 0.950227]])
D65_WHITE = np.array([0.950456, 1.0, 1.088754])
# sRGB -> XYZ with the D65 white folded into the X and Z rows, as the authors' C++ SLIC rounds it
# (MC's and the reference SLIC's constants)
REFERENCE_RGB_TO_XYZ = np.array([[0.4339563, 0.3762153, 0.1898430],
                                 [0.2126729, 0.7151522, 0.0721750],
                                 [0.0177578, 0.1094756, 0.8728363]])


def as_rgb(image: np.ndarray) -> np.ndarray:
    """``image`` (HxW, HxWx1, HxWx3 or HxWx4) as contiguous ``uint8 HxWx3`` RGB. Alpha is dropped, not
    composited (the authors' MATLAB code reads only the colour planes too); non-uint8 input is taken as
    [0, 1] floats when its maximum is <= 1, else as 0..255, and clipped."""
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or min(array.shape[:2]) < 1:
        raise ValueError(f"expected an image of shape HxW, HxWx1, HxWx3 or HxWx4, got shape {array.shape}")
    if array.dtype != np.uint8:
        data = np.nan_to_num(array.astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if data.size and data.max() <= 1.0:
            data = data * 255.0
        array = np.clip(np.rint(data), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(np.repeat(array, 3, axis=2) if array.shape[2] == 1 else array[:, :, :3])


def rgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """Per-pixel CIE Lab (D65, L in [0, 100]) of a uint8 RGB image, float32.

    OpenCV's float conversion is used because it is ~20x faster than skimage's and agrees
    with it (and with the authors' MATLAB ``colorspace``) to < 0.5 Lab units.
    """
    return cv2.cvtColor(rgb.astype(np.float32) * np.float32(1.0 / 255.0), cv2.COLOR_RGB2Lab)


def rgb_values_to_lab(rgb_values: np.ndarray) -> np.ndarray:
    """Lab of a list of RGB colours given in 0..255 (``(n, 3)`` floats), float64 ``(n, 3)``.

    This is RBD's ``colorspace('Lab<-', meanRgb / 255)``: Lab of the *mean RGB* of a region.
    Computed in float64 with the sRGB/D65 formulas (OpenCV's float path uses tables with
    ~0.05-unit steps; n is small, so exactness is free here).
    """
    linear = srgb_to_linear(np.asarray(rgb_values, dtype=np.float64).reshape(-1, 3) / 255.0)
    xyz = linear @ RGB_TO_XYZ.T / D65_WHITE
    f = np.where(xyz > (6.0 / 29.0) ** 3, np.cbrt(xyz), xyz / (3 * (6.0 / 29.0) ** 2) + 4.0 / 29.0)
    lightness, a, b = 116.0 * f[:, 1] - 16.0, 500.0 * (f[:, 0] - f[:, 1]), 200.0 * (f[:, 1] - f[:, 2])
    return np.stack([lightness, a, b], axis=1)


def srgb_to_linear(values: np.ndarray) -> np.ndarray:
    """The sRGB gamma undone: values in [0, 1] to linear RGB."""
    return np.where(values <= 0.04045, values / 12.92, ((values + 0.055) / 1.055) ** 2.4)
