"""Saliency by absorbing Markov chain (MC; Jiang, Zhang, Lu, Yang, Yang, ICCV 2013).

A superpixel's saliency is its expected time to absorption ``y = (I - Q)^-1 1`` in a random walk on
a 2-ring graph whose absorbing states are copies of the border superpixels: background regions, similar
to the border, are absorbed quickly; the object is not.

Follows the authors' MATLAB code (``Saliency_Absorb_MC.m`` and its ``SubCode``) step by
step, including its own frame handling: when the border superpixels are dissimilar from their
inner neighbours (total 1-ring affinity <= 13) the border is taken for an artificial frame,
dropped, and the next ring becomes absorbing; isolated superpixels (affinity sum < 1.1) are
dropped and later set from their neighbours. Superpixels come from the reimplementation of the
authors' SLIC (``saliency.handcrafted.slic``), so the maps match the reference maps (correlation 1.000 on
the PASCAL-S dev images).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from relicv2.saliency.handcrafted.colour import REFERENCE_RGB_TO_XYZ
from relicv2.saliency.handcrafted.frame import guarded_map
from relicv2.saliency.handcrafted.graph import (
    adjacency,
    boundary_ids,
    minmax_normalise,
    segment,
    solve,
    to_pixels,
    two_ring,
)


@dataclass(frozen=True)
class MCConfig:
    """MC's parameters; defaults are the authors' MATLAB code's."""

    superpixels: int = 250
    compactness: float = 20.0
    weight_scale: float = 10.0  # edge weight exp(-scale d) + floor, d min-max normalised over edges
    weight_floor: float = 1e-5
    frame_affinity: float = 13.0  # total border-to-inner affinity below which the border is a frame
    outlier_affinity: float = 1.1  # superpixels whose affinity row sum (self-loop 1 included) is below are dropped
    outlier_neighbour_saliency: float = 0.3  # a dropped superpixel with a neighbour above this becomes 1
    flatness_limit: float = 2.0  # histogram spread from which the equilibrium-weighted time is used


def mc_saliency(rgb: np.ndarray, config: MCConfig = MCConfig()) -> np.ndarray:
    """MC saliency map: image (uint8 HxWx3; greyscale/RGBA accepted) -> float32 HxW in [0, 1]."""

    def compute(image: np.ndarray) -> np.ndarray | None:
        sp = segment(image, config.superpixels, config.compactness)
        if sp.count < 2:
            return None
        colour = mc_superpixel_lab(sp.mean_rgb)
        return to_pixels(absorbing_chain_saliency(sp.labels, colour, config), sp.labels)

    return guarded_map(rgb, compute, remove_frame="none")


def mc_superpixel_lab(mean_rgb: np.ndarray) -> np.ndarray:
    """The "Lab" colour MC's C++ SLIC gives each superpixel, from its mean RGB (0..255).

    The authors' ``RGB2LABSup`` applies a BT.709-style power law to the *unscaled* 0..255 mean,
    so it is not CIE Lab: after the cube root, distances grow roughly like ``rgb ** 0.74``
    instead of sRGB's perceptual curve. Reproduced because the graph weights depend on it.
    """
    value = np.asarray(mean_rgb, dtype=np.float64)
    linear = ((value + 0.099) / 1.099) ** 2.222
    linear = np.where(linear < 0.018, value / 4.5138, linear)
    xyz = linear @ REFERENCE_RGB_TO_XYZ.T
    f = np.where(xyz > 0.008856, np.cbrt(xyz), 7.787069 * xyz + 0.137931)
    return np.stack(
        [116.0 * f[:, 1] - 16.0, 500.0 * (f[:, 0] - f[:, 1]), 200.0 * (f[:, 1] - f[:, 2])], axis=1
    )


def mc_graph(labels: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray]:
    """MC's graphs: the 1-ring 8-connected adjacency, and the 2-ring adjacency after linking the
    superpixels at the two ends of every image column and row (no diagonal: the affinity adds it)."""
    ring = adjacency(labels, count, connectivity=8)
    linked = ring.copy()
    linked[labels[0, :], labels[-1, :]] = True
    linked[labels[:, 0], labels[:, -1]] = True
    return ring, two_ring(linked | linked.T)


def absorbing_chain_saliency(labels: np.ndarray, colour: np.ndarray,
                             config: MCConfig = MCConfig()) -> np.ndarray:
    """Per-superpixel MC saliency in [0, 1] for a label image and per-superpixel colours."""
    count = colour.shape[0]
    ring, graph = mc_graph(labels, count)
    affinity = _affinity(graph, colour, config)
    degree = affinity.sum(axis=1)
    outliers = np.flatnonzero(degree < config.outlier_affinity)
    state = _border_states(labels, ring, affinity, config.frame_affinity)
    state[outliers] = _DROPPED
    if not np.any(state == _ABSORBING):
        # no absorbing state left (tiny image whose border was all taken for a frame):
        # fall back to the border itself, as the no-frame branch does
        state = _border_states(labels, ring, affinity, frame_affinity=None)
        state[outliers] = _DROPPED
        if not np.any(state == _ABSORBING):
            return np.zeros(count)
    kept = np.flatnonzero(state != _DROPPED)
    weights = affinity[np.ix_(kept, kept)]
    # each transient state also leaks to the absorbing copies of the border superpixels, and
    # (as in the MATLAB code) to dropped superpixels: the degree uses the full affinity row
    absorbing_links = affinity[np.ix_(kept, np.flatnonzero(state == _ABSORBING))].sum(axis=1)
    kept_degree = degree[kept]
    fundamental = np.eye(kept.size) - weights / (kept_degree + absorbing_links)[:, None]
    # keep_constant: MC's MATLAB normalises with Leo Grady's ``normalize``
    absorbed = minmax_normalise(solve(fundamental, np.ones(kept.size)), keep_constant=True)
    if _histogram_spread(absorbed) >= config.flatness_limit:
        # equilibrium post-process: weight start states by the inverse stationary probability
        inverse_stationary = kept_degree.sum() / kept_degree
        absorbed = minmax_normalise(
            solve(fundamental, inverse_stationary / inverse_stationary.sum()), keep_constant=True
        )
    saliency = np.zeros(count)
    saliency[kept] = absorbed
    for outlier in outliers:  # sequential on purpose: an updated outlier can flip the next
        if np.any(saliency[ring[outlier]] > config.outlier_neighbour_saliency):
            saliency[outlier] = 1.0
    return saliency


_TRANSIENT, _ABSORBING, _DROPPED = 0, 1, 2


def _affinity(graph: np.ndarray, colour: np.ndarray, config: MCConfig) -> np.ndarray:
    """``exp(-10 d) + 1e-5`` on graph edges (d: Lab distance min-max normalised over edges) + I."""
    rows, cols = np.nonzero(np.triu(graph, 1))
    distance = np.sqrt(((colour[rows] - colour[cols]) ** 2).sum(axis=1))
    distance = minmax_normalise(distance, keep_constant=True)
    weight = np.exp(-config.weight_scale * distance) + config.weight_floor
    affinity = np.eye(colour.shape[0])
    affinity[rows, cols] = weight
    affinity[cols, rows] = weight
    return affinity


def _border_states(labels: np.ndarray, ring: np.ndarray, affinity: np.ndarray,
                   frame_affinity: float | None) -> np.ndarray:
    """Border superpixels absorbing, or, when their total affinity to the inner ones is at most
    ``frame_affinity`` (None: never), dropped as a frame with the next ring absorbing."""
    count = ring.shape[0]
    border = np.zeros(count, dtype=bool)
    border[boundary_ids(labels)] = True
    state = np.where(border, _ABSORBING, _TRANSIENT)
    inner_links = ring[border][:, ~border]
    if frame_affinity is None or affinity[border][:, ~border][inner_links].sum() > frame_affinity:
        return state
    second_ring = inner_links.any(axis=0)
    state[border] = _DROPPED
    state[np.flatnonzero(~border)[second_ring]] = _ABSORBING
    return state


def _histogram_spread(values: np.ndarray) -> float:
    """MC's "entropy": mass of a 10-bin histogram weighted by distance to the nearer end (1..5)."""
    bins = np.minimum(np.floor(values * 10).astype(np.int64), 9)
    share = np.bincount(bins, minlength=10)[:10] / values.size
    return float(share @ np.minimum(np.arange(1, 11), np.arange(10, 0, -1)))
