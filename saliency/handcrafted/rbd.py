"""Robust Background Detection saliency (Zhu, Liang, Wei, Sun, CVPR 2014).

Follows the authors' MATLAB code step by step (``demo.m``): frame removal with Sobel edges,
SLIC with ~600 pixels per superpixel and compactness 20, Lab of each superpixel's mean RGB,
boundary connectivity from geodesic distances on the adjacency graph with all boundary
superpixels linked, background-weighted contrast (Otsu-cleaned), and the closed-form
least-squares saliency optimisation. The image-adaptive parameters (clip value, geodesic
sigma, smoothness sigma) come from ``EstimateDynamicParas`` as in the original demo.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import shortest_path

from relicv2.saliency.handcrafted.frame import guarded_map
from relicv2.saliency.handcrafted.graph import (
    adjacency,
    boundary_ids,
    distance_to_weight,
    link_clique,
    minmax_normalise,
    pairwise_distances,
    segment,
    solve,
    to_pixels,
    two_ring,
)


@dataclass(frozen=True)
class RBDConfig:
    """RBD's parameters; defaults are the authors' code's (names as in the paper / MATLAB)."""

    pixels_per_superpixel: int = 600
    compactness: float = 20.0
    boundary_thickness: int = 8
    spatial_sigma: float = 0.4  # CalWeightedContrast spaSigma
    bdcon_sigma: float = 1.0  # EstimateBgProb bdConSigma
    bdcon_high: float = 3.0  # superpixels with BndCon above this are fixed as background
    bdcon_high_weight: float = 1000.0
    background_lambda: float = 5.0  # SaliencyOptimization bgLambda
    mu: float = 0.1  # regulariser on direct neighbours


def rbd_saliency(rgb: np.ndarray, config: RBDConfig = RBDConfig()) -> np.ndarray:
    """RBD saliency map: image (uint8 HxWx3; greyscale/RGBA accepted) -> float32 HxW in [0, 1]."""

    def compute(image: np.ndarray) -> np.ndarray | None:
        height, width = image.shape[:2]
        n_segments = max(1, round(height * width / config.pixels_per_superpixel))
        sp = segment(image, n_segments, config.compactness)
        if sp.count < 3:
            return None
        values = rbd_superpixel_saliency(adj=adjacency(sp.labels, sp.count, connectivity=4),
                                         boundary=boundary_ids(sp.labels, config.boundary_thickness),
                                         colour_dist=pairwise_distances(sp.lab_of_mean_rgb),
                                         position_dist=pairwise_distances(sp.mean_position),
                                         config=config)
        return to_pixels(minmax_normalise(values), sp.labels)

    return guarded_map(rgb, compute, remove_frame="sobel", min_frame_sides=1)


def rbd_superpixel_saliency(adj: np.ndarray, boundary: np.ndarray, colour_dist: np.ndarray,
                            position_dist: np.ndarray,
                            config: RBDConfig = RBDConfig()) -> np.ndarray:
    """Optimised saliency per superpixel (unnormalised), from the graph and distance matrices."""
    clip_value, geo_sigma, neighbour_sigma = dynamic_parameters(adj, colour_dist)
    bdcon = boundary_connectivity(adj, boundary, colour_dist, clip_value, geo_sigma)
    background = 1.0 - np.exp(-(bdcon**2) / (2.0 * config.bdcon_sigma**2))
    background_weight = np.where(bdcon > config.bdcon_high, config.bdcon_high_weight, background)
    contrast = weighted_contrast(colour_dist, position_dist, background, config.spatial_sigma)
    return optimise_saliency(adj, boundary, colour_dist, neighbour_sigma, background_weight, contrast, config)


def dynamic_parameters(adj: np.ndarray, colour_dist: np.ndarray) -> tuple[float, float, float]:
    """Clip value, geodesic sigma and smoothness sigma (``EstimateDynamicParas``)."""
    mean_min1 = _mean_neighbour_min(adj, colour_dist)
    edges = colour_dist[np.tril(adj, -1)]
    top = np.sort(edges)[::-1]
    n_top = max(1, round(0.01 * top.size))
    mean_top = float(top[:n_top].mean()) if top.size else 0.0
    clip_value = _mean_neighbour_min(two_ring(adj), colour_dist)  # meanMin2
    geo_sigma = max(min(10.0, 3.0 * mean_min1, mean_top / 10.0), 5.0)
    neighbour_sigma = min(3.0 * mean_min1, 0.2 * mean_top, 20.0)
    # A (near) flat image has zero neighbour distances; keep the Gaussian defined.
    return clip_value, geo_sigma, max(neighbour_sigma, 1e-3)


def _mean_neighbour_min(adj: np.ndarray, dist: np.ndarray) -> float:
    nearest = np.where(adj, dist, np.inf).min(axis=1)
    nearest = nearest[np.isfinite(nearest)]
    return float(nearest.mean()) if nearest.size else 0.0


def boundary_connectivity(adj: np.ndarray, boundary: np.ndarray, colour_dist: np.ndarray,
                          clip_value: float, geo_sigma: float) -> np.ndarray:
    """BndCon = Len_bnd / sqrt(Area) from clipped geodesic colour distances (paper Eq. 1-4)."""
    linked = link_clique(adj, boundary)
    rows, cols = np.nonzero(np.triu(linked, 1))
    # The original keeps zero-cost edges as edges; csgraph drops explicit zeros, so nudge them.
    weights = np.maximum(0.0, colour_dist[rows, cols] - clip_value) + 1e-10
    n = adj.shape[0]
    graph = csr_matrix((weights, (rows, cols)), shape=(n, n))
    geodesic = shortest_path(graph, method="D", directed=False)
    span = distance_to_weight(geodesic, geo_sigma)  # unreachable (inf) -> weight 0
    length = span[:, boundary].sum(axis=1)
    area = span.sum(axis=1)
    return length / np.sqrt(area)


def weighted_contrast(colour_dist: np.ndarray, position_dist: np.ndarray, background: np.ndarray,
                      spatial_sigma: float) -> np.ndarray:
    """Background-weighted contrast, min-max normalised, values under Otsu's threshold zeroed."""
    spatial = distance_to_weight(position_dist, spatial_sigma)
    contrast = minmax_normalise((colour_dist * spatial) @ background)
    contrast[contrast < otsu_threshold(contrast)] = 0.0
    return contrast


def otsu_threshold(values: np.ndarray) -> float:
    """MATLAB ``graythresh`` on values in [0, 1]: Otsu over a 256-bin histogram. Not skimage's
    ``threshold_otsu``: MATLAB bins doubles at round(255 x) and takes the mean of tied bins."""
    bins = np.clip(np.rint(np.asarray(values, dtype=np.float64) * 255.0), 0, 255).astype(np.int64)
    p = np.bincount(bins, minlength=256) / bins.size
    omega = np.cumsum(p)
    mu = np.cumsum(p * np.arange(1, 257))
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma_b = (mu[-1] * omega - mu) ** 2 / (omega * (1.0 - omega))
    finite = np.isfinite(sigma_b)
    if not finite.any():
        return 0.0
    best = np.max(sigma_b[finite])
    index = np.mean(np.flatnonzero(finite & (sigma_b == best)) + 1)
    return float((index - 1) / 255.0)


def optimise_saliency(adj: np.ndarray, boundary: np.ndarray, colour_dist: np.ndarray,
                      neighbour_sigma: float, background_weight: np.ndarray,
                      foreground_weight: np.ndarray, config: RBDConfig = RBDConfig()) -> np.ndarray:
    """Closed-form minimiser of the background/foreground/smoothness cost (paper Eq. 9)."""
    neighbours = link_clique(two_ring(adj), boundary)
    smooth = np.where(neighbours, distance_to_weight(colour_dist, neighbour_sigma), 0.0)
    weights = smooth + config.mu * adj
    laplacian = np.diag(weights.sum(axis=0)) - weights
    system = laplacian + np.diag(config.background_lambda * background_weight + foreground_weight)
    return solve(system, foreground_weight)
