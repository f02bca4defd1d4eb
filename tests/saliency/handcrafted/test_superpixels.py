"""Shared saliency building blocks: input handling, SLIC, graphs, frames, image IO, registry."""

from __future__ import annotations

import numpy as np
import pytest
from skimage.color import rgb2lab

from saliency.handcrafted import superpixels as sp
from saliency.images import ImageReadError, decode_rgb, read_gray, read_rgb, write_map
from saliency.synthetic import synthetic_scene


def test_as_rgb_converts_grey_rgba_and_floats():
    grey = np.arange(12, dtype=np.uint8).reshape(3, 4)
    rgb = sp.as_rgb(grey)
    assert rgb.shape == (3, 4, 3) and rgb.dtype == np.uint8
    assert (rgb[..., 0] == grey).all() and (rgb[..., 2] == grey).all()
    rgba = np.dstack([rgb, np.full((3, 4), 7, np.uint8)])
    assert (sp.as_rgb(rgba) == rgb).all()
    floats = np.full((2, 2, 3), 0.5)
    assert (sp.as_rgb(floats) == 128).all()
    with pytest.raises(ValueError, match="shape"):
        sp.as_rgb(np.zeros((4, 4, 2), np.uint8))


def test_lab_of_colours_matches_skimage_and_known_points():
    colours = np.random.default_rng(0).uniform(0, 255, (40, 3))
    expected = rgb2lab(colours[None] / 255.0)[0]
    assert np.abs(sp.rgb_values_to_lab(colours) - expected).max() < 0.01
    white_black = sp.rgb_values_to_lab(np.array([[255, 255, 255], [0, 0, 0]]))
    assert np.allclose(white_black, [[100, 0, 0], [0, 0, 0]], atol=0.01)
    image = np.random.default_rng(1).integers(0, 256, (8, 8, 3), dtype=np.uint8)
    assert np.abs(sp.rgb_to_lab(image) - rgb2lab(image)).max() < 0.6


def test_slic_follows_colour_edges_with_reference_compactness():
    # Two colours split at a column off the superpixel grid: with the reference SLIC's
    # compactness (20 in Lab units) no superpixel may straddle the edge. A compactness applied
    # to skimage's [0, 1]-rescaled input would give grid squares that cut across it.
    image = np.zeros((90, 120, 3), np.uint8)
    image[:, :53] = (200, 40, 40)
    image[:, 53:] = (40, 160, 200)
    image = np.clip(image + np.random.default_rng(0).integers(-3, 4, image.shape), 0, 255).astype(np.uint8)
    labels = sp.slic_labels(image, 40, 20.0)
    left, right = set(np.unique(labels[:, :53])), set(np.unique(labels[:, 53:]))
    assert not left & right
    count = labels.max() + 1
    assert set(np.unique(labels)) == set(range(count)) and 20 <= count <= 60
    assert (sp.slic_labels(image, 40, 20.0) == labels).all()  # deterministic


def test_segment_features():
    rgb, _ = synthetic_scene(seed=3)
    seg = sp.segment(rgb, 100)
    assert seg.labels.shape == rgb.shape[:2] and seg.count == seg.labels.max() + 1
    assert seg.size.sum() == rgb.shape[0] * rgb.shape[1]
    some = seg.labels == 5
    assert np.allclose(seg.mean_rgb[5], rgb[some].mean(axis=0))
    rows, cols = np.nonzero(some)
    assert np.allclose(seg.mean_position[5], [(rows + 1).mean() / 120, (cols + 1).mean() / 160])


LABELS = np.array(
    [
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [2, 2, 3, 3],
        [2, 2, 3, 3],
    ]
)


def test_adjacency_4_and_8_connectivity():
    adj4 = sp.adjacency(LABELS, 4, connectivity=4)
    expected = np.zeros((4, 4), bool)
    for a, b in [(0, 1), (0, 2), (1, 3), (2, 3)]:
        expected[a, b] = expected[b, a] = True
    assert (adj4 == expected).all()
    adj8 = sp.adjacency(LABELS, 4, connectivity=8)
    expected[0, 3] = expected[3, 0] = expected[1, 2] = expected[2, 1] = True
    assert (adj8 == expected).all()


def test_two_ring_and_clique_on_a_path():
    path = np.zeros((5, 5), bool)
    for i in range(4):
        path[i, i + 1] = path[i + 1, i] = True
    ring = sp.two_ring(path)
    assert ring[0, 1] and ring[0, 2] and not ring[0, 3] and not ring.diagonal().any()
    linked = sp.link_clique(path, np.array([0, 4]))
    assert linked[0, 4] and linked[4, 0] and not linked[0, 3] and not linked.diagonal().any()


def test_boundary_and_border_ids():
    labels = np.arange(100).reshape(10, 10) // 10 * 10 + np.arange(10)[None, :] // 5
    # rows of blocks: label = 10 * row + (col >= 5)
    assert sp.boundary_ids(labels).tolist() == sorted({*labels[0], *labels[-1], *labels[:, 0], *labels[:, -1]})
    top, bottom, left, right = sp.border_ids(labels)
    assert top.tolist() == [0, 1] and bottom.tolist() == [90, 91]
    assert left.tolist() == list(range(0, 100, 10)) and right.tolist() == list(range(1, 100, 10))
    assert len(sp.boundary_ids(labels, thickness=3)) == len(sp.boundary_ids(labels))


def test_distances_weights_and_normalisation():
    points = np.array([[0.0, 0.0], [3.0, 4.0]])
    assert np.allclose(sp.pairwise_distances(points), [[0, 5], [5, 0]])
    weights = sp.distance_to_weight(np.array([0.0, 1.0, 3.5]), sigma=1.0)
    assert np.allclose(weights, [1.0, np.exp(-0.5), 0.0])  # cut off beyond 3 sigma
    assert (sp.minmax_normalise(np.full(5, 2.0)) == 0).all()
    assert np.allclose(sp.minmax_normalise(np.array([1.0, 2.0, 3.0])), [0, 0.5, 1])
    assert (sp.to_pixels(np.array([0.25, 0.75, 0, 1]), LABELS)[3, 3] == 1.0)


def _framed(width: int = 12) -> tuple[np.ndarray, np.ndarray]:
    content, mask = synthetic_scene(136, 176, seed=5)
    image = np.zeros((136 + 2 * width, 176 + 2 * width, 3), np.uint8)
    image[width:-width, width:-width] = content
    return image, mask


@pytest.mark.parametrize("edges,min_sides", [("sobel", 1), ("canny", 2)])
def test_detect_frame_finds_an_artificial_frame(edges, min_sides):
    image, _ = _framed(12)
    frame = sp.detect_frame(image, edges=edges, min_sides=min_sides)
    assert frame.has_frame
    for side in (frame.top, image.shape[0] - frame.bottom, frame.left, image.shape[1] - frame.right):
        assert 11 <= side <= 13
    plain, _ = synthetic_scene(160, 200, seed=5)
    assert not sp.detect_frame(plain, edges=edges, min_sides=min_sides).has_frame


def test_prepare_upscales_tiny_and_finish_restores_shape():
    prepared = sp.prepare(np.full((10, 300), 90, np.uint8))
    assert min(prepared.rgb.shape[:2]) >= sp.MIN_SIDE and prepared.rgb.shape[2] == 3
    out = prepared.finish(np.full(prepared.rgb.shape[:2], np.nan))
    assert out.shape == (10, 300) and out.dtype == np.float32 and np.isfinite(out).all()


def test_map_round_trip_and_bad_files(tmp_path):
    saliency = np.linspace(0, 1, 60, dtype=np.float32).reshape(6, 10)
    write_map(tmp_path / "m.png", saliency)
    back = read_gray(tmp_path / "m.png")
    assert back.dtype == np.uint8 and back.shape == (6, 10)
    assert back[0, 0] == 0 and back[-1, -1] == 255
    assert not list(tmp_path.glob("*.tmp"))  # atomic write leaves no temporary file
    (tmp_path / "bad.jpg").write_bytes(b"not an image")
    with pytest.raises(ImageReadError, match="bad.jpg"):
        read_rgb(tmp_path / "bad.jpg")
    with pytest.raises(ImageReadError, match="sample-7"):
        decode_rgb(b"\x00\x01", "sample-7")


def test_registry_is_explicit():
    from saliency.handcrafted.methods import METHODS, resolve_methods

    assert list(METHODS) == ["rbd", "mr", "dsr", "mc"]
    assert resolve_methods("all") == ["rbd", "mr", "dsr", "mc"]
    assert resolve_methods("mr, rbd") == ["mr", "rbd"]
    with pytest.raises(ValueError, match="unknown"):
        resolve_methods("rbd,gs")
