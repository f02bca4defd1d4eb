"""saliency.handcrafted.colour: input images to RGB, RGB to CIE Lab."""

from __future__ import annotations

import numpy as np
import pytest
from skimage.color import rgb2lab

from relicv2.saliency.handcrafted.colour import as_rgb, rgb_to_lab, rgb_values_to_lab


def test_as_rgb_converts_grey_rgba_and_floats():
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    rgb = as_rgb(grey)
    assert rgb.shape == (3, 4, 3) and rgb.dtype == np.uint8
    assert (rgb[..., 0] == grey).all() and (rgb[..., 2] == grey).all()
    rgba = np.dstack([rgb, np.full((3, 4), 7, np.uint8)])
    assert (as_rgb(rgba) == rgb).all()
    assert (as_rgb(grey[..., None]) == rgb).all()
    assert (as_rgb(np.full((2, 2, 3), 0.5)) == 128).all()  # [0, 1] floats
    assert (as_rgb(np.full((2, 2, 3), 300.0)) == 255).all()  # 0..255 floats, clipped
    assert (as_rgb(np.full((2, 2, 3), np.nan)) == 0).all()


@pytest.mark.parametrize("shape", [(4, 4, 2), (4, 4, 5), (0, 4, 3), (4,), (2, 2, 2, 3)])
def test_as_rgb_rejects_what_is_not_an_image(shape):
    with pytest.raises(ValueError, match="expected an image"):
        as_rgb(np.zeros(shape, np.uint8))


def test_lab_of_colours_matches_skimage_and_known_points():
    colours = np.random.default_rng(0).uniform(0, 255, (40, 3))
    expected = rgb2lab(colours[None] / 255.0)[0]
    assert np.abs(rgb_values_to_lab(colours) - expected).max() < 0.01
    white_black = rgb_values_to_lab(np.array([[255, 255, 255], [0, 0, 0]]))
    assert np.allclose(white_black, [[100, 0, 0], [0, 0, 0]], atol=0.01)
    image = np.random.default_rng(1).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    lab = rgb_to_lab(image)
    assert lab.dtype == np.float32 and np.abs(lab - rgb2lab(image)).max() < 0.6
