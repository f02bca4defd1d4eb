"""Salient-object evaluation: MAE, max F-measure, adaptive F-measure and S-measure.

Protocol (``shared/data/README.md``, the standard one): each prediction is min-max normalised
to [0, 1] per image; ground truth is binarised at >= 128 (graded masks); beta^2 = 0.3.
- MAE: mean |S - G| per image, averaged over images;
- max F: per image, precision/recall/F at the 256 thresholds t/255 (t = 0..255, positive where
  S >= t/255); the F curves are averaged over images and the maximum is taken;
- adaptive F: per image, threshold min(2 mean(S), 1); F averaged over images;
- S-measure (Fan et al., ICCV 2017, alpha = 0.5): object- and region-aware structural
  similarity, following the authors' MATLAB ``StructureMeasure`` including its special cases.
A precision or recall with a zero denominator counts as 0, so an empty prediction scores F = 0.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from relicv2.saliency.handcrafted.graph import minmax_normalise

BETA2 = 0.3
THRESHOLDS = 256
EPS = np.finfo(np.float64).eps


def normalise_prediction(prediction: np.ndarray) -> np.ndarray:
    """Min-max normalise a map to float64 [0, 1]; a constant map becomes all zeros."""
    return minmax_normalise(prediction)


def binarise_ground_truth(gt: np.ndarray) -> np.ndarray:
    """Ground truth as bool: uint8/graded masks at >= 128, bool masks as they are."""
    g = np.asarray(gt)
    return g if g.dtype == bool else g >= 128


def _f_measure(precision: np.ndarray, recall: np.ndarray, beta2: float) -> np.ndarray:
    numerator = (1.0 + beta2) * precision * recall
    denominator = beta2 * precision + recall
    return np.divide(numerator, denominator, out=np.zeros_like(numerator), where=denominator > 0)


def precision_recall_curve(s: np.ndarray, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Precision and recall at thresholds t/255, t = 0..255, for a normalised map ``s``."""
    # S >= t/255  <=>  floor(255 S) >= t for integer t; the tiny offset absorbs rounding
    # of values that are exactly k/255 (as in maps read from 8-bit PNGs).
    level = np.clip(np.floor(s * 255.0 + 1e-7), 0, 255).astype(np.int64)
    fg_hist = np.bincount(level[g], minlength=THRESHOLDS)
    bg_hist = np.bincount(level[~g], minlength=THRESHOLDS)
    true_pos = np.cumsum(fg_hist[::-1])[::-1].astype(np.float64)  # count with level >= t
    false_pos = np.cumsum(bg_hist[::-1])[::-1].astype(np.float64)
    predicted = true_pos + false_pos
    positives = float(g.sum())
    precision = np.divide(true_pos, predicted, out=np.zeros_like(true_pos), where=predicted > 0)
    recall = true_pos / positives if positives > 0 else np.zeros_like(true_pos)
    return precision, recall


def f_measure_curve(s: np.ndarray, g: np.ndarray, beta2: float = BETA2) -> np.ndarray:
    """F-measure at the 256 thresholds (see :func:`precision_recall_curve`)."""
    return _f_measure(*precision_recall_curve(s, g), beta2)


def adaptive_f_measure(s: np.ndarray, g: np.ndarray, beta2: float = BETA2) -> float:
    """F-measure at the threshold min(2 mean(S), 1)."""
    predicted = s >= min(2.0 * float(s.mean()), 1.0)
    true_pos = float(np.logical_and(predicted, g).sum())
    precision = true_pos / predicted.sum() if predicted.any() else 0.0
    recall = true_pos / g.sum() if g.any() else 0.0
    return float(_f_measure(np.array([precision]), np.array([recall]), beta2)[0])


def mae(s: np.ndarray, g: np.ndarray) -> float:
    """Mean absolute error between a normalised map and a binary mask."""
    return float(np.abs(s - g).mean())


def s_measure(s: np.ndarray, g: np.ndarray, alpha: float = 0.5) -> float:
    """Structure measure of Fan et al. 2017 for a normalised map ``s`` and bool mask ``g``."""
    coverage = float(g.mean())
    if coverage == 0.0:
        return 1.0 - float(s.mean())
    if coverage == 1.0:
        return float(s.mean())
    s_object = coverage * _object_score(s[g]) + (1.0 - coverage) * _object_score(1.0 - s[~g])
    return max(0.0, float(alpha * s_object + (1.0 - alpha) * _s_region(s, g)))


def _object_score(values: np.ndarray) -> float:
    if values.size == 0:
        return 0.0
    x = float(values.mean())
    sigma = float(values.std(ddof=1)) if values.size > 1 else 0.0
    return 2.0 * x / (x * x + 1.0 + sigma + EPS)


def _ssim(s: np.ndarray, g: np.ndarray) -> float:
    n = s.size
    if n == 0:
        return 0.0
    gf = g.astype(np.float64)
    x, y = float(s.mean()), float(gf.mean())
    sigma_x2 = float(((s - x) ** 2).sum()) / (n - 1 + EPS)
    sigma_y2 = float(((gf - y) ** 2).sum()) / (n - 1 + EPS)
    sigma_xy = float(((s - x) * (gf - y)).sum()) / (n - 1 + EPS)
    a = 4.0 * x * y * sigma_xy
    b = (x * x + y * y) * (sigma_x2 + sigma_y2)
    if a != 0.0:
        return a / (b + EPS)
    return 1.0 if b == 0.0 else 0.0


def _s_region(s: np.ndarray, g: np.ndarray) -> float:
    height, width = g.shape
    total = float(g.sum())
    # Centroid in 1-based MATLAB coordinates, rounded half away from zero like MATLAB's round
    # (numpy rounds half to even, which would move the split for symmetric masks).
    cx = int(np.floor((g.sum(axis=0) * np.arange(1, width + 1)).sum() / total + 0.5))
    cy = int(np.floor((g.sum(axis=1) * np.arange(1, height + 1)).sum() / total + 0.5))
    area = float(width * height)
    w1, w2, w3 = cx * cy / area, (width - cx) * cy / area, cx * (height - cy) / area
    top, bottom, left, right = slice(0, cy), slice(cy, height), slice(0, cx), slice(cx, width)
    quadrants = [(top, left, w1), (top, right, w2), (bottom, left, w3), (bottom, right, 1.0 - w1 - w2 - w3)]
    return sum(w * _ssim(s[r, c], g[r, c]) for r, c, w in quadrants if w > 0)


@dataclass(frozen=True)
class ImageScores:
    """Scores of one image (the F curve is kept so max-F can be taken after averaging)."""

    mae: float
    f_curve: np.ndarray
    adaptive_f: float
    s_measure: float


@dataclass(frozen=True)
class DatasetScores:
    """Scores over a set of images, averaged as the protocol says."""

    mae: float
    max_f: float
    adaptive_f: float
    s_measure: float
    count: int

    def as_dict(self) -> dict[str, float | int | None]:
        """Plain values for JSON; the scores of an empty set are None (null), not NaN (invalid JSON)."""
        return {k: None if self.count == 0 and k != "count" else v for k, v in dataclasses.asdict(self).items()}


def score_image(prediction: np.ndarray, ground_truth: np.ndarray) -> ImageScores:
    """All per-image scores of a raw map (any range) against a raw mask (same HxW)."""
    s = normalise_prediction(prediction)
    g = binarise_ground_truth(ground_truth)
    if s.shape != g.shape:
        raise ValueError(f"prediction shape {s.shape} differs from ground truth shape {g.shape}")
    return ImageScores(mae=mae(s, g),
                       f_curve=f_measure_curve(s, g),
                       adaptive_f=adaptive_f_measure(s, g),
                       s_measure=s_measure(s, g))


@dataclass(frozen=True)
class ScoreSums:
    """Per-image scores summed over a set of images (the F curves summed pointwise): the sums of two disjoint
    sets add up to the sums of their union, so the scores of any subset (a fold, all folds but one) come from its
    images' sums, with max-F still the maximum of the mean F curve, never a mean of per-image maxima."""

    mae: float
    f_curve: np.ndarray
    adaptive_f: float
    s_measure: float
    count: int

    @classmethod
    def of(cls, image: ImageScores) -> ScoreSums:
        return cls(image.mae, np.asarray(image.f_curve, np.float64), image.adaptive_f, image.s_measure, 1)

    @classmethod
    def empty(cls) -> ScoreSums:
        return cls(0.0, np.zeros(THRESHOLDS), 0.0, 0.0, 0)

    def __add__(self, other: ScoreSums) -> ScoreSums:
        return ScoreSums(self.mae + other.mae, self.f_curve + other.f_curve, self.adaptive_f + other.adaptive_f,
                         self.s_measure + other.s_measure, self.count + other.count)

    def scores(self) -> DatasetScores:
        """The protocol's averages over the summed images (NaN scores for none)."""
        if self.count == 0:
            return DatasetScores(*[float("nan")] * 4, count=0)
        n = self.count
        return DatasetScores(mae=self.mae / n, max_f=float(np.max(self.f_curve / n)), adaptive_f=self.adaptive_f / n,
                             s_measure=self.s_measure / n, count=n)


def summed(scores: Iterable[ImageScores]) -> ScoreSums:
    """The sums of per-image scores (see ScoreSums)."""
    return sum((ScoreSums.of(item) for item in scores), ScoreSums.empty())


def aggregate(scores: Iterable[ImageScores]) -> DatasetScores:
    """Average per-image scores; max-F is the maximum of the mean F curve."""
    return summed(scores).scores()
