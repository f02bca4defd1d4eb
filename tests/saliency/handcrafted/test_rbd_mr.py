"""RBD and MR: object above background, invariants, bad inputs, pieces, fidelity to the authors."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import rankdata

from saliency.handcrafted.mr import MRConfig, mr_saliency, ranking_matrix, two_stage_ranking
from saliency.handcrafted.rbd import (
    boundary_connectivity,
    optimise_saliency,
    otsu_threshold,
    rbd_saliency,
)
from saliency.synthetic import synthetic_scene

METHODS = {"rbd": rbd_saliency, "mr": mr_saliency}


def _auc(saliency: np.ndarray, mask: np.ndarray) -> float:
    """Probability that a random object pixel outranks a random background pixel."""
    ranks = rankdata(saliency.ravel())
    inside = mask.ravel() > 0
    n_in, n_out = inside.sum(), (~inside).sum()
    return float((ranks[inside].sum() - n_in * (n_in + 1) / 2) / (n_in * n_out))


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("seed", [0, 1])
def test_object_ranks_above_textured_background(name, seed):
    rgb, mask = synthetic_scene(120, 160, seed=seed)
    saliency = METHODS[name](rgb)
    assert saliency.shape == (120, 160) and saliency.dtype == np.float32
    assert saliency.min() >= 0.0 and saliency.max() <= 1.0 and np.isfinite(saliency).all()
    assert saliency[mask > 0].mean() > saliency[mask == 0].mean() + 0.5
    assert _auc(saliency, mask) > 0.95
    assert (METHODS[name](rgb) == saliency).all()  # deterministic


def _bad_inputs() -> dict[str, np.ndarray]:
    rgb, _ = synthetic_scene(96, 128, seed=4)
    framed = np.full((136, 168, 3), 255, np.uint8)
    framed[20:-20, 20:-20] = rgb
    long, _ = synthetic_scene(24, 600, seed=6)
    return {
        "grey": rgb.mean(axis=2).astype(np.uint8),
        "rgba": np.dstack([rgb, np.full(rgb.shape[:2], 128, np.uint8)]),
        "tiny": rgb[40:60, 50:74],
        "one_pixel": rgb[:1, :1],
        "flat": np.full((80, 100, 3), 77, np.uint8),
        "framed": framed,
        "extreme_aspect": long,
        "one_column": rgb[:, :1],
    }


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("case", list(_bad_inputs()))
def test_bad_inputs_give_a_defined_map(name, case):
    image = _bad_inputs()[case]
    saliency = METHODS[name](image)
    assert saliency.shape == image.shape[:2] and saliency.dtype == np.float32
    assert np.isfinite(saliency).all() and saliency.min() >= 0 and saliency.max() <= 1
    if case == "flat":
        assert (saliency == 0).all()


@pytest.mark.parametrize("name", METHODS)
def test_framed_image_keeps_the_object_and_zeroes_the_frame(name):
    rgb, mask = synthetic_scene(110, 150, seed=2)
    framed = np.zeros((134, 174, 3), np.uint8)
    framed[12:-12, 12:-12] = rgb
    saliency = METHODS[name](framed)
    assert (saliency[:10] == 0).all() and (saliency[:, -10:] == 0).all()
    inner = saliency[12:-12, 12:-12]
    assert inner[mask > 0].mean() > inner[mask == 0].mean() + 0.5


def test_greyscale_equals_three_identical_channels():
    rgb, _ = synthetic_scene(seed=7)
    grey = rgb.mean(axis=2).astype(np.uint8)
    for method in METHODS.values():
        assert (method(grey) == method(np.dstack([grey] * 3))).all()


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


@pytest.mark.parametrize("name", METHODS)
def test_close_to_the_authors_reference_maps(shared_data, name):
    from saliency.images import read_gray, read_rgb
    from saliency.metrics import normalise_prediction

    root = shared_data / "pascal-s-dev"
    correlations = []
    for stem in ("0003", "0005", "0007", "0012"):
        ours = normalise_prediction(np.rint(METHODS[name](read_rgb(root / "images" / f"{stem}.jpg")) * 255))
        reference = normalise_prediction(read_gray(root / "reference-maps" / name / f"{stem}.png"))
        correlations.append(np.corrcoef(ours.ravel(), reference.ravel())[0, 1])
    # Over all 300 dev images the mean correlation is ~0.9 (benchmarks/compare_reference.py).
    assert np.mean(correlations) > 0.8
