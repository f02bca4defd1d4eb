"""RBD and MR: frame removal and their building blocks against hand-computed values.

The invariants every method shares are in test_invariants.py, fidelity to the authors' maps in
test_fidelity.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from relicv2.saliency.handcrafted.mr import MRConfig, mr_saliency, ranking_matrix, two_stage_ranking
from relicv2.saliency.handcrafted.rbd import (
    boundary_connectivity,
    optimise_saliency,
    otsu_threshold,
    rbd_saliency,
)
from tests.scenes import synthetic_scene

METHODS = {"rbd": rbd_saliency, "mr": mr_saliency}


@pytest.mark.parametrize("name", METHODS)
def test_framed_image_keeps_the_object_and_zeroes_the_frame(name):
    rgb, mask = synthetic_scene(110, 150, seed=2)
    framed = np.zeros((134, 174, 3), np.uint8)
    framed[12:-12, 12:-12] = rgb
    saliency = METHODS[name](framed)
    assert (saliency[:10] == 0).all() and (saliency[:, -10:] == 0).all()
    inner = saliency[12:-12, 12:-12]
    assert inner[mask > 0].mean() > inner[mask == 0].mean() + 0.5


def test_otsu_threshold_splits_two_modes_like_matlab():
    values = np.concatenate([np.full(50, 0.1), np.full(50, 0.9)])
    threshold = otsu_threshold(values)
    # The modes fall in 1-based bins 27 and 231 (round(255 x) + 1); every split k = 27..230
    # maximises the between-class variance and MATLAB takes their mean: (128.5 - 1) / 255.
    assert threshold == pytest.approx(127.5 / 255)
    assert otsu_threshold(np.full(10, 0.3)) == pytest.approx(0.0)


def test_boundary_connectivity_is_low_for_an_enclosed_region():
    # Path 0-1-2-3-4 with 0 and 4 on the boundary; node 2 differs strongly in colour.
    adj = np.zeros((5, 5), bool)
    for i in range(4):
        adj[i, i + 1] = adj[i + 1, i] = True
    colour = np.array([[0.0], [1.0], [40.0], [1.0], [0.0]])
    dist = np.abs(colour - colour.T)
    bdcon = boundary_connectivity(adj, np.array([0, 4]), dist, clip_value=0.5, geo_sigma=7.0)
    assert bdcon[2] < 0.5 < bdcon[0]
    assert bdcon[1] == pytest.approx(bdcon[3]) and bdcon[0] == pytest.approx(bdcon[4])


def test_saliency_optimisation_follows_the_weights():
    adj = np.zeros((3, 3), bool)
    adj[0, 1] = adj[1, 0] = adj[1, 2] = adj[2, 1] = True
    dist = np.full((3, 3), 100.0)  # beyond 3 sigma: no smoothness term, only mu * adjacency
    np.fill_diagonal(dist, 0.0)
    result = optimise_saliency(
        adj, np.array([0]), dist, 1.0, np.array([1.0, 0.0, 0.0]), np.array([0.0, 0.0, 1.0])
    )
    # Closed form: (L + diag(5 bg + fg)) s = fg with L the mu-weighted path Laplacian.
    laplacian = 0.1 * np.array([[1, -1, 0], [-1, 2, -1], [0, -1, 1]])
    expected = np.linalg.solve(laplacian + np.diag([5.0, 0.0, 1.0]), [0.0, 0.0, 1.0])
    assert np.allclose(result, expected)
    assert result[2] > result[1] > result[0]


def test_mr_ranking_matrix_and_two_stages():
    n = 6  # a chain 0-1-2-3-4-5, colours make 2, 3 stand out
    edges = np.zeros((n, n), bool)
    for i in range(n - 1):
        edges[i, i + 1] = edges[i + 1, i] = True
    colour = np.array([[0.0], [2.0], [50.0], [52.0], [3.0], [1.0]])
    dist = np.abs(colour - colour.T)
    affinity = ranking_matrix(edges, dist, MRConfig())
    weights = np.where(edges, np.exp(-(dist - 2.0) / (47.0 * 0.1)), 0.0)  # min 2, max 49 on edges
    expected = np.linalg.inv(np.diag(weights.sum(1)) - 0.99 * weights)
    np.fill_diagonal(expected, 0.0)
    assert np.allclose(affinity, expected)
    borders = (np.array([0]), np.array([5]), np.array([0, 1]), np.array([4, 5]))
    ranked = two_stage_ranking(affinity, borders)
    assert min(ranked[2], ranked[3]) > max(ranked[0], ranked[1], ranked[4], ranked[5])
