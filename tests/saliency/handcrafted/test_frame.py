"""saliency.handcrafted.frame: frame removal, tiny images, the shared flat-image guard."""

from __future__ import annotations

import numpy as np
import pytest

from relicv2.saliency.handcrafted import frame
from tests.scenes import synthetic_scene


def _framed(width: int = 12) -> np.ndarray:
    content, _ = synthetic_scene(136, 176, seed=5)
    image = np.zeros((136 + 2 * width, 176 + 2 * width, 3), np.uint8)
    image[width:-width, width:-width] = content
    return image


@pytest.mark.parametrize("edges,min_sides", [("sobel", 1), ("canny", 2)])
def test_detect_frame_finds_an_artificial_frame(edges, min_sides):
    image = _framed(12)
    found = frame.detect_frame(image, edges=edges, min_sides=min_sides)
    assert found.has_frame
    for side in (found.top, image.shape[0] - found.bottom, found.left, image.shape[1] - found.right):
        assert 11 <= side <= 13
    plain, _ = synthetic_scene(160, 200, seed=5)
    assert not frame.detect_frame(plain, edges=edges, min_sides=min_sides).has_frame


def test_frame_crop_and_paste_round_trip():
    box = frame.Frame(height=10, width=12, top=2, bottom=8, left=3, right=9)
    image = np.arange(120, dtype=np.float32).reshape(10, 12)
    pasted = box.paste(box.crop(image), fill=-1.0)
    assert (pasted[2:8, 3:9] == image[2:8, 3:9]).all()
    assert (pasted[:2] == -1).all() and (pasted[:, 9:] == -1).all()


def test_prepare_upscales_tiny_and_finish_restores_shape():
    prepared = frame.prepare(np.full((10, 300), 90, np.uint8))
    assert min(prepared.rgb.shape[:2]) >= frame.MIN_SIDE and prepared.rgb.shape[2] == 3
    assert prepared.rgb.shape[1] > prepared.rgb.shape[0]  # aspect ratio kept
    out = prepared.finish(np.full(prepared.rgb.shape[:2], np.nan))
    assert out.shape == (10, 300) and out.dtype == np.float32 and np.isfinite(out).all()
    clipped = prepared.finish(np.full(prepared.rgb.shape[:2], 7.0))
    assert (clipped == 1.0).all()


def test_guard_answers_flat_images_without_running_the_method():
    calls = []

    def compute(rgb):
        calls.append(rgb.shape)
        return np.ones(rgb.shape[:2])

    flat = frame.guarded_map(np.full((40, 50, 3), 77, np.uint8), compute)
    assert calls == [] and flat.shape == (40, 50) and (flat == 0).all()
    assert frame.is_flat(np.full((4, 4, 3), 9, np.uint8))
    assert not frame.is_flat(np.array([[[0, 0, 0], [0, 0, 2]]], np.uint8))
    tiny = frame.guarded_map(np.random.default_rng(0).integers(0, 256, (5, 8, 3), dtype=np.uint8), compute)
    # the method sees an upscaled image (short side MIN_SIDE); the map comes back at 5x8
    assert calls == [(frame.MIN_SIDE, round(8 * frame.MIN_SIDE / 5), 3)] and tiny.shape == (5, 8)
    assert (tiny == 1).all()


def test_guard_turns_nothing_to_rank_into_zeros_and_keeps_the_frame_at_zero():
    nothing = frame.guarded_map(_framed(), lambda rgb: None, remove_frame="sobel")
    assert nothing.dtype == np.float32 and (nothing == 0).all()
    ones = frame.guarded_map(_framed(), lambda rgb: np.ones(rgb.shape[:2]), remove_frame="sobel")
    assert (ones[:10] == 0).all() and (ones[20:-20, 20:-20] == 1).all()
