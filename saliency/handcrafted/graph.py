"""Superpixel graphs shared by the handcrafted methods: segmentation, per-superpixel features,
adjacency, rings, border superpixels, distances, weights and painting values back to pixels.

Pure functions of numpy arrays; superpixel ids are 0..n-1, contiguous. Positions are normalised
``[y / H, x / W]`` as in the RBD code's ``GetNormedMeanPos``; adjacency matrices are dense
``bool (n, n)`` with a ``False`` diagonal (n is a few hundred, so dense linear algebra is both
the simplest and the fastest choice).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from relicv2.saliency.handcrafted.colour import as_rgb, rgb_to_lab, rgb_values_to_lab
from relicv2.saliency.handcrafted.slic import slic_reference


@dataclass(frozen=True)
class Superpixels:
    """A segmentation and the per-superpixel features every method needs.

    labels: int32 HxW, ids 0..count-1; size: pixels per superpixel;
    mean_rgb: (n, 3) mean RGB 0..255; mean_lab: (n, 3) mean of per-pixel Lab;
    mean_position: (n, 2) mean [y / H, x / W].
    """

    labels: np.ndarray
    count: int
    size: np.ndarray
    mean_rgb: np.ndarray
    mean_lab: np.ndarray
    mean_position: np.ndarray

    @property
    def lab_of_mean_rgb(self) -> np.ndarray:
        """Lab of each superpixel's mean RGB (RBD's and MC's MATLAB feature), ``(n, 3)``."""
        return rgb_values_to_lab(self.mean_rgb)


def segment(rgb: np.ndarray, n_segments: int, compactness: float = 20.0,
            lab: np.ndarray | None = None, *, gmr_variant: bool = False) -> Superpixels:
    """SLIC-segment ``rgb`` exactly as the authors' C++ SLIC does (int32 labels 0..n-1; not skimage's slic,
    which is another algorithm: see saliency.handcrafted.slic) and compute the standard per-superpixel
    features (``lab``: a precomputed :func:`rgb_to_lab` of ``rgb`` for the Lab means).

    ``gmr_variant``: MR's C++ (GMR) packs the image column-major before calling Achanta's original
    SLIC, which also moves each seed to the lowest-gradient pixel of its 3x3 neighbourhood; so it
    segments the transposed image with seed perturbation (correlation to MR's reference maps
    .983 vs .921 for the plain variant, measured on 40 dev images).
    """
    if lab is None:
        lab = rgb_to_lab(rgb)
    labels = slic_reference(as_rgb(rgb), n_segments, compactness, perturb_seeds=gmr_variant, column_major=gmr_variant)
    count = int(labels.max()) + 1
    size = np.bincount(labels.ravel(), minlength=count).astype(np.float64)
    return Superpixels(labels, count, size, mean_rgb=superpixel_means(labels, rgb, count, size),
                       mean_lab=superpixel_means(labels, lab, count, size),
                       mean_position=mean_positions(labels, count, size))


def superpixel_means(labels: np.ndarray, values: np.ndarray, count: int, size: np.ndarray) -> np.ndarray:
    """Mean of ``values`` (HxW or HxWxC) over each superpixel of ``size`` pixels, float64 ``(n, C)``."""
    flat = labels.ravel()
    channels = np.asarray(values).reshape(flat.size, -1)
    sums = np.stack([np.bincount(flat, weights=channels[:, c], minlength=count)
                     for c in range(channels.shape[1])], axis=1)
    return sums / np.maximum(size, 1.0)[:, None]


def mean_positions(labels: np.ndarray, count: int, size: np.ndarray) -> np.ndarray:
    """Mean ``[row / H, col / W]`` of each superpixel (RBD's ``GetNormedMeanPos``), ``(n, 2)``; 1-based
    pixel coordinates like the MATLAB original, so that values agree exactly."""
    height, width = labels.shape
    rows_cols = np.stack(np.mgrid[1 : height + 1, 1 : width + 1], axis=2).astype(np.float64)
    return superpixel_means(labels, rows_cols, count, size) / np.array([height, width], dtype=np.float64)


def adjacency(labels: np.ndarray, count: int, connectivity: Literal[4, 8] = 4) -> np.ndarray:
    """Superpixels sharing a pixel edge (4: RBD's ``GetAdjMatrix``) or also a pixel corner (8: the MR
    C++ code); bool, no diagonal."""
    adj = np.zeros((count, count), dtype=bool)
    pairs = [(labels[1:, :], labels[:-1, :]), (labels[:, 1:], labels[:, :-1])]
    if connectivity == 8:
        pairs += [(labels[1:, 1:], labels[:-1, :-1]), (labels[1:, :-1], labels[:-1, 1:])]
    for a, b in pairs:
        differ = a != b
        adj[a[differ], b[differ]] = True
    adj |= adj.T
    np.fill_diagonal(adj, False)
    return adj


def two_ring(adj: np.ndarray) -> np.ndarray:
    """Neighbours and neighbours of neighbours (``(A + A A) > 0``), bool, no diagonal."""
    a = adj.astype(np.float32)
    ring = (a + a @ a) > 0
    np.fill_diagonal(ring, False)
    return ring


def link_clique(adj: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Copy of ``adj`` with every pair of nodes in ``ids`` linked (e.g. all boundary nodes)."""
    linked = adj.copy()
    ids = np.asarray(ids, dtype=np.int64)
    linked[np.ix_(ids, ids)] = True
    np.fill_diagonal(linked, False)
    return linked


def boundary_ids(labels: np.ndarray, thickness: int = 1) -> np.ndarray:
    """Sorted ids of superpixels touching a band of ``thickness`` pixels along the image border (RBD: 8,
    ``GetBndPatchIds``; MR, MC and DSR: the outermost pixels)."""
    t = max(1, int(thickness))
    band = np.concatenate(
        [labels[:t, :].ravel(), labels[-t:, :].ravel(), labels[:, :t].ravel(), labels[:, -t:].ravel()]
    )
    return np.unique(band).astype(np.int64)


def border_ids(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ids of superpixels on the top, bottom, left and right outermost pixel lines."""
    lines = (labels[0], labels[-1], labels[:, 0], labels[:, -1])
    return tuple(np.unique(line).astype(np.int64) for line in lines)


def pairwise_distances(features: np.ndarray) -> np.ndarray:
    """Euclidean distance matrix between rows of ``features`` (n, d), float64 (n, n)."""
    f = np.asarray(features, dtype=np.float64)
    sq = np.einsum("ij,ij->i", f, f)
    d2 = sq[:, None] + sq[None, :] - 2.0 * (f @ f.T)
    np.maximum(d2, 0.0, out=d2)
    dist = np.sqrt(d2)
    np.fill_diagonal(dist, 0.0)
    return dist


def distance_to_weight(dist: np.ndarray, sigma: float, cutoff: float | None = 3.0) -> np.ndarray:
    """``exp(-d^2 / 2 sigma^2)``, set to 0 beyond ``cutoff * sigma`` (RBD's ``Dist2WeightMatrix``)."""
    dist = np.asarray(dist, dtype=np.float64)
    weight = np.exp(-(dist**2) / (2.0 * sigma * sigma))
    if cutoff is not None:
        weight[dist > cutoff * sigma] = 0.0
    return weight


def minmax_normalise(values: np.ndarray, *, keep_constant: bool = False) -> np.ndarray:
    """Scale ``values`` to [0, 1] by their min and max, float64 (NaN and inf count as 0).

    A constant input (span below 1e-12 of its magnitude) gives all zeros; with
    ``keep_constant`` it keeps its value instead (Leo Grady's ``normalize``, which MC's code
    uses). The one min-max normalisation of the saliency package (methods and metrics).
    """
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
    span = hi - lo
    if not span > 1e-12 * max(1.0, abs(hi)):
        return np.full_like(v, lo) if keep_constant else np.zeros_like(v)
    return (v - lo) / span


def solve(matrix: np.ndarray, rhs: np.ndarray) -> np.ndarray:
    """``matrix^-1 rhs``; when a closed group of nodes with zero weights (a degenerate image) makes
    ``matrix`` singular, the least-squares solution, still the minimum-norm minimiser of the same cost."""
    try:
        return np.linalg.solve(matrix, rhs)
    except np.linalg.LinAlgError:
        return np.linalg.lstsq(matrix, rhs, rcond=None)[0]


def to_pixels(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Paint per-superpixel ``values`` back onto the label image, float32 HxW."""
    return np.asarray(values, dtype=np.float32)[labels]
