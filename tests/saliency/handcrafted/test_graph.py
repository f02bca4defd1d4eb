"""saliency.handcrafted.graph: superpixels, their features, graphs, distances, normalisation."""

from __future__ import annotations

import numpy as np
import pytest

from relicv2.saliency.handcrafted import graph
from tests.scenes import synthetic_scene

LABELS = np.array(
    [
        [0, 0, 1, 1],
        [0, 0, 1, 1],
        [2, 2, 3, 3],
        [2, 2, 3, 3],
    ]
)


def test_slic_follows_colour_edges_with_reference_compactness():
    # Two colours split at a column off the superpixel grid: with the reference SLIC's
    # compactness (20 in Lab units) no superpixel may straddle the edge. A compactness applied
    # to skimage's [0, 1]-rescaled input would give grid squares that cut across it.
    image = np.zeros((90, 120, 3), np.uint8)
    image[:, :53] = (200, 40, 40)
    image[:, 53:] = (40, 160, 200)
    image = np.clip(image + np.random.default_rng(0).integers(-3, 4, image.shape), 0, 255).astype(np.uint8)
    labels = graph.segment(image, 40, 20.0).labels
    left, right = set(np.unique(labels[:, :53])), set(np.unique(labels[:, 53:]))
    assert not left & right
    count = labels.max() + 1
    assert set(np.unique(labels)) == set(range(count)) and 20 <= count <= 60
    assert (graph.segment(image, 40, 20.0).labels == labels).all()  # deterministic


def test_segment_features():
    rgb, _ = synthetic_scene(seed=3)
    seg = graph.segment(rgb, 100)
    assert seg.labels.shape == rgb.shape[:2] and seg.count == seg.labels.max() + 1
    assert seg.size.sum() == rgb.shape[0] * rgb.shape[1]
    some = seg.labels == 5
    assert np.allclose(seg.mean_rgb[5], rgb[some].mean(axis=0))
    rows, cols = np.nonzero(some)
    assert np.allclose(seg.mean_position[5], [(rows + 1).mean() / 120, (cols + 1).mean() / 160])
    assert np.allclose(seg.lab_of_mean_rgb[5], graph.rgb_values_to_lab(seg.mean_rgb[5:6])[0])


def test_adjacency_4_and_8_connectivity():
    adj4 = graph.adjacency(LABELS, 4, connectivity=4)
    expected = np.zeros((4, 4), bool)
    for a, b in [(0, 1), (0, 2), (1, 3), (2, 3)]:
        expected[a, b] = expected[b, a] = True
    assert (adj4 == expected).all()
    adj8 = graph.adjacency(LABELS, 4, connectivity=8)
    expected[0, 3] = expected[3, 0] = expected[1, 2] = expected[2, 1] = True
    assert (adj8 == expected).all()


def test_two_ring_and_clique_on_a_path():
    path = np.zeros((5, 5), bool)
    for i in range(4):
        path[i, i + 1] = path[i + 1, i] = True
    ring = graph.two_ring(path)
    assert ring[0, 1] and ring[0, 2] and not ring[0, 3] and not ring.diagonal().any()
    linked = graph.link_clique(path, np.array([0, 4]))
    assert linked[0, 4] and linked[4, 0] and not linked[0, 3] and not linked.diagonal().any()


def test_boundary_and_border_ids():
    # rows of blocks: label = 10 * row + (col >= 5)
    labels = np.arange(100).reshape(10, 10) // 10 * 10 + np.arange(10)[None, :] // 5
    assert graph.boundary_ids(labels).tolist() == sorted({*labels[0], *labels[-1], *labels[:, 0], *labels[:, -1]})
    top, bottom, left, right = graph.border_ids(labels)
    assert top.tolist() == [0, 1] and bottom.tolist() == [90, 91]
    assert left.tolist() == list(range(0, 100, 10)) and right.tolist() == list(range(1, 100, 10))
    assert graph.boundary_ids(labels).tolist() == sorted({*top, *bottom, *left, *right})
    # a 3-px band reaches the second and third block rows (labels 10, 11, 20, 21, 70, 71, 80, 81)
    thick = set(graph.boundary_ids(labels, thickness=3).tolist())
    assert thick == set(graph.boundary_ids(labels).tolist()) | {10, 11, 20, 21, 70, 71, 80, 81}


def test_distances_and_weights():
    points = np.array([[0.0, 0.0], [3.0, 4.0]])
    assert np.allclose(graph.pairwise_distances(points), [[0, 5], [5, 0]])
    weights = graph.distance_to_weight(np.array([0.0, 1.0, 3.5]), sigma=1.0)
    assert np.allclose(weights, [1.0, np.exp(-0.5), 0.0])  # cut off beyond 3 sigma
    assert graph.distance_to_weight(np.array([3.5]), sigma=1.0, cutoff=None)[0] == pytest.approx(np.exp(-6.125))
    assert (graph.to_pixels(np.array([0.25, 0.75, 0, 1]), LABELS)[3, 3] == 1.0)
    assert graph.to_pixels(np.array([0.25, 0.75, 0, 1]), LABELS).dtype == np.float32


def test_minmax_normalise_is_the_one_normalisation():
    assert np.allclose(graph.minmax_normalise(np.array([1.0, 2.0, 3.0])), [0, 0.5, 1])
    assert np.allclose(graph.minmax_normalise(np.array([[-4.0, 0.0], [4.0, 2.0]])), [[0, 0.5], [1, 0.75]])
    flat = np.full(5, 2.0)
    assert (graph.minmax_normalise(flat) == 0).all()
    assert (graph.minmax_normalise(flat, keep_constant=True) == 2.0).all()  # MC's `normalize`
    assert (graph.minmax_normalise(flat + np.array([0, 1e-15, 0, 0, 0])) == 0).all()  # rounding noise
    with_nan = graph.minmax_normalise(np.array([np.nan, 1.0, 3.0, np.inf]))
    assert np.allclose(with_nan, [0, 1 / 3, 1, 0])
    assert graph.minmax_normalise(np.array([])).size == 0
