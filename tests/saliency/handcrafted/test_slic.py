"""Achanta's reference SLIC (saliency/handcrafted/slic.py): edges, counts, connectivity, odd inputs, fidelity."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from scipy import ndimage

from relicv2.saliency.handcrafted.graph import segment
from relicv2.saliency.handcrafted.slic import reference_lab, slic_reference
from tests.paths import SHARED_DATA

DATA = SHARED_DATA / "pascal-s-dev" / "images"


def _blocks(height: int = 120, width: int = 160, seed: int = 0) -> np.ndarray:
    """Four flat colour quadrants with mild noise: the segmentation must follow the two cuts."""
    rng = np.random.default_rng(seed)
    image = np.zeros((height, width, 3), dtype=np.float64)
    colours = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40)]
    h2, w2 = height // 2 + 3, width // 2 - 5  # cuts deliberately off the seed grid
    image[:h2, :w2] = colours[0]
    image[:h2, w2:] = colours[1]
    image[h2:, :w2] = colours[2]
    image[h2:, w2:] = colours[3]
    image += rng.normal(0, 4, image.shape)
    return np.clip(np.rint(image), 0, 255).astype(np.uint8)


def _components_per_label(labels: np.ndarray) -> np.ndarray:
    """Number of 4-connected pieces of every label."""
    counts = np.zeros(labels.max() + 1, dtype=int)
    for value in range(labels.max() + 1):
        _, pieces = ndimage.label(labels == value)
        counts[value] = pieces
    return counts


def test_segments_respect_colour_edges() -> None:
    image = _blocks()
    labels = slic_reference(image, 48, 20.0)
    h2, w2 = image.shape[0] // 2 + 3, image.shape[1] // 2 - 5
    quadrant = np.zeros(labels.shape, dtype=int)
    quadrant[:h2, w2:] = 1
    quadrant[h2:, :w2] = 2
    quadrant[h2:, w2:] = 3
    # every superpixel lies (almost) entirely inside one colour quadrant
    for value in range(labels.max() + 1):
        share = np.bincount(quadrant[labels == value], minlength=4)
        assert share.max() >= 0.97 * share.sum(), (value, share)


def test_label_count_near_request_and_contiguous_ids() -> None:
    image = _blocks(300, 400)
    for requested in (50, 200, 400):
        labels = slic_reference(image, requested)
        count = labels.max() + 1
        assert labels.dtype == np.int32 and labels.min() == 0
        assert np.all(np.bincount(labels.ravel()) > 0)  # ids 0..n-1, none empty
        assert 0.7 * requested <= count <= 1.3 * requested, (requested, count)


def test_every_label_is_one_connected_piece() -> None:
    rng = np.random.default_rng(3)
    noisy = rng.integers(0, 256, (90, 130, 3), dtype=np.uint8)  # many fragments to merge
    for image in (noisy, _blocks()):
        labels = slic_reference(image, 60)
        assert np.all(_components_per_label(labels) == 1)


def test_small_fragments_are_merged() -> None:
    rng = np.random.default_rng(5)
    image = rng.integers(0, 256, (100, 100, 3), dtype=np.uint8)
    labels = slic_reference(image, 25)
    step = int(np.sqrt(int(0.5 + 100 * 100 / 25)) + 0.5)
    nominal = 100 * 100 // max(1, 100 * 100 // (step * step))
    assert np.bincount(labels.ravel()).min() > nominal // 4


def test_deterministic() -> None:
    image = _blocks(seed=7)
    first = slic_reference(image, 100, perturb_seeds=True)
    assert np.array_equal(first, slic_reference(image.copy(), 100, perturb_seeds=True))


def test_tiny_flat_and_extreme_inputs() -> None:
    flat = np.full((40, 60, 3), 128, dtype=np.uint8)
    labels = slic_reference(flat, 12)
    assert labels.shape == (40, 60) and np.all(_components_per_label(labels) == 1)
    # a flat image is cut by position alone: a regular grid of about the requested count
    assert 6 <= labels.max() + 1 <= 16
    for shape in [(1, 1, 3), (2, 3, 3), (5, 300, 3), (300, 4, 3), (1, 200, 3)]:
        image = np.random.default_rng(1).integers(0, 256, shape, dtype=np.uint8)
        for kwargs in ({}, {"perturb_seeds": True, "column_major": True}):
            labels = slic_reference(image, 20, **kwargs)
            assert labels.shape == shape[:2]
            assert labels.min() == 0 and np.all(np.bincount(labels.ravel()) > 0)
            assert np.all(_components_per_label(labels) == 1)
    # more segments than pixels: still a valid segmentation
    assert slic_reference(np.zeros((3, 3, 3), np.uint8), 100).shape == (3, 3)


def test_bad_arguments_raise() -> None:
    with pytest.raises(ValueError, match="HxWx3"):
        slic_reference(np.zeros((10, 10), np.uint8), 4)
    with pytest.raises(ValueError, match="compactness"):
        slic_reference(np.zeros((10, 10, 3), np.uint8), 4, compactness=0.0)


def test_column_major_is_slic_of_the_transpose() -> None:
    image = _blocks(seed=2)
    labels = slic_reference(image, 50, column_major=True)
    direct = slic_reference(np.ascontiguousarray(image.transpose(1, 0, 2)), 50)
    assert np.array_equal(labels, direct.T)


def test_reference_lab_matches_textbook_values() -> None:
    colours = np.array([[[255, 255, 255], [0, 0, 0], [255, 0, 0], [0, 0, 255]]], dtype=np.uint8)
    lab = reference_lab(colours)[0]
    expected = np.array([[100.0, 0.0, 0.0], [0.0, 0.0, 0.0], [53.24, 80.09, 67.20], [32.30, 79.19, -107.86]])
    np.testing.assert_allclose(lab, expected, atol=0.05)


def test_segment_uses_reference_slic() -> None:
    image = _blocks(seed=4)
    assert np.array_equal(segment(image, 80, 20.0).labels, slic_reference(image, 80, 20.0))


# Labels of the authors' SLIC (K=250, m=20) on two dev images, computed by an independent, slow
# numpy transliteration of the C++ SLIC shipped with MC's code (which reproduces MC's reference
# maps pixel for pixel on all 300 dev images): (segment count, sha256 of the int32 label image).
TRANSLITERATION = {
    "0001": (241, "9a876ac72b3be9e1dc53156ba0180364f55d99c74e4b2d378f8a7d3ef989c3f0"),
    "0120": (242, "9b760d7c09ba4f3a2f76a93ab41eeff5c0c6626e297dffa874517657bce5b523"),
}


@pytest.mark.parametrize("stem", sorted(TRANSLITERATION))
def test_equals_reference_transliteration_on_real_images(stem: str) -> None:
    path = DATA / f"{stem}.jpg"
    if not path.exists():
        pytest.skip(f"needs the shared dev images ({path})")
    from relicv2.saliency.images import read_rgb

    labels = slic_reference(read_rgb(path), 250, 20.0)
    count, digest = TRANSLITERATION[stem]
    assert labels.max() + 1 == count
    assert hashlib.sha256(labels.astype(np.int32).tobytes()).hexdigest() == digest
