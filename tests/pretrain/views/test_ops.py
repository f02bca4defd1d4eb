"""The DALI backend's colour steps, pixel by pixel, against torchvision's functional ops with the same draws
(the torch colour stage on the views DALI renders).

The crop is forced to the whole (square) image at its own size and flips are off, so a DALI view is
exactly the decoded image passed through the colour steps whose parameters the pipeline reports.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image
from scipy.ndimage import gaussian_filter

from relicv2.pretrain.views.config import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    JITTER_ORDERS,
    PARAM_NAMES,
    ViewConfig,
)
from relicv2.pretrain.views.loader import ViewLoader
from relicv2.shards import ShardSample, write_shard_set

COL = {name: i for i, name in enumerate(PARAM_NAMES)}
SIZE = 40
IDENTITY_CROP = dict(
    large_views=2, small_views=0, large_size=SIZE, crop_scale_even=(1.0, 1.0), crop_scale_odd_large=(1.0, 1.0),
    crop_ratio=(1.0, 1.0), flip_probability=0.0, mask_probability=0.0, debug_params=True, num_threads=1,
)
OFF = dict(jitter_probability=0.0, grayscale_probability=0.0, blur_probability_even=0.0, blur_probability_odd=0.0,
           solarize_probability_odd=0.0)


@pytest.fixture(scope="module")
def square_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("square")
    rng = np.random.default_rng(4)
    samples = []
    for i in range(16):
        colour = rng.uniform(0.2, 0.8, 3)
        image = np.clip(colour + 0.5 * gaussian_filter(rng.normal(0, 1, (SIZE, SIZE, 3)), (1.5, 1.5, 0)), 0, 1)
        buffer = io.BytesIO()
        Image.fromarray((image * 255).astype(np.uint8)).save(buffer, "JPEG", quality=100, subsampling=0)
        samples.append(ShardSample(f"sq{i:02d}", {"jpg": buffer.getvalue()}, None, {}))
    write_shard_set(samples, out, prefix="images")
    return out


def decoded(shards, keys: list[str]) -> dict[str, torch.Tensor]:
    from relicv2.shards import ReadReport, iter_samples

    return {s["key"]: F.to_tensor(Image.open(io.BytesIO(s["jpg"])).convert("RGB")) for s in iter_samples(shards, report=ReadReport())
            if s["key"] in keys}


def dali_batch(shards, **options):
    loader = ViewLoader(shards, 16, ViewConfig(**{**IDENTITY_CROP, **OFF, **options}), backend="dali", seed=11)
    batch = next(iter(loader))
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    views = [v * std + mean for v in batch["views"]]  # back to [0, 1]
    return views, batch["params"], decoded(shards, batch["keys"]), batch["keys"]


def torchvision_jitter(image: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    if p[COL["jitter"]] == 1:
        for op in JITTER_ORDERS[int(p[COL["order"]])]:
            if op == 0:
                image = F.adjust_brightness(image, float(p[COL["brightness"]]))
            elif op == 1:
                image = F.adjust_contrast(image, float(p[COL["contrast"]]))
            elif op == 2:
                image = F.adjust_saturation(image, float(p[COL["saturation"]]))
            else:
                image = F.adjust_hue(image, float(p[COL["hue"]]))
    return image


def test_identity_settings_reproduce_the_image(square_shards):
    views, _, images, keys = dali_batch(square_shards)
    for i, key in enumerate(keys):
        assert torch.allclose(views[0][i], images[key], atol=0.02)


def test_brightness_contrast_saturation_in_random_order_match_torchvision(square_shards):
    views, params, images, keys = dali_batch(square_shards, jitter_probability=1.0, hue=0.0)
    orders = set()
    for j in range(2):
        for i, key in enumerate(keys):
            expected = torchvision_jitter(images[key], params[i, j])
            orders.add(int(params[i, j, COL["order"]]))
            # 8-bit decoding differences, amplified by up to 1.4 x 1.4 x 1.2
            assert (views[j][i] - expected).abs().max() < 0.05, (key, params[i, j])
    assert len(orders) > 8  # many different orders were exercised


def test_hue_matches_torchvision(square_shards):
    views, params, images, keys = dali_batch(square_shards, jitter_probability=1.0,
                                             brightness=0.0, contrast=0.0,
                                             saturation=0.0)
    shifts = []
    for j in range(2):
        for i, key in enumerate(keys):
            expected = torchvision_jitter(images[key], params[i, j])
            assert (views[j][i] - expected).abs().max() < 0.03, (key, params[i, j, COL["hue"]])
            shifts.append((expected - images[key]).abs().mean().item())
    assert np.mean(shifts) > 0.02  # the hue really moved


def test_grayscale_blur_solarize_match_torchvision(square_shards):
    views, params, images, keys = dali_batch(
        square_shards, grayscale_probability=1.0, blur_probability_odd=1.0, blur_probability_even=1.0,
        solarize_probability_odd=1.0, solarize_probability_even=1.0,
    )
    for j in range(2):
        for i, key in enumerate(keys):
            p = params[i, j]
            assert p[COL["grayscale"]] == 1 and p[COL["blur"]] == 1 and p[COL["solarize"]] == 1
            sigma = float(p[COL["sigma"]])
            expected = F.rgb_to_grayscale(images[key], num_output_channels=3)
            expected = F.gaussian_blur(expected, [23, 23], [sigma, sigma])
            expected = F.solarize(expected, 0.5)
            diff = (views[j][i] - expected).abs()
            # Solarize flips values that sit at 0.5 +- rounding; ignore those few pixels.
            assert (diff > 0.02).float().mean() < 0.01, (key, sigma)
