"""Synthetic test scenes: a known object on a textured background (tests and CLI demos)."""

from __future__ import annotations

import cv2
import numpy as np


def synthetic_scene(height: int = 120, width: int = 160, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """An RGB uint8 image with a textured ellipse on a textured, differently coloured background.

    Returns ``(rgb, mask)`` where ``mask`` is uint8 {0, 255}, 255 on the object. The object sits
    off-centre, away from the border, and covers ~15% of the image; both regions carry
    smoothed noise so that superpixels see texture, not flat colour.
    """
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
