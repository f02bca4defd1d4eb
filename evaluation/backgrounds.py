"""The backgrounds test of Xiao, Engstrom, Ilyas and Madry ("Noise or Signal: The Role of Image Backgrounds in
Object Recognition", 2020), built from this project's saliency masks instead of ImageNet-9's boxes.

Each evaluation view (after the resize and centre crop, so every image of a set has one size) and its mask,
binarised at the level the masking uses, give the paper's variants:
- original;
- only-FG: the foreground on black;
- no-FG: the foreground black;
- only-BG-B: the foreground's bounding box black;
- only-BG-T: the box filled with tiles of the image's own background (the largest strip of the image
  beside the box, repeated);
- mixed-same / mixed-rand / mixed-next: the foreground pasted on the only-BG-T of another image, of the
  same class, of any class, of the next class (class index + 1, cyclically).
The BG-gap is mixed-same's accuracy less mixed-rand's: what a model gains from a background that agrees
with the object. Pairings are drawn from a seed. An image whose mask covers less than the masking's
minimum (`MIN_MASK_COVERAGE`), or whose box leaves no background strip of at least `MIN_STRIP` of the
image's area to tile from, is left out and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from relicv2.shards.sample import MASK_FOREGROUND_LEVEL, MIN_MASK_COVERAGE

VARIANTS = ("original", "only_fg", "no_fg", "only_bg_b", "only_bg_t", "mixed_same", "mixed_rand", "mixed_next")
MIXED = {"mixed_same": "same", "mixed_rand": "rand", "mixed_next": "next"}
MIN_STRIP = 0.05  # of the image's area: a smaller strip beside the box is too little background to tile


@dataclass(frozen=True)
class Cutout:
    """One image's foreground, as the composites need it."""

    foreground: np.ndarray  # bool HxW: mask >= MASK_FOREGROUND_LEVEL
    box: tuple[int, int, int, int]  # top, left, bottom, right (exclusive) of the foreground
    strip: tuple[int, int, int, int]  # the largest background rectangle beside the box, same convention


def cutout(mask: np.ndarray) -> Cutout | str:
    """The foreground of a uint8 HxW soft mask, or why the image is left out."""
    foreground = mask >= MASK_FOREGROUND_LEVEL
    coverage = float(foreground.mean())
    if coverage < MIN_MASK_COVERAGE:
        return f"mask covers {coverage:.1%} of the image, under the masking's {MIN_MASK_COVERAGE:.0%}"
    rows, cols = np.flatnonzero(foreground.any(axis=1)), np.flatnonzero(foreground.any(axis=0))
    top, bottom, left, right = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
    height, width = mask.shape
    strips = [(0, 0, top, width), (bottom, 0, height, width), (0, 0, height, left), (0, right, height, width)]
    strip = max(strips, key=lambda s: (s[2] - s[0]) * (s[3] - s[1]))
    if (strip[2] - strip[0]) * (strip[3] - strip[1]) < MIN_STRIP * height * width:
        return f"the foreground's box leaves under {MIN_STRIP:.0%} of the image as background to tile"
    return Cutout(foreground, (top, left, bottom, right), strip)


def tiled_background(image: np.ndarray, cut: Cutout) -> np.ndarray:
    """only-BG-T: the box filled with the background strip repeated from the box's top-left corner."""
    out = image.copy()
    top, left, bottom, right = cut.box
    tile = image[cut.strip[0] : cut.strip[2], cut.strip[1] : cut.strip[3]]
    reps = (-(-(bottom - top) // tile.shape[0]), -(-(right - left) // tile.shape[1]), 1)
    out[top:bottom, left:right] = np.tile(tile, reps)[: bottom - top, : right - left]
    return out


def paste(image: np.ndarray, cut: Cutout, background: np.ndarray) -> np.ndarray:
    """`image`'s foreground on `background` (a mixed variant's composite)."""
    return np.where(cut.foreground[..., None], image, background)


def variant(name: str, image: np.ndarray, cut: Cutout, partner: tuple[np.ndarray, Cutout] | None = None) -> np.ndarray:
    """One variant of `image` (uint8 HxWx3); the mixed ones take the partner whose background they use."""
    if name == "original":
        return image
    if name == "only_fg":
        return paste(image, cut, np.uint8(0))
    if name == "no_fg":
        return np.where(cut.foreground[..., None], np.uint8(0), image)
    if name == "only_bg_b":
        top, left, bottom, right = cut.box
        out = image.copy()
        out[top:bottom, left:right] = 0
        return out
    if name == "only_bg_t":
        return tiled_background(image, cut)
    if name in MIXED:
        if partner is None:
            raise ValueError(f"{name} needs a partner image")
        return paste(image, cut, tiled_background(*partner))
    raise ValueError(f"unknown variant {name!r}: choose from {', '.join(VARIANTS)}")


def pairings(labels: Sequence[int], seed: int) -> dict[str, np.ndarray]:
    """For each image, the index of the image whose background each mixed variant uses: another of the same
    class (itself only when it is alone in its class), one of any class, one of the next class present
    (cyclically over the classes present). A function of the labels and the seed only."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    members = {c: np.flatnonzero(labels == c) for c in classes}
    same = np.empty(len(labels), np.int64)
    nxt = np.empty(len(labels), np.int64)
    for i, c in enumerate(labels):
        others = members[c][members[c] != i]
        same[i] = rng.choice(others) if len(others) else i
        following = classes[(np.searchsorted(classes, c) + 1) % len(classes)]
        nxt[i] = rng.choice(members[following])
    return {"same": same, "rand": rng.integers(0, len(labels), len(labels)), "next": nxt}


def bg_gap(accuracy: dict[str, float]) -> float:
    """Mixed-same's accuracy less mixed-rand's."""
    return accuracy["mixed_same"] - accuracy["mixed_rand"]


def follows_background(predictions: np.ndarray, labels: np.ndarray, partner_labels: np.ndarray) -> float:
    """Among the composites whose background is of another class, the share predicted as that class."""
    other = partner_labels != labels
    return float((predictions[other] == partner_labels[other]).mean()) if other.any() else float("nan")
