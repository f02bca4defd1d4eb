"""The 15 ImageNet-C corruptions (Hendrycks & Dietterich 2019) at severities 1-5, deterministic per image.

The corruptions are `imagecorruptions-imaug`'s (the maintained fork of the `imagecorruptions` package that
implements ImageNet-C's code; its 1.1.2 original fails glass blur and fog under numpy 2 and current
scikit-image). Most of them draw from numpy's global generator, glass blur from numba's and impulse noise
through scikit-image: each call here derives one seed from (run seed, sample key, corruption, severity),
hands it to the two that take one and sets numpy's global generator from it around the call, restoring
the caller's state after. The same image is therefore corrupted the same way whatever the batch, the
order or the worker that handles it, and differently under another run seed.

The package declares `opencv-python`, which would install a second `cv2` beside the project's
`opencv-python-headless`: it is installed without its dependencies (`requirements-nodeps.lock`), all of
which the project pins already.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import numpy as np

# The 15 corruptions of the ImageNet-C benchmark, in its table order, by family.
FAMILIES = {
    "noise": ("gaussian_noise", "shot_noise", "impulse_noise"),
    "blur": ("defocus_blur", "glass_blur", "motion_blur", "zoom_blur"),
    "weather": ("snow", "frost", "fog", "brightness"),
    "digital": ("contrast", "elastic_transform", "pixelate", "jpeg_compression"),
}
CORRUPTIONS = tuple(name for names in FAMILIES.values() for name in names)
SEVERITIES = (1, 2, 3, 4, 5)
MIN_SIDE = 32  # the package refuses smaller images
# The corruptions whose randomness the package takes as an argument (the others use numpy's global state).
_SEEDED_BY_ARGUMENT = ("impulse_noise", "glass_blur")
INSTALL_HINT = "pip install --no-deps -r requirements-nodeps.lock (it pins imagecorruptions-imaug)"


class CorruptionError(ValueError):
    """A corruption or severity this module does not offer, an image it cannot corrupt, or the package missing."""


def image_seed(seed: int, key: str, corruption: str, severity: int) -> int:
    """The seed of one corrupted image: a function of the run seed, the sample key, the corruption and the
    severity only (32 bits, what numpy's legacy global generator takes)."""
    digest = hashlib.sha256(f"{seed}\0{key}\0{corruption}\0{severity}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


@contextlib.contextmanager
def _global_numpy_seed(value: int) -> Iterator[None]:
    state = np.random.get_state()
    np.random.seed(value)
    try:
        yield
    finally:
        np.random.set_state(state)


def check_corruption(corruption: str, severity: int) -> None:
    if corruption not in CORRUPTIONS:
        raise CorruptionError(f"unknown corruption {corruption!r}: choose from {', '.join(CORRUPTIONS)}")
    if severity not in SEVERITIES:
        raise CorruptionError(f"severity {severity} is not one of {', '.join(map(str, SEVERITIES))}")


def corrupt_image(rgb: np.ndarray, corruption: str, severity: int, *, seed: int, key: str) -> np.ndarray:
    """`rgb` (uint8 HxWx3, both sides >= 32) corrupted by `corruption` at `severity`: uint8 HxWx3."""
    check_corruption(corruption, severity)
    if rgb.dtype != np.uint8 or rgb.ndim != 3 or rgb.shape[2] != 3 or min(rgb.shape[:2]) < MIN_SIDE:
        raise CorruptionError(f"{key}: corruptions take uint8 RGB images of at least {MIN_SIDE} px a side, "
                              f"not {rgb.dtype} {tuple(rgb.shape)}")
    try:  # imported here: the package compiles numba kernels on first use
        from imagecorruptions import corrupt
    except ImportError as error:
        raise CorruptionError(f"the corruptions need the imagecorruptions-imaug package: {INSTALL_HINT}") from error
    value = image_seed(seed, key, corruption, severity)
    extra = {"seed": value} if corruption in _SEEDED_BY_ARGUMENT else {}
    with _global_numpy_seed(value):
        return np.ascontiguousarray(corrupt(rgb, severity=severity, corruption_name=corruption, **extra))
