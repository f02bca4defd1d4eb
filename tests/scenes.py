"""Synthetic saliency scenes: a known object on a textured background, with its mask.

The saliency tests use them to check that every method ranks the object above the background.
"""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
from PIL import Image


def synthetic_scene(height: int = 120, width: int = 160, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(rgb, mask)``: a textured ellipse (~15% of the image, off-centre) on a textured, differently
    coloured background (smoothed noise: superpixels see texture); mask uint8 {0, 255}, 255 on the object."""
    rng = np.random.default_rng(seed)
    noise = rng.normal(0.0, 1.0, (height, width, 3)).astype(np.float32)
    texture = cv2.GaussianBlur(noise, (0, 0), 1.5) * 12.0
    background = np.array([70.0, 120.0, 80.0], np.float32) + rng.uniform(-15, 15, 3).astype(np.float32)
    foreground = np.array([200.0, 60.0, 50.0], np.float32) + rng.uniform(-15, 15, 3).astype(np.float32)
    mask = np.zeros((height, width), np.uint8)
    centre = (int(width * rng.uniform(0.42, 0.58)), int(height * rng.uniform(0.42, 0.58)))
    axes = (max(2, int(width * 0.22)), max(2, int(height * 0.25)))
    cv2.ellipse(mask, centre, axes, float(rng.uniform(0, 180)), 0, 360, 255, -1)
    # Soft vertical illumination gradient on the background, as in real photos.
    ramp = np.linspace(-12.0, 12.0, height, dtype=np.float32)[:, None, None]
    image = np.where(mask[:, :, None] > 0, foreground, background + ramp) + texture
    return np.clip(np.rint(image), 0, 255).astype(np.uint8), mask


def striped_scene(height: int = 96, width: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(rgb, mask)`` like :func:`synthetic_scene`: a red ellipse on a green-grey background whose stripes
    give it more internal contrast than the object has to it in places (harder for contrast cues)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width]
    stripes = 20.0 * np.sin(xx / 3.0)[..., None] * np.array([0.5, 1.0, 0.5])
    background = np.array([110.0, 140.0, 110.0]) + stripes + rng.normal(0, 12, (height, width, 3))
    inside = ((yy - height * 0.55) / (height * 0.22)) ** 2 + ((xx - width * 0.5) / (width * 0.2)) ** 2 < 1
    colour = np.array([210.0, 40.0, 40.0]) + rng.normal(0, 8, (height, width, 3))
    image = np.where(inside[..., None], colour, background)
    return np.clip(image, 0, 255).astype(np.uint8), np.where(inside, 255, 0).astype(np.uint8)


def write_scenes(folder: Path, seeds, masks: Path | None = None, size: tuple[int, int] = (48, 64)) -> None:
    """A `synthetic_scene` a seed as `folder/sSEED.jpg` (a new folder), its mask as `masks/sSEED.png` when given."""
    folder.mkdir()
    for seed in seeds:
        rgb, mask = synthetic_scene(*size, seed=seed)
        Image.fromarray(rgb).save(folder / f"s{seed}.jpg", quality=95)
        if masks is not None:
            masks.mkdir(exist_ok=True)
            Image.fromarray(mask).save(masks / f"s{seed}.png")
