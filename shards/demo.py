"""Built-in demo data: a tiny labelled image-folder tree of random crops of the photos bundled with
scikit-image, one photo a class. The val crops are relit (brightness, contrast, saturation, hue, some grey):
colour is what a randomly initialised encoder's features mostly say, so it scores poorly on them, while
pretraining with colour augmentation learns to look past it: the gain the demo's report shows. A few awkward
inputs (greyscale, RGBA PNG, a zero-byte file, a non-image file) show how `shards build` treats them.
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
# The val crops' lighting: factors drawn uniformly in 1 +- the value (hue: a shift in +- the value of
# the colour circle), and the chance of losing colour; near the pretraining's colour augmentation.
VAL_LIGHTING = {"brightness": 0.4, "contrast": 0.4, "saturation": 0.4, "hue": 0.25, "grayscale": 0.1}


def _relight(crop: Image.Image, rng: np.random.Generator) -> Image.Image:
    # Imported here: torchvision brings torch (and torch._dynamo) with it, seconds of start-up that
    # `relicv2 demo-data --help` and the modules importing MIN_SIZE do not need.
    import torchvision.transforms.v2.functional as tvf

    for name, adjust in (("brightness", tvf.adjust_brightness), ("contrast", tvf.adjust_contrast),
                         ("saturation", tvf.adjust_saturation)):
        crop = adjust(crop, float(rng.uniform(1 - VAL_LIGHTING[name], 1 + VAL_LIGHTING[name])))
    crop = tvf.adjust_hue(crop, float(rng.uniform(-VAL_LIGHTING["hue"], VAL_LIGHTING["hue"])))
    if rng.random() < VAL_LIGHTING["grayscale"]:
        crop = tvf.rgb_to_grayscale(crop, num_output_channels=3)
    return crop


def _random_crop(photo: np.ndarray, rng: np.random.Generator, size: int) -> Image.Image:
    height, width = photo.shape[:2]
    side = int(min(height, width) * rng.uniform(0.5, 1.0))
    top = int(rng.integers(0, height - side + 1))
    left = int(rng.integers(0, width - side + 1))
    crop = Image.fromarray(photo[top:top + side, left:left + side]).resize((size, size), Image.BICUBIC)
    if rng.random() < 0.5:
        crop = crop.transpose(Image.FLIP_LEFT_RIGHT)
    return crop


def write_demo_images(out_dir: Path, *, train_per_class: int = 24, val_per_class: int = 16,
                      size: int = 128, seed: int = 0) -> dict[str, int]:
    """Write `out_dir/{train,val}/<class>/*.jpg` (val relit, plus a few awkward files in train); return counts."""
    if size < MIN_SIZE or train_per_class < 1 or val_per_class < 1:
        raise ValueError(f"size must be at least {MIN_SIZE} and the per-class counts at least 1 "
                         f"(got size={size}, train={train_per_class}, val={val_per_class})")
    rng = np.random.default_rng(seed)
    for name in DEMO_PHOTOS:
        photo = getattr(skdata, name)()
        for split, count in (("train", train_per_class), ("val", val_per_class)):
            folder = out_dir / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for index in range(count):
                crop = _random_crop(photo, rng, size)
                if split == "val":
                    crop = _relight(crop, rng)
                crop.save(folder / f"{name}_{index:03d}.jpg", quality=90)
    awkward = out_dir / "train" / "astronaut"
    Image.fromarray(skdata.camera()).resize((size, size)).save(awkward / "greyscale.png")
    Image.fromarray(skdata.logo()).resize((size, size)).save(awkward / "with_alpha.png")
    (awkward / "empty.jpg").write_bytes(b"")
    (awkward / "notes.txt").write_text("not an image\n")
    return {"train": train_per_class * len(DEMO_PHOTOS), "val": val_per_class * len(DEMO_PHOTOS)}
