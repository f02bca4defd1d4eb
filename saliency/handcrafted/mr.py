"""Graph-based Manifold Ranking saliency (Yang, Zhang, Lu, Ruan, Yang, CVPR 2013).

Follows the authors' C++ implementation (``GMRsaliency``), whose maps are the fidelity target:
frame removal with Canny edges (two sides needed), SLIC with 200 superpixels and compactness
20, superpixel adjacency from 8-connected pixels, all boundary superpixels linked, then every
node linked to its neighbours' neighbours on that graph; weights
``exp(-(d - d_min) / ((d_max - d_min) sigma^2))`` with ``d`` the Lab distance of mean Lab
colours over the edges and sigma^2 = 0.1; ranking matrix ``(D - alpha W)^-1`` with zero
diagonal, alpha = 0.99; stage 1 ranks against each border, stage 2 against the foreground
queries (stage-1 map above its mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relicv2.saliency.handcrafted.frame import guarded_map
from relicv2.saliency.handcrafted.graph import (
    adjacency,
    border_ids,
    boundary_ids,
    link_clique,
    minmax_normalise,
    pairwise_distances,
    segment,
    to_pixels,
    two_ring,
)


@dataclass(frozen=True)
class MRConfig:
    """MR's parameters; defaults are the authors' C++ code's."""

    superpixels: int = 200
    compactness: float = 20.0
    alpha: float = 0.99
    sigma_squared: float = 0.1  # "delta" in the C++ code, 1/theta in the MATLAB code


def mr_saliency(rgb: np.ndarray, config: MRConfig = MRConfig()) -> np.ndarray:
    """MR saliency map: image (uint8 HxWx3; greyscale/RGBA accepted) -> float32 HxW in [0, 1]."""

    def compute(image: np.ndarray) -> np.ndarray | None:
        sp = segment(image, config.superpixels, config.compactness, gmr_variant=True)
        if sp.count < 3:
            return None
        affinity = ranking_matrix(mr_graph(sp.labels, sp.count), pairwise_distances(sp.mean_lab), config)
        values = two_stage_ranking(affinity, border_ids(sp.labels))
        return to_pixels(minmax_normalise(values), sp.labels)

    return guarded_map(rgb, compute, remove_frame="canny", min_frame_sides=2)


def mr_graph(labels: np.ndarray, count: int) -> np.ndarray:
    """Edges of the C++ code: 8-adjacency plus boundary clique, then closed under 2 hops."""
    return two_ring(link_clique(adjacency(labels, count, connectivity=8), boundary_ids(labels)))


def ranking_matrix(edges: np.ndarray, colour_dist: np.ndarray, config: MRConfig) -> np.ndarray:
    """``(D - alpha W)^-1`` with its diagonal zeroed (the optimal affinity matrix)."""
    dist = colour_dist[edges]
    lo, hi = float(dist.min()), float(dist.max())
    span = (hi - lo) * config.sigma_squared
    weights = np.zeros_like(colour_dist)
    weights[edges] = np.exp(-(dist - lo) / span) if span > 0 else 1.0
    degree = np.diag(weights.sum(axis=1))
    affinity = np.linalg.inv(degree - config.alpha * weights)
    np.fill_diagonal(affinity, 0.0)
    return affinity


def two_stage_ranking(affinity: np.ndarray,
                      borders: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]) -> np.ndarray:
    """Stage 1: product of complemented border rankings; stage 2: rank against its foreground."""
    background = np.zeros((affinity.shape[0], len(borders)))
    for side, ids in enumerate(borders):
        background[ids, side] = 1.0
    scores = affinity @ background
    stage1 = np.prod([1.0 - minmax_normalise(scores[:, side]) for side in range(len(borders))], axis=0)
    queries = (stage1 > stage1.mean()).astype(np.float64)
    return affinity @ queries
