"""Built-in demo data: a tiny labelled image-folder tree made from the photos bundled with scikit-image.

Each class is one bundled photo; its samples are random crops of it (different positions, scales,
flips), so a pretrained encoder can be checked with kNN on held-out crops. A few inputs are
deliberately awkward (greyscale, RGBA PNG, a zero-byte file, a non-image file) so the demo also shows
how `shards build` converts or rejects them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image
from skimage import data as skdata

MIN_SIZE = 32  # shards build's default --min-side: smaller crops would all be rejected
# Photos that ship inside scikit-image (no download), one class each.
DEMO_PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "immunohistochemistry", "colorwheel",
               "hubble_deep_field", "retina")


def _random_crop(photo: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    height, width = photo.shape[:2]
    side = int(min(height, width) * rng.uniform(0.5, 1.0))
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    crop = Image.fromarray(photo[top:top + side, left:left + side]).resize((size, size), Image.BICUBIC)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    return np.asarray(crop)


def write_demo_images(out_dir: Path, *, train_per_class: int = 24, val_per_class: int = 8,
                      size: int = 128, seed: int = 0) -> dict[str, int]:
    """Write `out_dir/{train,val}/<class>/*.jpg` (plus a few awkward files in train); return counts."""
    if size < MIN_SIZE or train_per_class < 1 or val_per_class < 1:
        raise ValueError(f"size must be at least {MIN_SIZE} and the per-class counts at least 1 "
                         f"(got size={size}, train={train_per_class}, val={val_per_class})")
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for name in DEMO_PHOTOS:
        photo = getattr(skdata, name)()
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            folder = out_dir / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                crop = _random_crop(photo, rng, size)
                Image.fromarray(crop).save(folder / f"{name}_{index:03d}.jpg", quality=90)
                counts[split] += 1
    awkward = out_dir / "train" / "astronaut"
    Image.fromarray(skdata.camera()).resize((size, size)).save(awkward / "greyscale.png")
    Image.fromarray(skdata.logo()).resize((size, size)).save(awkward / "with_alpha.png")
    (awkward / "empty.jpg").write_bytes(b"")
    (awkward / "notes.txt").write_text("not an image\n")
    return counts
