"""Achanta's reference SLIC superpixels (as shipped with the saliency authors' code), compiled with numba.

The four handcrafted methods were published with Achanta et al.'s C++ SLIC (TPAMI 2012), and
their maps depend on its exact output. scikit-image's ``slic`` is a different algorithm in the
details that matter (seed placement, distance scaling, size-based connectivity merging) and is
~5x slower, so the reference algorithm is reimplemented here, step by step:

1. pixels to CIE Lab with the reference's own conversion (sRGB gamma, D65, float64);
2. seeds on a grid of step ``S = round(sqrt(H W / K))``, the remainder spread evenly over the
   rows and columns; optionally moved to the lowest Lab-gradient pixel of their 3x3
   neighbourhood (``perturb_seeds``; MC's copy, also used by DSR, does not do this);
3. 10 k-means iterations, each seed scanning a ``2S x 2S`` window with the squared distance
   ``d_lab^2 + d_xy^2 (m / S)^2`` (strict ``<``: the lower seed index wins ties);
4. connectivity: 4-connected pieces taken in raster order of their first pixel; a piece of at
   most a quarter of the nominal size ``H W / K'`` (``K' = H W / S^2``) takes the label of an
   already labelled 4-neighbour of that first pixel (the last one found, left/up/right/down).

The per-pixel loops run in numba (``cache=True``: compiled once per machine, then loaded from disk);
float arithmetic follows the reference order, so labels are reproducible bit for bit.
"""

from __future__ import annotations

import numba
import numpy as np

from relicv2.saliency.handcrafted.colour import REFERENCE_RGB_TO_XYZ, srgb_to_linear

_LINEAR = srgb_to_linear(np.arange(256, dtype=np.float64) / 255.0)  # sRGB 0..255 -> linear RGB


@numba.njit(cache=True)
def _lab_kernel(rgb: np.ndarray, linear: np.ndarray, m: np.ndarray) -> np.ndarray:
    height, width = rgb.shape[0], rgb.shape[1]
    lab = np.empty((height, width, 3), dtype=np.float64)
    for y in range(height):
        for x in range(width):
            r = linear[rgb[y, x, 0]]
            g = linear[rgb[y, x, 1]]
            b = linear[rgb[y, x, 2]]
            # same summation order as ``lin @ M.T``: r*m0 + g*m1 + b*m2
            fx = r * m[0, 0] + g * m[0, 1] + b * m[0, 2]
            fy = r * m[1, 0] + g * m[1, 1] + b * m[1, 2]
            fz = r * m[2, 0] + g * m[2, 1] + b * m[2, 2]
            fx = np.cbrt(fx) if fx > 0.008856 else 7.787069 * fx + 0.137931
            fy = np.cbrt(fy) if fy > 0.008856 else 7.787069 * fy + 0.137931
            fz = np.cbrt(fz) if fz > 0.008856 else 7.787069 * fz + 0.137931
            lab[y, x, 0] = 116.0 * fy - 16.0
            lab[y, x, 1] = 500.0 * (fx - fy)
            lab[y, x, 2] = 200.0 * (fy - fz)
    return lab


def reference_lab(rgb: np.ndarray) -> np.ndarray:
    """CIE Lab (D65, L in [0, 100]) of a uint8 RGB image as the reference SLIC computes it, float64."""
    array = np.ascontiguousarray(rgb, dtype=np.uint8)
    return _lab_kernel(array, _LINEAR, REFERENCE_RGB_TO_XYZ)


def _grid_seeds(height: int, width: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """Seed positions (x, y) on the reference grid: step ``step``, remainder spread evenly, row by row."""
    axes = []
    for length in (width, height):
        count = int(0.5 + length / step)
        if length - step * count < 0:
            count -= 1
        per_seed = (length - step * count) / max(count, 1)
        index = np.arange(max(count, 1))
        # clamp: only reachable on images smaller than one step
        axes.append(np.minimum(index * step + step // 2 + (index * per_seed).astype(np.int64), length - 1))
    xs, ys = axes
    return np.tile(xs, ys.size).astype(np.float64), np.repeat(ys, xs.size).astype(np.float64)


def _perturb(lab: np.ndarray, seed_x: np.ndarray, seed_y: np.ndarray) -> None:
    """Move each seed to the lowest-gradient pixel of its 3x3 neighbourhood (Achanta's PerturbSeeds)."""
    height, width = lab.shape[0], lab.shape[1]
    gx = (lab[1:-1, :-2] - lab[1:-1, 2:]) ** 2
    gy = (lab[:-2, 1:-1] - lab[2:, 1:-1]) ** 2
    edges = np.zeros((height, width), dtype=np.float64)
    # channels summed in the reference's order, so that ties between neighbours break the same way
    edges[1:-1, 1:-1] = (gx[..., 0] + gx[..., 1] + gx[..., 2]) + (gy[..., 0] + gy[..., 1] + gy[..., 2])
    for k in range(seed_x.size):
        ox, oy = int(seed_x[k]), int(seed_y[k])
        bx, by = ox, oy
        for dx, dy in ((-1, 0), (-1, -1), (0, -1), (1, -1), (1, 0), (1, 1), (0, 1), (-1, 1)):
            x, y = ox + dx, oy + dy
            if 0 <= x < width and 0 <= y < height and edges[y, x] < edges[by, bx]:
                bx, by = x, y
        seed_x[k], seed_y[k] = bx, by


@numba.njit(cache=True)
def _cluster(lab_l, lab_a, lab_b, seed_x, seed_y, step, compactness, iterations):
    """The reference k-means: windowed assignment then mean update, ``iterations`` times. The Lab planes
    are contiguous, so the inner loop over a window row is branch-free and compiles to SIMD code."""
    height, width = lab_l.shape
    n = seed_x.size
    seed_l = np.empty(n)
    seed_a = np.empty(n)
    seed_b = np.empty(n)
    for k in range(n):
        sy, sx = int(seed_y[k]), int(seed_x[k])
        seed_l[k] = lab_l[sy, sx]
        seed_a[k] = lab_a[sy, sx]
        seed_b[k] = lab_b[sy, sx]
    ratio = step / compactness
    invwt = 1.0 / (ratio * ratio)
    labels = np.full((height, width), -1, dtype=np.int32)
    dist = np.empty((height, width), dtype=np.float64)
    xs = np.arange(width).astype(np.float64)
    sums = np.zeros((n, 5), dtype=np.float64)
    counts = np.zeros(n, dtype=np.float64)
    for _ in range(iterations):
        dist[:] = np.inf
        for k in range(n):
            y1 = int(max(0.0, seed_y[k] - step))
            y2 = int(min(float(height), seed_y[k] + step))
            x1 = int(max(0.0, seed_x[k] - step))
            x2 = int(min(float(width), seed_x[k] + step))
            sl, sa, sb, sx, sy = seed_l[k], seed_a[k], seed_b[k], seed_x[k], seed_y[k]
            kk = np.int32(k)
            for y in range(y1, y2):
                dy = y - sy
                dy2 = dy * dy
                # slices indexed from 0: provably non-negative indices, so numba emits no
                # wraparound checks and LLVM vectorises the loop
                row_l = lab_l[y, x1:x2]
                row_a = lab_a[y, x1:x2]
                row_b = lab_b[y, x1:x2]
                row_x = xs[x1:x2]
                row_d = dist[y, x1:x2]
                row_k = labels[y, x1:x2]
                for i in range(x2 - x1):
                    dl = row_l[i] - sl
                    da = row_a[i] - sa
                    db = row_b[i] - sb
                    dx = row_x[i] - sx
                    d = (dl * dl + da * da + db * db) + (dx * dx + dy2) * invwt
                    better = d < row_d[i]
                    row_d[i] = d if better else row_d[i]
                    row_k[i] = kk if better else row_k[i]
        sums[:] = 0.0
        counts[:] = 0.0
        for y in range(height):
            for x in range(width):
                k = labels[y, x]
                if k < 0:
                    continue
                sums[k, 0] += lab_l[y, x]
                sums[k, 1] += lab_a[y, x]
                sums[k, 2] += lab_b[y, x]
                sums[k, 3] += x
                sums[k, 4] += y
                counts[k] += 1.0
        for k in range(n):
            c = counts[k] if counts[k] > 0 else 1.0
            seed_l[k] = sums[k, 0] / c
            seed_a[k] = sums[k, 1] / c
            seed_b[k] = sums[k, 2] / c
            seed_x[k] = sums[k, 3] / c
            seed_y[k] = sums[k, 4] / c
    return labels


@numba.njit(cache=True)
def _enforce_connectivity(labels: np.ndarray, min_size: int) -> np.ndarray:
    """Relabel 4-connected pieces in raster order; pieces of <= ``min_size`` px join a neighbour."""
    height, width = labels.shape
    out = np.full((height, width), -1, dtype=np.int32)
    queue_y = np.empty(height * width, dtype=np.int32)
    queue_x = np.empty(height * width, dtype=np.int32)
    nx = (-1, 0, 1, 0)
    ny = (0, -1, 0, 1)
    label = 0
    adjacent = 0
    for y0 in range(height):
        for x0 in range(width):
            if out[y0, x0] >= 0:
                continue
            out[y0, x0] = label
            for t in range(4):
                x, y = x0 + nx[t], y0 + ny[t]
                if 0 <= x < width and 0 <= y < height and out[y, x] >= 0:
                    adjacent = out[y, x]
            original = labels[y0, x0]
            queue_y[0] = y0
            queue_x[0] = x0
            head = 0
            tail = 1
            while head < tail:
                cy, cx = queue_y[head], queue_x[head]
                head += 1
                for t in range(4):
                    x, y = cx + nx[t], cy + ny[t]
                    if 0 <= x < width and 0 <= y < height and out[y, x] < 0 and labels[y, x] == original:
                        out[y, x] = label
                        queue_y[tail] = y
                        queue_x[tail] = x
                        tail += 1
            if tail <= min_size:
                for i in range(tail):
                    out[queue_y[i], queue_x[i]] = adjacent
                label -= 1
            label += 1
    return out


def slic_reference(rgb: np.ndarray, n_segments: int, compactness: float = 20.0, perturb_seeds: bool = False,
                   column_major: bool = False) -> np.ndarray:
    """Achanta's reference SLIC of a uint8 HxWx3 RGB image; int32 labels 0..n-1 (raster order).

    ``n_segments`` is the requested count K (the result is near it, not equal); ``compactness``
    is the reference's m (20 in all four saliency codes). Deterministic.

    The defaults are MC's copy (also DSR's); ``perturb_seeds=True, column_major=True`` reproduces MR's
    C++ (GMR), which runs Achanta's original SLIC on a column-major copy of the image (labels then
    numbered in column-major order, like GMR's).
    """
    if column_major:
        image = np.ascontiguousarray(np.asarray(rgb).transpose(1, 0, 2))
        labels = slic_reference(image, n_segments, compactness, perturb_seeds)
        return np.ascontiguousarray(labels.T)
    array = np.ascontiguousarray(rgb, dtype=np.uint8)
    if array.ndim != 3 or array.shape[2] != 3 or min(array.shape[:2]) < 1:
        raise ValueError(f"slic_reference expects a uint8 HxWx3 image, got shape {array.shape}")
    if compactness <= 0:
        raise ValueError(f"compactness must be > 0, got {compactness}")
    height, width = array.shape[:2]
    size = height * width
    segment_size = int(0.5 + size / max(1, int(n_segments)))
    step = max(1, int(np.sqrt(segment_size) + 0.5))
    lab = _lab_kernel(array, _LINEAR, REFERENCE_RGB_TO_XYZ)
    seed_x, seed_y = _grid_seeds(height, width, step)
    if perturb_seeds:
        _perturb(lab, seed_x, seed_y)
    planes = [np.ascontiguousarray(lab[:, :, c]) for c in range(3)]
    labels = _cluster(*planes, seed_x, seed_y, float(step), float(compactness), 10)  # the reference's 10 iterations
    nominal_count = max(1, int(size / (step * step)))
    return _enforce_connectivity(labels, (size // nominal_count) >> 2)
