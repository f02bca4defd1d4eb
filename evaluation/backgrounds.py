"""The backgrounds test of Xiao, Engstrom, Ilyas and Madry ("Noise or Signal: The Role of Image Backgrounds in
Object Recognition", 2020), built from this project's saliency masks instead of ImageNet-9's boxes.

As the authors' code does, the composites are made on the image resized (short side) to the evaluation's
resize size and centre-cropped to a square of that size, which the evaluation view then centre-crops; the
mask, binarised at the level the masking uses, gives the paper's variants:
- original;
- only-FG: the foreground on black;
- no-FG: the foreground black;
- only-BG-B: the foreground's bounding box black;
- only-BG-T: the box filled with tiles of the image's own background: the largest full-width or
  full-height strip of the image beside the box, repeated from the image's top-left corner;
- mixed-same / mixed-rand / mixed-next: the foreground pasted on the only-BG-T of another image, of the
  same class, of a random class, of the next class (class index + 1, cyclically).
The BG-gap is mixed-same's accuracy less mixed-rand's: what a model gains from a background that agrees
with the object. Pairings are drawn from a seed. On the part the encoder sees (the centre crop), an image
whose mask covers less than the masking's minimum (`MIN_MASK_COVERAGE`), or whose box covers more than
`MAX_BOX_AREA`, is left out and counted.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from relicv2.shards.sample import KEY_PATTERN, MASK_FOREGROUND_LEVEL, MIN_MASK_COVERAGE

VARIANTS = ("original", "only_fg", "no_fg", "only_bg_b", "only_bg_t", "mixed_same", "mixed_rand", "mixed_next")
MIXED = {"mixed_same": "same", "mixed_rand": "rand", "mixed_next": "next"}
RESULT_FILE = "backgrounds.json"  # in the output folder of `relicv2 eval backgrounds`: the report reads it
# The authors' rule: a box over 90% of the view leaves only-BG (nearly) all black and too little background to
# tile from, so the image is left out (their ImageNet-9 sets drop such images the same way).
MAX_BOX_AREA = 0.9


@dataclass(frozen=True)
class Cutout:
    """One image's foreground, as the composites need it."""

    foreground: np.ndarray  # bool HxW: mask >= MASK_FOREGROUND_LEVEL
    box: tuple[int, int, int, int]  # top, left, bottom, right (exclusive) of the foreground
    strip: tuple[int, int, int, int]  # the largest background rectangle beside the box, same convention


EXCLUSIONS = ("small_mask", "large_box")  # the reasons `cutout` leaves an image out, as counted


def _box(foreground: np.ndarray) -> tuple[int, int, int, int]:
    rows, cols = np.flatnonzero(foreground.any(axis=1)), np.flatnonzero(foreground.any(axis=0))
    return int(rows[0]), int(cols[0]), int(rows[-1]) + 1, int(cols[-1]) + 1


def cutout(mask: np.ndarray, crop: int | None = None) -> Cutout | tuple[str, str]:
    """The foreground of a uint8 HxW soft mask, or (reason code, why) the image is left out. The rules
    look at the centre `crop` x `crop` (the part the encoder sees; None: the whole mask)."""
    foreground = mask >= MASK_FOREGROUND_LEVEL
    height, width = mask.shape
    top, left = (height - (crop or height)) // 2, (width - (crop or width)) // 2
    seen = foreground[top : top + (crop or height), left : left + (crop or width)]
    coverage = float(seen.mean())
    if coverage < MIN_MASK_COVERAGE:
        return "small_mask", f"mask covers {coverage:.1%} of the view, under the masking's {MIN_MASK_COVERAGE:.0%}"
    b_top, b_left, b_bottom, b_right = _box(seen)
    if (area := (b_bottom - b_top) * (b_right - b_left) / seen.size) > MAX_BOX_AREA:
        return "large_box", f"the foreground's box covers {area:.0%} of the view, over {MAX_BOX_AREA:.0%}"
    top, left, bottom, right = _box(foreground)
    # The largest margin beside the box, across the whole image, as the authors pick it (ties: bottom, top,
    # right, left): a box within MAX_BOX_AREA of the view always leaves one.
    strips = [(bottom, 0, height, width), (0, 0, top, width), (0, right, height, width), (0, 0, height, left)]
    strip = max(strips, key=lambda s: (s[2] - s[0]) * (s[3] - s[1]))
    return Cutout(foreground, (top, left, bottom, right), strip)


def tiled_background(image: np.ndarray, cut: Cutout) -> np.ndarray:
    """only-BG-T: the box filled with the background strip tiled over the image from its top-left corner."""
    out = image.copy()
    top, left, bottom, right = cut.box
    tile = image[cut.strip[0] : cut.strip[2], cut.strip[1] : cut.strip[3]]
    reps = (-(-bottom // tile.shape[0]), -(-right // tile.shape[1]), 1)
    out[top:bottom, left:right] = np.tile(tile, reps)[top:bottom, left:right]
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
    class (itself only when it is alone in its class), one of a class drawn uniformly from the classes
    present (the authors' random class), one of the next class present (cyclically). A function of the
    labels and the seed only."""
    labels = np.asarray(labels)
    rng = np.random.default_rng(seed)
    classes = np.unique(labels)
    members = {c: np.flatnonzero(labels == c) for c in classes}
    same, rand, nxt = (np.empty(len(labels), np.int64) for _ in range(3))
    for i, c in enumerate(labels):
        others = members[c][members[c] != i]
        same[i] = rng.choice(others) if len(others) else i
        rand[i] = rng.choice(members[rng.choice(classes)])
        nxt[i] = rng.choice(members[classes[(np.searchsorted(classes, c) + 1) % len(classes)]])
    return {"same": same, "rand": rand, "next": nxt}


def check_variants(names: Sequence[str]) -> None:
    """ValueError unless `names` are some of VARIANTS."""
    if not names or (unknown := [name for name in names if name not in VARIANTS]):
        raise ValueError(f"variants {list(names) and unknown}: choose among {', '.join(VARIANTS)}")


def bg_gap(accuracy: dict[str, float]) -> float:
    """Mixed-same's accuracy less mixed-rand's."""
    return accuracy["mixed_same"] - accuracy["mixed_rand"]


def follows_background(predictions: np.ndarray, labels: np.ndarray, partner_labels: np.ndarray) -> float:
    """Among the composites whose background is of another class, the share predicted as that class."""
    other = partner_labels != labels
    return float((predictions[other] == partner_labels[other]).mean()) if other.any() else float("nan")


def variant_key(name: str, key: str) -> str:
    """The composite's key: the variant and its image's key (shortened with a hash past the key length)."""
    full = f"{name}-{key}"
    return full if KEY_PATTERN.fullmatch(full) else f"{name}-{key[:48]}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"
