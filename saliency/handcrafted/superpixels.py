"""Shared building blocks of the handcrafted saliency methods (RBD, MR, DSR, MC).

Everything here is a pure function of numpy arrays; no global state. Superpixel ids are
0..n-1, contiguous. Conventions shared by all methods:

- images are ``uint8 HxWx3`` RGB after :func:`as_rgb` (greyscale and RGBA accepted there);
- Lab is CIE L*a*b* under D65 with L in [0, 100] (the scale of the authors' MATLAB
  ``colorspace`` / OpenCV float conversion, and of SLIC's compactness);
- positions are normalised ``[y / H, x / W]`` as in the RBD code's ``GetNormedMeanPos``;
- adjacency matrices are dense ``bool (n, n)`` with a ``False`` diagonal (n is a few hundred,
  so dense linear algebra is both the simplest and the fastest choice).

Public API (stable; later additions only):
    as_rgb(image) -> uint8 HxWx3
    rgb_to_lab(rgb) -> float32 HxWx3
    slic_labels(rgb, n_segments, compactness=20.0, *, max_num_iter=10, gmr_variant=False) -> int32 HxW
    segment(rgb, n_segments, compactness=20.0, lab=None, *, gmr_variant=False) -> Superpixels
    superpixel_means(labels, values, count) -> float64 (n, C)
    mean_positions(labels, count) -> float64 (n, 2)
    adjacency(labels, count, connectivity=4) -> bool (n, n)
    two_ring(adj) -> bool (n, n)
    link_clique(adj, ids) -> bool (n, n)
    boundary_ids(labels, thickness=1) -> int64 (k,)
    border_ids(labels) -> tuple of 4 int64 arrays (top, bottom, left, right)
    pairwise_distances(features) -> float64 (n, n)
    distance_to_weight(dist, sigma, cutoff=3.0) -> float64
    minmax_normalise(values) -> float64 in [0, 1] (all zeros when flat)
    to_pixels(values, labels) -> float32 HxW
    detect_frame(rgb, edges="sobel", min_sides=1) -> Frame
    Frame.crop(image), Frame.paste(map, fill=0.0)
    prepare(image, min_side=32) -> Prepared ; Prepared.finish(map) -> float32 HxW in [0, 1]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import cv2
import numpy as np

from saliency.handcrafted.slic import slic_reference

MIN_SIDE = 32
"""Images with a shorter side are upscaled before segmentation (and the map scaled back)."""


# --------------------------------------------------------------------------- input handling


def as_rgb(image: np.ndarray) -> np.ndarray:
    """Return ``image`` as contiguous ``uint8 HxWx3`` RGB.

    Accepts HxW greyscale, HxWx1, HxWx3 and HxWx4 (alpha dropped, not composited: the
    authors' MATLAB code reads only the colour planes too). Non-uint8 input is taken as
    [0, 1] floats when its maximum is <= 1, else as 0..255, and clipped.
    """
    array = np.asarray(image)
    if array.ndim == 2:
        array = array[:, :, None]
    if array.ndim != 3 or array.shape[2] not in (1, 3, 4) or min(array.shape[:2]) < 1:
        raise ValueError(
            f"expected an image of shape HxW, HxWx1, HxWx3 or HxWx4, got shape {array.shape}"
        )
    if array.dtype != np.uint8:
        data = np.nan_to_num(array.astype(np.float64), nan=0.0, posinf=255.0, neginf=0.0)
        if data.size and data.max() <= 1.0:
            data = data * 255.0
        array = np.clip(np.rint(data), 0, 255).astype(np.uint8)
    if array.shape[2] == 1:
        array = np.repeat(array, 3, axis=2)
    elif array.shape[2] == 4:
        array = array[:, :, :3]
    return np.ascontiguousarray(array)


def rgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """Per-pixel CIE Lab (D65, L in [0, 100]) of a uint8 RGB image, float32.

    OpenCV's float conversion is used because it is ~20x faster than skimage's and agrees
    with it (and with the authors' MATLAB ``colorspace``) to < 0.5 Lab units.
    """
    return cv2.cvtColor(rgb.astype(np.float32) * np.float32(1.0 / 255.0), cv2.COLOR_RGB2Lab)


def rgb_values_to_lab(rgb_values: np.ndarray) -> np.ndarray:
    """Lab of a list of RGB colours given in 0..255 (``(n, 3)`` floats), float64 ``(n, 3)``.

    This is RBD's ``colorspace('Lab<-', meanRgb / 255)``: Lab of the *mean RGB* of a region.
    Computed in float64 with the sRGB/D65 formulas (OpenCV's float path uses tables with
    ~0.05-unit steps; n is small, so exactness is free here).
    """
    c = np.asarray(rgb_values, dtype=np.float64).reshape(-1, 3) / 255.0
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    xyz = linear @ _RGB_TO_XYZ.T / _D65_WHITE
    f = np.where(xyz > (6.0 / 29.0) ** 3, np.cbrt(xyz), xyz / (3 * (6.0 / 29.0) ** 2) + 4.0 / 29.0)
    lab = np.empty_like(f)
    lab[:, 0] = 116.0 * f[:, 1] - 16.0
    lab[:, 1] = 500.0 * (f[:, 0] - f[:, 1])
    lab[:, 2] = 200.0 * (f[:, 1] - f[:, 2])
    return lab


_RGB_TO_XYZ = np.array(
    [
        [0.412453, 0.357580, 0.180423],
        [0.212671, 0.715160, 0.072169],
        [0.019334, 0.119193, 0.950227],
    ]
)
_D65_WHITE = np.array([0.950456, 1.0, 1.088754])


# --------------------------------------------------------------------------- superpixels


def slic_labels(
    rgb: np.ndarray,
    n_segments: int,
    compactness: float = 20.0,
    *,
    max_num_iter: int = 10,
    gmr_variant: bool = False,
) -> np.ndarray:
    """SLIC superpixels exactly as the authors' C++ SLIC computes them; int32 labels 0..n-1.

    Achanta's reference algorithm (:func:`saliency.handcrafted.slic.slic_reference`): grid seeds (no seed
    perturbation, as in the copy shipped with MC's code, also used by RBD and DSR), 2S x 2S search
    windows, squared distance ``d_lab^2 + (compactness / S)^2 d_xy^2``, ``max_num_iter`` iterations
    (10 in the authors' code), then pieces smaller than a quarter of the nominal size merged into
    the previously labelled neighbour. Lab comes from the reference's own float64 conversion of
    ``rgb`` (OpenCV's differs by up to ~0.5 Lab units, enough to move some superpixel borders).

    ``gmr_variant``: MR's C++ (GMR) packs the image column-major before calling Achanta's original
    SLIC, which also moves each seed to the lowest-gradient pixel of its 3x3 neighbourhood; so it
    segments the transposed image with seed perturbation (correlation to MR's reference maps
    .983 vs .921 for the plain variant, measured on 40 dev images).
    """
    # Hand-written (numba) rather than skimage.segmentation.slic: skimage's SLIC differs from the
    # authors' algorithm (seed placement, distance scaling, size-based connectivity merging) and
    # is ~5x slower; this one reproduces the reference labels pixel for pixel.
    return slic_reference(as_rgb(rgb), n_segments, compactness, max_num_iter=max_num_iter,
                          perturb_seeds=gmr_variant, column_major=gmr_variant)


def relabel(labels: np.ndarray) -> np.ndarray:
    """Map arbitrary integer labels to contiguous 0..n-1 (order preserved), int32."""
    labels = np.asarray(labels)
    flat = labels.ravel().astype(np.int64)
    lo = int(flat.min())
    counts = np.bincount(flat - lo)
    present = counts > 0
    if lo == 0 and present.all():
        return labels.astype(np.int32, copy=False)
    lookup = np.cumsum(present) - 1
    return lookup[flat - lo].reshape(labels.shape).astype(np.int32)


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


def segment(
    rgb: np.ndarray,
    n_segments: int,
    compactness: float = 20.0,
    lab: np.ndarray | None = None,
    *,
    gmr_variant: bool = False,
) -> Superpixels:
    """SLIC-segment ``rgb`` and compute the standard per-superpixel features (``lab``: a
    precomputed :func:`rgb_to_lab` of ``rgb`` for the Lab means; ``gmr_variant``: see
    :func:`slic_labels`)."""
    if lab is None:
        lab = rgb_to_lab(rgb)
    labels = slic_labels(rgb, n_segments, compactness, gmr_variant=gmr_variant)
    count = int(labels.max()) + 1
    size = np.bincount(labels.ravel(), minlength=count).astype(np.float64)
    return Superpixels(
        labels=labels,
        count=count,
        size=size,
        mean_rgb=superpixel_means(labels, rgb, count, size),
        mean_lab=superpixel_means(labels, lab, count, size),
        mean_position=mean_positions(labels, count, size),
    )


def superpixel_means(
    labels: np.ndarray,
    values: np.ndarray,
    count: int,
    size: np.ndarray | None = None,
) -> np.ndarray:
    """Mean of ``values`` (HxW or HxWxC) over each superpixel, float64 ``(n, C)``."""
    flat = labels.ravel()
    if size is None:
        size = np.bincount(flat, minlength=count).astype(np.float64)
    values = np.asarray(values)
    channels = values.reshape(flat.size, -1)
    sums = np.stack(
        [np.bincount(flat, weights=channels[:, c], minlength=count) for c in range(channels.shape[1])],
        axis=1,
    )
    return sums / np.maximum(size, 1.0)[:, None]


def mean_positions(labels: np.ndarray, count: int, size: np.ndarray | None = None) -> np.ndarray:
    """Mean ``[row / H, col / W]`` of each superpixel (RBD's ``GetNormedMeanPos``), ``(n, 2)``.

    Uses 1-based pixel coordinates like the MATLAB original so that values agree exactly.
    """
    height, width = labels.shape
    flat = labels.ravel()
    if size is None:
        size = np.bincount(flat, minlength=count).astype(np.float64)
    rows = np.repeat(np.arange(1, height + 1, dtype=np.float64), width)
    cols = np.tile(np.arange(1, width + 1, dtype=np.float64), height)
    denom = np.maximum(size, 1.0)
    mean_row = np.bincount(flat, weights=rows, minlength=count) / denom / height
    mean_col = np.bincount(flat, weights=cols, minlength=count) / denom / width
    return np.stack([mean_row, mean_col], axis=1)


# --------------------------------------------------------------------------- graphs


def adjacency(labels: np.ndarray, count: int, connectivity: Literal[4, 8] = 4) -> np.ndarray:
    """Superpixels sharing a pixel edge (4) or also a pixel corner (8); bool, no diagonal.

    RBD's ``GetAdjMatrix`` uses 4-connectivity; the MR C++ code also links diagonal pixels (8).
    """
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
    """Sorted ids of superpixels touching a band of ``thickness`` pixels along the image border.

    RBD uses an 8-pixel band (``GetBndPatchIds``); MR and MC use the outermost pixels.
    """
    t = max(1, int(thickness))
    band = np.concatenate(
        [labels[:t, :].ravel(), labels[-t:, :].ravel(), labels[:, :t].ravel(), labels[:, -t:].ravel()]
    )
    return np.unique(band).astype(np.int64)


def border_ids(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Ids of superpixels on the top, bottom, left and right outermost pixel lines."""
    return (
        np.unique(labels[0, :]).astype(np.int64),
        np.unique(labels[-1, :]).astype(np.int64),
        np.unique(labels[:, 0]).astype(np.int64),
        np.unique(labels[:, -1]).astype(np.int64),
    )


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


def minmax_normalise(values: np.ndarray) -> np.ndarray:
    """Scale to [0, 1] by min and max; a constant (or non-finite) input gives all zeros."""
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = (float(v.min()), float(v.max())) if v.size else (0.0, 0.0)
    span = hi - lo
    if not span > 1e-12 * max(1.0, abs(hi)):
        return np.zeros_like(v)
    return (v - lo) / span


def to_pixels(values: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Paint per-superpixel ``values`` back onto the label image, float32 HxW."""
    return np.asarray(values, dtype=np.float32)[labels]


# --------------------------------------------------------------------------- frames


@dataclass(frozen=True)
class Frame:
    """Crop box of an image without its artificial frame: rows top:bottom, cols left:right."""

    height: int
    width: int
    top: int
    bottom: int
    left: int
    right: int

    @property
    def has_frame(self) -> bool:
        return (self.top, self.bottom, self.left, self.right) != (0, self.height, 0, self.width)

    def crop(self, image: np.ndarray) -> np.ndarray:
        return image[self.top : self.bottom, self.left : self.right]

    def paste(self, saliency: np.ndarray, fill: float = 0.0) -> np.ndarray:
        """Put a map of the cropped image back into a full-size float32 map (frame = ``fill``)."""
        full = np.full((self.height, self.width), fill, dtype=np.float32)
        full[self.top : self.bottom, self.left : self.right] = saliency
        return full


def _sobel_edges(gray: np.ndarray) -> np.ndarray:
    """MATLAB ``edge(I, 'sobel')`` with its default threshold and thinning (RBD's frame test)."""
    g = gray.astype(np.float64) / 255.0
    # MATLAB uses fspecial('sobel') / 8 with replicate padding; cv2 correlates like imfilter
    gx = cv2.Sobel(g, cv2.CV_64F, 1, 0, ksize=3, borderType=cv2.BORDER_REPLICATE) / 8.0
    gy = cv2.Sobel(g, cv2.CV_64F, 0, 1, ksize=3, borderType=cv2.BORDER_REPLICATE) / 8.0
    mag = gx * gx + gy * gy
    cutoff = 4.0 * mag.mean()
    padded = np.pad(mag, 1, mode="constant")
    left, right = padded[1:-1, :-2], padded[1:-1, 2:]
    up, down = padded[:-2, 1:-1], padded[2:, 1:-1]
    ax, ay = np.abs(gx), np.abs(gy)
    along_x = (ax >= ay) & (mag >= left) & (mag > right)
    along_y = (ay >= ax) & (mag >= up) & (mag > down)
    return (mag > cutoff) & (along_x | along_y)


def detect_frame(
    rgb: np.ndarray,
    edges: Literal["sobel", "canny"] = "sobel",
    min_sides: int = 1,
    max_width: int = 30,
    density: float = 0.6,
) -> Frame:
    """Find an artificial frame (authors' ``removeframe``) and return the crop box without it.

    A frame side is the last of the first ``max_width`` pixel lines (from that side) whose edge
    density exceeds ``density``. RBD uses Sobel edges and accepts any one side; the MR C++ code
    uses Canny(60, 150) and needs ``min_sides=2``. Undetected sides get the widest detected
    width, as in the original. A crop that would leave < 16 px is not applied.
    """
    height, width = rgb.shape[:2]
    none = Frame(height, width, 0, height, 0, width)
    if height < 2 * max_width or width < 2 * max_width:
        return none
    gray = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY)
    if edges == "sobel":
        edge_map = _sobel_edges(gray)
    else:
        edge_map = cv2.Canny(gray, 60, 150) > 0
    row_density = edge_map.mean(axis=1)
    col_density = edge_map.mean(axis=0)
    sides = [
        row_density[:max_width],
        row_density[::-1][:max_width],
        col_density[:max_width],
        col_density[::-1][:max_width],
    ]
    widths = []
    for profile in sides:
        hits = np.flatnonzero(profile > density)
        widths.append(int(hits[-1]) + 1 if hits.size else 0)
    if sum(w > 0 for w in widths) < max(1, min_sides):
        return none
    widest = max(widths)
    top, bottom, left, right = (w if w > 0 else widest for w in widths)
    if height - top - bottom < 16 or width - left - right < 16:
        return none
    return Frame(height, width, top, height - bottom, left, width - right)


# --------------------------------------------------------------------------- robust wrapper


@dataclass(frozen=True)
class Prepared:
    """An image made safe for a method: RGB, frame removed, at least ``MIN_SIDE`` px a side.

    ``rgb`` is what the method segments; ``finish`` turns the method's map of ``rgb`` into the
    final float32 map of the original image, in [0, 1] and without NaN.
    """

    rgb: np.ndarray
    frame: Frame
    original_shape: tuple[int, int]

    def finish(self, saliency: np.ndarray) -> np.ndarray:
        sal = np.asarray(saliency, dtype=np.float32)
        crop_h = self.frame.bottom - self.frame.top
        crop_w = self.frame.right - self.frame.left
        if sal.shape != (crop_h, crop_w):
            sal = cv2.resize(sal, (crop_w, crop_h), interpolation=cv2.INTER_LINEAR)
        sal = np.nan_to_num(sal, nan=0.0, posinf=0.0, neginf=0.0)
        full = self.frame.paste(np.clip(sal, 0.0, 1.0), fill=0.0)
        return np.clip(full, 0.0, 1.0).astype(np.float32)


def prepare(
    image: np.ndarray,
    remove_frame: Literal["sobel", "canny", "none"] = "sobel",
    min_frame_sides: int = 1,
    min_side: int = MIN_SIDE,
) -> Prepared:
    """Convert to RGB, remove an artificial frame, and upscale tiny images (see :class:`Prepared`).

    Upscaling keeps the aspect ratio, so extreme shapes stay extreme but every side has at
    least ``min_side`` pixels, enough for a few superpixels.
    """
    rgb = as_rgb(image)
    height, width = rgb.shape[:2]
    if remove_frame == "none":
        frame = Frame(height, width, 0, height, 0, width)
    else:
        frame = detect_frame(rgb, edges=remove_frame, min_sides=min_frame_sides)
    work = frame.crop(rgb)
    short = min(work.shape[:2])
    if short < min_side:
        scale = min_side / short
        new_w = max(min_side, int(round(work.shape[1] * scale)))
        new_h = max(min_side, int(round(work.shape[0] * scale)))
        work = cv2.resize(work, (new_w, new_h), interpolation=cv2.INTER_LINEAR)
    return Prepared(rgb=np.ascontiguousarray(work), frame=frame, original_shape=(height, width))


def is_flat(rgb: np.ndarray, tolerance: float = 1.0) -> bool:
    """True when the image is (nearly) one colour: every channel spans < ``tolerance`` levels."""
    flat = rgb.reshape(-1, rgb.shape[-1])
    return bool(np.all(flat.max(axis=0).astype(np.int32) - flat.min(axis=0) < tolerance))
