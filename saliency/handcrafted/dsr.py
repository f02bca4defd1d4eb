"""Saliency by dense and sparse reconstruction (DSR; Li, Lu, Zhang, Ruan, Yang, ICCV 2013).

At each of eight SLIC scales every superpixel is reconstructed from the border superpixels, densely
(PCA) and sparsely (Lasso); both errors are propagated within K-means clusters, fused over the scales,
refined by an object-biased Gaussian and integrated by Bayes' rule, each map the other's prior.

Follows the authors' MATLAB code (``GetDSR.m`` and its helpers) step by step, including two
quirks kept on purpose because they shape the output: the pixel-level fusion weight compares
pixel coordinates in pixels with superpixel centres in [0, 1] (so it is essentially an
inverse distance to the top-left corner, nearly equal across scales), and the Bayesian
likelihood of the inner region looks up the outer histogram with the inner bin indices.
Superpixels: the reimplementation of the authors' SLIC (``saliency.handcrafted.slic``; the reference run used
the SLIC of MC's code in place of DSR's Windows executable). Deviations: K-means seeded (the
reference is not) and run once per scale for both errors instead of twice. No frame removal
(the authors' ``deletebd.m`` is an offline step that needs a Pb edge map).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relicv2.saliency.handcrafted.colour import D65_WHITE, RGB_TO_XYZ, rgb_to_lab
from relicv2.saliency.handcrafted.frame import guarded_map
from relicv2.saliency.handcrafted.graph import (
    boundary_ids,
    minmax_normalise,
    segment,
    superpixel_means,
)
from relicv2.saliency.handcrafted.reconstruction import (
    KMEANS_MAX_ITER,
    LASSO_LAMBDA,
    NUM_CLUSTERS,
    PCA_ENERGY,
    PROPAGATION_WEIGHT,
    cluster_labels,
    dense_reconstruction_error,
    propagate_errors,
    sparse_reconstruction_error,
)


@dataclass(frozen=True)
class DSRConfig:
    """DSR's parameters; defaults are the authors' MATLAB code's (``seed``: ours, fixes K-means)."""

    scales: tuple[tuple[int, float], ...] = (
        (50, 10.0), (100, 10.0), (150, 20.0), (200, 20.0),
        (250, 25.0), (300, 25.0), (350, 30.0), (400, 30.0),
    )  # (number of superpixels, SLIC compactness) of the eight scales
    pca_energy: float = PCA_ENERGY
    lasso_lambda: float = LASSO_LAMBDA
    num_clusters: int = NUM_CLUSTERS
    kmeans_max_iter: int = KMEANS_MAX_ITER
    propagation_weight: float = PROPAGATION_WEIGHT
    gaussian_sigma_ratio: float = 0.25  # object-biased Gaussian: sigma = ratio x side
    histogram_bins: int = 60  # Bayesian integration
    seed: int = 0


def dsr_saliency(rgb: np.ndarray, config: DSRConfig = DSRConfig()) -> np.ndarray:
    """DSR saliency map: image (uint8 HxWx3; greyscale/RGBA accepted) -> float32 HxW in [0, 1]."""

    def compute(image: np.ndarray) -> np.ndarray:
        errors = multiscale_errors(image, config)
        dense, sparse = (object_biased_gaussian(e, config.gaussian_sigma_ratio) for e in errors)
        posterior = bayes_posterior(sparse, dense, config.histogram_bins)
        return minmax_normalise(posterior + bayes_posterior(dense, sparse, config.histogram_bins))

    return guarded_map(rgb, compute, remove_frame="none")


def multiscale_errors(rgb: np.ndarray, config: DSRConfig = DSRConfig()) -> tuple[np.ndarray, np.ndarray]:
    """Propagated dense and sparse reconstruction errors fused over the scales, each HxW in [0, 1]."""
    height, width = rgb.shape[:2]
    lab = rgb_to_lab(rgb)  # for SLIC
    feature_lab = ruzon_lab(rgb)
    lab_min = feature_lab.reshape(-1, 3).min(axis=0).astype(np.float64)
    lab_span = feature_lab.reshape(-1, 3).max(axis=0) - lab_min
    lab_span = np.where(lab_span > 0, lab_span, np.inf)  # a constant channel becomes 0
    # per-pixel colour features of the fusion weight: RGB in [0, 1], min-max normalised Lab
    normalised_lab = ((feature_lab - lab_min) / lab_span).astype(np.float32)
    pixel_colour = np.concatenate([rgb.astype(np.float32) / 255.0, normalised_lab], axis=2)
    rows = np.arange(1, height + 1, dtype=np.float32)[:, None]
    cols = np.arange(1, width + 1, dtype=np.float32)[None, :]
    weight_sum = np.zeros((height, width), dtype=np.float32)
    dense_sum = np.zeros_like(weight_sum)
    sparse_sum = np.zeros_like(weight_sum)
    for count, compactness in config.scales:
        sp = segment(rgb, count, compactness, lab=lab)
        mean_lab = (superpixel_means(sp.labels, feature_lab, sp.count, sp.size) - lab_min) / lab_span
        features = np.concatenate([sp.mean_rgb / 255.0, mean_lab, sp.mean_position[:, ::-1]], axis=1)
        templates = features[boundary_ids(sp.labels)]
        clusters = cluster_labels(features, config.num_clusters, config.seed, config.kmeans_max_iter)
        errors = (dense_reconstruction_error(features, templates, config.pca_energy),
                  sparse_reconstruction_error(features, templates, config.lasso_lambda))
        dense, sparse = (propagate_errors(features, e, clusters, config.propagation_weight) for e in errors)
        weight = fusion_weight(pixel_colour, rows, cols, sp.labels, features)
        weight_sum += weight
        dense_sum += weight * dense.astype(np.float32)[sp.labels]
        sparse_sum += weight * sparse.astype(np.float32)[sp.labels]
    return minmax_normalise(dense_sum / weight_sum), minmax_normalise(sparse_sum / weight_sum)


def ruzon_lab(rgb: np.ndarray) -> np.ndarray:
    """The authors' ``RGB2Lab.m`` (Ruzon): CIE Lab formulas applied to *gamma-encoded* RGB, so far from
    CIE Lab; DSR's colour features are these values, min-max normalised per image. float32 HxWx3."""
    value = rgb.astype(np.float32) * np.float32(1.0 / 255.0)
    xyz = value @ _RUZON_RGB_TO_XYZ.T
    big = xyz > 0.008856
    f = np.where(big, np.cbrt(xyz), 7.787 * xyz + 16.0 / 116.0)
    lightness = np.where(big[..., 1], 116.0 * f[..., 1] - 16.0, 903.3 * xyz[..., 1])
    return np.stack(
        [lightness, 500.0 * (f[..., 0] - f[..., 1]), 200.0 * (f[..., 1] - f[..., 2])], axis=2
    ).astype(np.float32)


# BT.709 RGB -> XYZ with the D65 white point divided out of X and Z (as RGB2Lab.m does)
_RUZON_RGB_TO_XYZ = (RGB_TO_XYZ / D65_WHITE[:, None]).astype(np.float32)


def fusion_weight(pixel_colour: np.ndarray, rows: np.ndarray, cols: np.ndarray, labels: np.ndarray,
                  features: np.ndarray) -> np.ndarray:
    """Per-pixel weight of one scale, ``1 / (||pixel feature - its superpixel's feature|| + eps)``, as
    ``extractSupfeat.m``: raw 1-based (row, col) against normalised (x, y), so position dominates."""
    mean = features.astype(np.float32)
    diff = pixel_colour - mean[:, :6][labels]
    dist2 = np.einsum("ijk,ijk->ij", diff, diff)
    dist2 += (rows - mean[:, 6][labels]) ** 2
    dist2 += (cols - mean[:, 7][labels]) ** 2
    return 1.0 / (np.sqrt(dist2) + np.float32(np.finfo(np.float64).eps))


def object_biased_gaussian(saliency: np.ndarray,
                           sigma_ratio: float = DSRConfig.gaussian_sigma_ratio) -> np.ndarray:
    """Multiply by a Gaussian (sigma = ``sigma_ratio`` x side) centred on the saliency-weighted centroid."""
    height, width = saliency.shape
    total = float(saliency.sum())
    if not total > 0:
        return minmax_normalise(saliency)
    rows = np.arange(1, height + 1, dtype=np.float64)
    cols = np.arange(1, width + 1, dtype=np.float64)
    centre_row = float(rows @ saliency.sum(axis=1)) / total
    centre_col = float(saliency.sum(axis=0) @ cols) / total
    along_rows = np.exp(-((rows - centre_row) ** 2) / (2.0 * (height * sigma_ratio) ** 2))
    along_cols = np.exp(-((cols - centre_col) ** 2) / (2.0 * (width * sigma_ratio) ** 2))
    return minmax_normalise(np.outer(along_rows, along_cols) * saliency)


def bayes_posterior(prior: np.ndarray, observer: np.ndarray,
                    bins: int = DSRConfig.histogram_bins) -> np.ndarray:
    """Bayesian integration: posterior saliency from ``prior`` with likelihoods from ``observer``.

    The prior, thresholded at its mean, splits the image into inner and outer regions; each
    region's ``bins``-bin histogram of the observer map (over that region's own value range)
    gives the likelihoods. As in the authors' ``Bayes.m``, both likelihoods of a pixel are
    read at the bin of its own region's histogram. Returns the posterior min-max normalised.
    """
    inner = prior > prior.mean()
    if inner.all() or not inner.any():
        return minmax_normalise(prior)
    inner_bins = _bin_indices(observer[inner], bins)
    outer_bins = _bin_indices(observer[~inner], bins)
    inner_hist = np.bincount(inner_bins, minlength=bins) / inner_bins.size
    outer_hist = np.bincount(outer_bins, minlength=bins) / outer_bins.size
    posterior = np.empty_like(prior, dtype=np.float64)
    for region, region_bins in ((inner, inner_bins), (~inner, outer_bins)):
        p = prior[region]
        salient = inner_hist[region_bins] * p
        background = outer_hist[region_bins] * (1.0 - p)
        denom = salient + background
        posterior[region] = np.divide(salient, denom, out=np.zeros_like(salient), where=denom > 0)
    return minmax_normalise(posterior)


def _bin_indices(values: np.ndarray, count: int) -> np.ndarray:
    """0-based bins of ``ceil(count (v - min) / (max - min))`` clipped to 1..count (a flat region: the last)."""
    lo, hi = float(values.min()), float(values.max())
    if not hi > lo:
        return np.full(values.size, count - 1)
    bins = np.ceil(count * (values - lo) / (hi - lo)).astype(np.int64)
    return np.clip(bins, 1, count) - 1
