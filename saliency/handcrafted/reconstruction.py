"""DSR's dense and sparse reconstruction errors against the border templates, and their propagation
within K-means clusters, following the authors' MATLAB code. Pure functions; features are rows ``(n, d)``.
"""

from __future__ import annotations

import numpy as np
from scipy.linalg import solve_triangular

from relicv2.saliency.handcrafted.graph import minmax_normalise

# The authors' values; saliency.handcrafted.dsr.DSRConfig takes its defaults from here.
PCA_ENERGY = 0.95
LASSO_LAMBDA = 0.01
PROPAGATION_WEIGHT = 0.5
NUM_CLUSTERS = 8
KMEANS_MAX_ITER = 200


def dense_reconstruction_error(features: np.ndarray, background: np.ndarray,
                               energy: float = PCA_ENERGY) -> np.ndarray:
    """Distance of each feature row to the principal subspace of the ``background`` rows.

    As in the authors' ``PCA.m``: the basis holds the principal axes of the centred
    background templates, one *more* than the smallest number reaching ``energy`` of the variance
    (their energy loop stops one index late); reconstruction is centred on the mean of *all*
    features. Returns the Euclidean errors min-max normalised to [0, 1], shape ``(n,)``.
    """
    features = np.asarray(features, dtype=np.float64)
    background = np.asarray(background, dtype=np.float64)
    centred = features - features.mean(axis=0)
    if background.shape[0] < 2:
        return minmax_normalise(np.linalg.norm(centred, axis=1))
    from sklearn.decomposition import PCA  # here: importing scikit-learn costs ~1 s of start-up

    pca = PCA(svd_solver="full").fit(background)
    ratio = pca.explained_variance_ratio_
    rank = int(np.sum(pca.singular_values_ > 1e-10 * max(pca.singular_values_[0], 1e-300)))
    reaching = int(np.searchsorted(np.cumsum(ratio), energy - 1e-12)) + 1
    # "+ 1" is the reference's off-by-one; capped at the rank, beyond which the reference
    # would normalise a numerically zero vector into an arbitrary direction
    dims = max(1, min(reaching + 1, rank))
    basis = pca.components_[:dims]
    residual = centred - (centred @ basis.T) @ basis
    return minmax_normalise(np.linalg.norm(residual, axis=1))


def sparse_reconstruction_error(features: np.ndarray, background: np.ndarray,
                                lam: float = LASSO_LAMBDA) -> np.ndarray:
    """Squared residual of each (unit-normalised) feature coded over the normalised templates.

    Solves ``min_a 0.5 ||x - D a||^2 + lambda ||a||_1`` (SPAMS ``mexLasso`` mode 2, lambda
    ``lam``, the authors' 0.01 by default, at most ``d`` atoms) for every row ``x``. Zero rows are left as they are, like the
    authors' ``normVector``. Returns the errors min-max normalised to [0, 1], shape ``(n,)``.
    """
    signals = _unit_rows(np.asarray(features, dtype=np.float64))
    atoms = _unit_rows(np.asarray(background, dtype=np.float64))
    coef = lasso_lars(atoms, signals, lam, max_active=signals.shape[1])
    residual = signals - coef @ atoms
    return minmax_normalise(np.einsum("ij,ij->i", residual, residual))


def _unit_rows(values: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(values, axis=1, keepdims=True)
    return values / np.where(norms > 0, norms, 1.0)


def lasso_lars(atoms: np.ndarray, signals: np.ndarray, lam: float,
               max_active: int | None = None) -> np.ndarray:
    """Lasso codes of many signals over one dictionary by the LARS homotopy, batched.

    Minimises ``0.5 ||x - a @ atoms||^2 + lam ||a||_1`` for each row ``x`` of ``signals``
    (``atoms``: ``(m, d)``; returns ``(n, m)``). This is SPAMS' objective (no ``1/n`` factor:
    scikit-learn's ``Lasso`` solves the same problem with ``alpha = lam / d``) and SPAMS'
    stopping rules: at most ``max_active`` atoms (the path stops after its first step with
    that many), at most ``4 * max_active - 1`` steps, and no atom that is linearly dependent
    on the active ones. Hand-written because the DSR dictionaries are ill-conditioned (coordinate
    descent needs ~10^5 sweeps) and the per-signal loop of scikit-learn's LARS costs ~1.5 ms
    a signal; here every signal takes its homotopy steps together as small batched solves.
    """
    atoms = np.asarray(atoms, dtype=np.float64)
    signals = np.asarray(signals, dtype=np.float64)
    n, m = signals.shape[0], atoms.shape[0]
    limit = min(m, max_active if max_active is not None else m)
    coef_full = np.zeros((n, m))
    if n == 0 or m == 0 or limit == 0:
        return coef_full
    gram = atoms @ atoms.T + 1e-10 * np.eye(m)  # SPAMS adds max(lambda2, 1e-10) to the diagonal
    corr0 = signals @ atoms.T
    slots = np.arange(limit)
    entering = np.argmax(np.abs(corr0), axis=1)
    level = np.abs(corr0[np.arange(n), entering])
    # state of the signals still on their path (nothing to do when no correlation exceeds lam)
    origin = np.flatnonzero(level > lam)
    corr0, entering, level = corr0[origin], entering[origin], level[origin]
    index = np.zeros((origin.size, limit), dtype=np.int64)
    sign = np.zeros((origin.size, limit))
    coef = np.zeros((origin.size, limit))
    count = np.zeros(origin.size, dtype=np.int64)
    adding = np.ones(origin.size, dtype=bool)
    for _ in range(4 * limit - 1):
        if origin.size == 0:
            break
        live = np.ones(origin.size, dtype=bool)
        valid = slots[None, :] < count[:, None]
        corr = corr0 - _scatter(coef, index, m, valid) @ gram
        # 1. add the entering atom unless it is (numerically) dependent on the active set
        if adding.any():
            dependent = adding & (_schur_pivot(gram, index, count, entering) < 1e-15)
            live &= ~dependent
            grow = np.flatnonzero(adding & ~dependent)
            index[grow, count[grow]] = entering[grow]
            sign[grow, count[grow]] = np.sign(corr[grow, entering[grow]])
            count[grow] += 1
            valid = slots[None, :] < count[:, None]
        # 2. equiangular direction: G_AA w = sign_A, so active correlations fall at rate 1
        sub = gram[index[:, :, None], index[:, None, :]]
        sub = np.where(valid[:, :, None] & valid[:, None, :], sub, np.eye(limit)[None])
        direction = np.linalg.solve(sub, (sign * valid)[:, :, None])[:, :, 0]
        slope = _scatter(direction, index, m, valid) @ gram
        # 3. step: first of (an inactive atom catches up, an active coefficient hits 0, lambda)
        in_set = _scatter(valid.astype(np.float64), index, m, valid) > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            up = np.where(1.0 - slope > 0, (level[:, None] - corr) / (1.0 - slope), np.inf)
            down = np.where(1.0 + slope > 0, (level[:, None] + corr) / (1.0 + slope), np.inf)
            catch = np.where(in_set, np.inf, np.minimum(up, down))
            drop = np.where(valid & (coef != 0), -coef / direction, np.inf)
        drop = np.where(drop > 0, drop, np.inf)
        rows = np.arange(origin.size)
        entering_next = np.argmin(catch, axis=1)
        gamma = np.minimum(catch[rows, entering_next], level - lam)
        drop_slot = np.argmin(drop, axis=1)
        drop_gamma = drop[rows, drop_slot]
        dropping = drop_gamma < gamma
        gamma = np.where(dropping, drop_gamma, gamma)
        # a negative step means the path has already passed lam (SPAMS' "bad exit")
        live &= gamma >= 0
        step = np.where(live, gamma, 0.0)
        coef += step[:, None] * direction * valid
        level = level - step
        # 4. remove an atom whose coefficient crossed zero; otherwise the next one enters
        dropping &= live
        if dropping.any():
            coef[dropping, drop_slot[dropping]] = 0.0
            keep = valid & ~((slots[None, :] == drop_slot[:, None]) & dropping[:, None])
            order = np.argsort(np.where(keep, slots, limit + slots), axis=1, kind="stable")
            index = np.take_along_axis(index, order, axis=1)
            sign = np.take_along_axis(sign, order, axis=1)
            coef = np.take_along_axis(coef, order, axis=1)
            count -= dropping
        adding = ~dropping
        entering = np.where(adding, entering_next, entering)
        valid = slots[None, :] < count[:, None]
        residual = signals[origin] - _scatter(coef, index, m, valid) @ atoms
        live &= ~((adding & (count == limit))
                  | (level - lam < 1e-15)
                  | (np.einsum("ij,ij->i", residual, residual) < 1e-15))
        # finished signals leave the batch with their codes
        done = ~live
        coef_full[origin[done]] = _scatter(coef[done], index[done], m, valid[done])
        origin, corr0, entering, level = origin[live], corr0[live], entering[live], level[live]
        index, sign, coef, count, adding = index[live], sign[live], coef[live], count[live], adding[live]
    valid = slots[None, :] < count[:, None]
    coef_full[origin] = _scatter(coef, index, m, valid)
    return coef_full


def _scatter(values: np.ndarray, index: np.ndarray, m: int, valid: np.ndarray) -> np.ndarray:
    """Dense ``(n, m)`` matrix with ``values[i, s]`` at column ``index[i, s]`` (valid slots)."""
    out = np.zeros((values.shape[0], m))
    rows = np.broadcast_to(np.arange(values.shape[0])[:, None], index.shape)
    out[rows[valid], index[valid]] = values[valid]
    return out


def _schur_pivot(gram, index, count, entering):
    """``G_kk - g_kA G_AA^-1 g_Ak`` for each signal's entering atom k (Cholesky pivot)."""
    n, limit = index.shape
    valid = np.arange(limit)[None, :] < count[:, None]
    sub = gram[index[:, :, None], index[:, None, :]]
    sub = np.where(valid[:, :, None] & valid[:, None, :], sub, np.eye(limit)[None])
    cross = gram[index, entering[:, None]] * valid
    proj = np.linalg.solve(sub, cross[:, :, None])[:, :, 0]
    return gram[entering, entering] - np.einsum("ij,ij->i", cross, proj)


def cluster_labels(features: np.ndarray, num_clusters: int = NUM_CLUSTERS, seed: int = 0,
                   max_iter: int = KMEANS_MAX_ITER) -> np.ndarray:
    """K-means (random initial centres, as ``vgg_kmeans``) cluster index of each row."""
    features = np.asarray(features, dtype=np.float64)
    distinct = np.unique(features, axis=0).shape[0]
    k = max(1, min(num_clusters, distinct))
    if k == 1:
        return np.zeros(features.shape[0], dtype=np.int64)
    from sklearn.cluster import KMeans  # here: importing scikit-learn costs ~1 s of start-up

    km = KMeans(k, init="random", n_init=1, max_iter=max_iter, tol=0.0, random_state=seed)
    centres = km.fit(features).cluster_centers_
    # label by nearest final centre, as the authors' labelCluster does
    d2 = ((features[:, None, :] - centres[None, :, :]) ** 2).sum(axis=2)
    return np.argmin(d2, axis=1)


def propagate_errors(features: np.ndarray, errors: np.ndarray, clusters: np.ndarray,
                     weight_of_neighbours: float = PROPAGATION_WEIGHT) -> np.ndarray:
    """Context-based propagation of reconstruction errors within K-means clusters.

    Superpixels are visited from the largest initial error down; each becomes
    ``0.5 e_i + 0.5 * sum_j w_ij e_j / sum_j w_ij`` over the *other* members of its cluster,
    with ``w_ij = exp(-||f_i - f_j||^2 / 2 sigma^2)`` (sigma^2: mean per-dimension variance)
    and already-visited members counted with their updated errors. That in-place sweep is a
    Gauss-Seidel step, so it is solved here exactly as one triangular system in visiting
    order. Returns the errors min-max normalised to [0, 1].
    """
    features = np.asarray(features, dtype=np.float64)
    errors = np.asarray(errors, dtype=np.float64)
    sigma2 = features.var(axis=0).mean()
    sq = np.einsum("ij,ij->i", features, features)
    d2 = np.maximum(sq[:, None] + sq[None, :] - 2.0 * (features @ features.T), 0.0)
    weight = np.exp(-d2 / (2.0 * max(sigma2, 1e-300)))
    weight *= clusters[:, None] == clusters[None, :]
    np.fill_diagonal(weight, 0.0)
    total = weight.sum(axis=1)
    total[total == 0] = np.finfo(np.float64).eps
    order = np.argsort(errors, kind="stable")[::-1]  # MATLAB: ascending sort walked backwards
    share = weight_of_neighbours * weight[np.ix_(order, order)] / total[order][:, None]
    visited = np.tril(share, -1)
    rhs = (1.0 - weight_of_neighbours) * errors[order] + np.triu(share, 1) @ errors[order]
    updated = solve_triangular(np.eye(errors.size) - visited, rhs, lower=True, unit_diagonal=True)
    result = np.empty_like(errors)
    result[order] = updated
    return minmax_normalise(result)
