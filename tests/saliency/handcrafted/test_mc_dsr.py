"""MC (absorbing Markov chain) and DSR (dense and sparse reconstruction): frame handling and their
building blocks against reference loops and hand-computed values.

The invariants every method shares are in test_invariants.py, fidelity to the authors' maps in
test_fidelity.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from relicv2.saliency.handcrafted.dsr import bayes_posterior, object_biased_gaussian
from relicv2.saliency.handcrafted.mc import _histogram_spread, mc_saliency
from relicv2.saliency.handcrafted.reconstruction import (
    dense_reconstruction_error,
    lasso_lars,
    propagate_errors,
    sparse_reconstruction_error,
)
from tests.scenes import striped_scene


def object_on_texture(height: int = 96, width: int = 128, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The striped synthetic scene with a boolean object mask."""
    image, mask = striped_scene(height, width, seed)
    return image, mask > 0


def test_mc_removes_artificial_frame():
    # a thick uniform frame unlike the inside: MC drops the border superpixels (its own frame
    # test) and absorbs at the next ring, so the object still wins and the frame is 0
    image, mask = object_on_texture(120, 160, seed=5)
    framed = image.copy()
    framed[:12], framed[-12:], framed[:, :12], framed[:, -12:] = 0, 0, 0, 0
    saliency = mc_saliency(framed)
    inner = np.zeros_like(mask)
    inner[12:-12, 12:-12] = True
    assert saliency[mask].mean() > saliency[inner & ~mask].mean() + 0.3
    assert saliency[:4].max() == 0.0


# --------------------------------------------------------------------------- building blocks


@pytest.mark.parametrize("shape", [(20, 15, 30, 0.05), (8, 40, 50, 0.01), (10, 5, 20, 0.3)])
def test_lasso_lars_matches_scikit_learn_lasso(shape):
    dim, atoms_n, signals_n, lam = shape
    rng = np.random.default_rng(dim)
    atoms = rng.normal(size=(atoms_n, dim))
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    signals = rng.normal(size=(signals_n, dim))
    ours = lasso_lars(atoms, signals, lam)
    # Imported here: scikit-learn costs ~1 s at collection in every test process, most of which never run this.
    from sklearn.linear_model import Lasso

    # SPAMS' objective 0.5||x - Da||^2 + lam|a|_1 is scikit-learn's with alpha = lam / dim
    lasso = Lasso(alpha=lam / dim, fit_intercept=False, tol=1e-12, max_iter=100_000)
    ref = np.stack([lasso.fit(atoms.T, x).coef_ for x in signals])
    np.testing.assert_allclose(ours, ref, atol=1e-6)


def test_lasso_lars_caps_active_atoms_and_zero_below_lambda():
    rng = np.random.default_rng(1)
    atoms = rng.normal(size=(12, 6))
    atoms /= np.linalg.norm(atoms, axis=1, keepdims=True)
    signals = rng.normal(size=(30, 6))
    capped = lasso_lars(atoms, signals, 1e-4, max_active=2)
    assert (np.count_nonzero(capped, axis=1) <= 2).all()
    assert np.count_nonzero(lasso_lars(atoms, 1e-3 * signals, 0.5)) == 0


def test_sparse_error_small_for_templates_large_for_outliers():
    rng = np.random.default_rng(2)
    background = np.abs(rng.normal([0.3, 0.5, 0.3, 0.4, 0.5, 0.5, 0.5, 0.5], 0.05, (40, 8)))
    outlier = np.array([[0.9, 0.1, 0.1, 0.5, 0.9, 0.8, 0.5, 0.5]])
    errors = sparse_reconstruction_error(np.vstack([background, outlier]), background)
    assert errors[-1] == 1.0 and errors[:-1].max() < 0.2


def test_dense_error_zero_in_background_subspace():
    rng = np.random.default_rng(3)
    basis = np.linalg.qr(rng.normal(size=(8, 2)))[0].T  # a 2-D subspace of R^8
    background = rng.normal(size=(50, 2)) @ basis
    inside = rng.normal(size=(10, 2)) @ basis
    off = inside + 3.0 * np.linalg.qr(np.vstack([basis, rng.normal(size=(1, 8))]).T)[0][:, 2]
    features = np.vstack([background, inside, off])
    errors = dense_reconstruction_error(features - features.mean(0) + background.mean(0), background)
    assert errors[60:].min() > 0.9 and errors[:60].max() < 1e-6


def _propagate_naive(features, errors, clusters, weight=0.5):
    """Transliteration of the authors' descendPropagation.m loop."""
    n = len(errors)
    sigma2 = np.mean([np.sum((features[:, k] - features[:, k].mean()) ** 2) / n for k in range(features.shape[1])])
    dist = np.zeros((n, n))
    for i in range(n):
        for j in range(i + 1, n):
            dist[i, j] = dist[j, i] = np.exp(-np.sum((features[i] - features[j]) ** 2) / (2 * sigma2))
    data = errors.astype(np.float64).copy()
    for i in np.argsort(errors, kind="stable")[::-1]:
        members = np.flatnonzero(clusters == clusters[i])
        total = dist[i, members].sum() or np.finfo(float).eps
        data[i] = (1 - weight) * data[i] + weight / total * (dist[i, members] @ data[members])
    return (data - data.min()) / (data.max() - data.min())


def test_propagation_equals_sequential_reference_loop():
    rng = np.random.default_rng(4)
    features = rng.random((60, 8))
    errors = rng.random(60)
    clusters = rng.integers(0, 5, 60)
    clusters[7] = 9  # a singleton cluster keeps half its error
    np.testing.assert_allclose(
        propagate_errors(features, errors, clusters), _propagate_naive(features, errors, clusters), atol=1e-12
    )


def test_mc_histogram_spread_hand_computed():
    # bins 0 (weight 1), 4 (weight 5) and the value 1.0 (bin 9, weight 1), equally shared
    assert _histogram_spread(np.array([0.05, 0.45, 1.0])) == pytest.approx((1 + 5 + 1) / 3)


def test_gaussian_and_bayes_keep_object():
    _, mask = object_on_texture()
    saliency = mask.astype(np.float64) * 0.8 + 0.1
    refined = object_biased_gaussian(saliency)
    assert refined[mask].min() > refined[~mask].max()
    posterior = bayes_posterior(refined, refined)
    assert posterior[mask].mean() > posterior[~mask].mean() + 0.5
