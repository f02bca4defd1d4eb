"""Generated labelled shard sets for the evaluation tests: 6 classes that differ by colour and shape."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from torch import nn

from relicv2.shards import ShardSample, write_shard_set

COLOURS = ((210, 40, 40), (40, 170, 60), (50, 70, 210))
NUM_CLASSES = 6  # 3 colours x (disc, bar)


def shape_image(label: int, rng: np.random.Generator, size: int = 40) -> bytes:
    """A noisy grey background with a coloured disc (even labels) or bar (odd labels), randomly placed."""
    background = rng.integers(90, 160, (size, size, 3), dtype=np.uint8)
    image = Image.fromarray(background)
    draw = ImageDraw.Draw(image)
    colour = tuple(int(c + rng.integers(-20, 21)) for c in COLOURS[label // 2])
    x, y = rng.integers(4, 12, 2)
    if label % 2 == 0:
        draw.ellipse([x, y, x + 24, y + 24], fill=colour)
    else:
        draw.rectangle([x, y + 9, x + 26, y + 15], fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=92)
    return buffer.getvalue()


def write_labelled_set(folder, count: int, seed: int, *, corrupt: int = 0) -> None:
    rng = np.random.default_rng(seed)
    samples = [ShardSample(f"s{seed}x{i:04d}", {"jpg": shape_image(i % NUM_CLASSES, rng)}, label=i % NUM_CLASSES)
               for i in range(count)]
    samples += [ShardSample(f"broken{i}", {"jpg": b"\xff\xd8\xff not a jpeg"}, label=0) for i in range(corrupt)]
    write_shard_set(samples, folder)


@pytest.fixture(scope="module")
def shape_shards(tmp_path_factory):
    """(train, val) labelled shard sets: 72 and 36 images of 6 classes; train has one corrupt JPEG."""
    root = tmp_path_factory.mktemp("shapes")
    write_labelled_set(root / "train", 72, seed=1, corrupt=1)
    write_labelled_set(root / "val", 36, seed=2)
    return root / "train", root / "val"


class PooledPixels(nn.Module):
    """A fixed feature extractor: the image average-pooled to 4x4 (48 features): colour and layout."""

    num_features = 48

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)
