"""Crafted scenes for the backgrounds test: a square object on a plain background, the class carried by the
object's colour or by the background's (the other part any colour), with the object's soft mask."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from relicv2.shards import ShardSample, write_shard_set

SIZE, CLASSES, PER_CLASS = 32, 3, 30
PALETTE = np.array([[220, 40, 40], [40, 200, 40], [40, 40, 220]], np.uint8)


def scene(rng: np.random.Generator, fg_colour, bg_colour) -> tuple[np.ndarray, np.ndarray]:
    """An image with a square object of `fg_colour` on `bg_colour` (both with noise), and its soft mask."""
    image = np.empty((SIZE, SIZE, 3), np.float64)
    image[:] = bg_colour
    side = int(rng.integers(10, 16))
    top, left = int(rng.integers(6, SIZE - side - 6)), int(rng.integers(6, SIZE - side - 6))
    image[top : top + side, left : left + side] = fg_colour
    image += rng.normal(0, 12, image.shape)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[top : top + side, left : left + side] = 230
    return np.clip(image, 0, 255).astype(np.uint8), mask


def crafted(carried_by: str, seed: int = 0, per_class: int = PER_CLASS):
    """(images, masks, labels) of CLASSES classes carried by the "foreground" or the "background" colour."""
    rng = np.random.default_rng(seed)
    images, masks, labels = [], [], []
    for label in range(CLASSES):
        for _ in range(per_class):
            free = rng.integers(0, 256, 3)  # the part that does not carry the class: any colour
            fg, bg = (PALETTE[label], free) if carried_by == "foreground" else (free, PALETTE[label])
            image, mask = scene(rng, fg, bg)
            images.append(image), masks.append(mask), labels.append(label)
    return images, masks, np.array(labels)


def encoded(array: np.ndarray, kind: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, kind, **({"quality": 95} if kind == "JPEG" else {}))
    return buffer.getvalue()


def write_crafted_set(folder, carried_by: str, seed: int, *, masks: bool = True, per_class: int = PER_CLASS):
    """A labelled shard set of `crafted` scenes (JPEG), with their masks as `mask.png` members unless `masks`
    is False; returns the masks by key."""
    images, soft, labels = crafted(carried_by, seed, per_class)
    keys = [f"c{label}n{i:03d}" for i, label in enumerate(labels)]
    write_shard_set([ShardSample(key, {"jpg": encoded(image, "JPEG"), **({"mask.png": encoded(mask)} if masks else {})},
                                 int(label)) for key, image, mask, label in zip(keys, images, soft, labels, strict=True)],
                    folder)
    return dict(zip(keys, soft, strict=True))
