"""The view augmentations: mask alignment, per-view frequencies of the paper's table, DALI vs PIL."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
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
RED = np.array([220, 30, 30]) / 255
SMALL = dict(large_size=48, small_size=24)
NO_COLOUR = dict(
    jitter_probability=0.0, grayscale_probability=0.0, blur_probability_even=0.0, blur_probability_odd=0.0,
    solarize_probability_odd=0.0,
)


def encode(array: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, fmt, **({"quality": 95} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def object_samples(count: int, seed: int, *, tiny_every: int = 0, unmasked_every: int = 0) -> list[ShardSample]:
    """Dark noisy images with a red rectangle in the left half; the mask marks the rectangle.

    Every `tiny_every`-th mask covers < 5% of the image, every `unmasked_every`-th sample has none.
    """
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        h, w = (int(v) for v in rng.integers(60, 120, 2))
        image = rng.integers(0, 50, (h, w, 3)).astype(np.uint8)
        mask = np.zeros((h, w), np.uint8)
        y0, x0 = h // 5, w // 8
        y1, x1 = (y0 + 3, x0 + 3) if tiny_every and i % tiny_every == 0 else (4 * h // 5, w // 2)
        image[y0:y1, x0:x1] = (RED * 255).astype(np.uint8)
        mask[y0:y1, x0:x1] = 255
        members = {"jpg": encode(image, "JPEG")}
        if not (unmasked_every and i % unmasked_every == 0):
            members["mask.png"] = encode(mask, "PNG")
        samples.append(ShardSample(f"obj{i:04d}", members, i % 3, {"width": w, "height": h}))
    return samples


def unnormalise(view: torch.Tensor) -> np.ndarray:
    """NCHW normalised -> NHWC in [0, 1]."""
    mean, std = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1), torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (view.float().cpu() * std + mean).permute(0, 2, 3, 1).numpy()


def off_segment_fraction(pixels: np.ndarray, grey: float) -> float:
    """Fraction of pixels farther than 0.12 from the colour segment grey -> red (HxWx3 in [0, 1])."""
    a = np.full(3, grey)
    d = RED - a
    t = np.clip(((pixels - a) @ d) / (d @ d), 0, 1)
    dist = np.linalg.norm(pixels - (a + t[..., None] * d), axis=-1)
    return float((dist > 0.12).mean())


@pytest.fixture(scope="module")
def object_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("objects")
    write_shard_set(object_samples(32, 0), out, prefix="masked", max_count=12)
    return out


# The DALI pipeline on a GPU (`mixed` decoding, masks decoded and cropped on the GPU) is held to the
# same figures as the CPU backends.
BACKEND_DEVICES = [("dali", "cpu"), ("reference", "cpu"), pytest.param("dali", "cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize(("backend", "device"), BACKEND_DEVICES)
def test_masked_views_are_grey_outside_the_object_and_image_inside(object_shards, backend, device):
    views = ViewConfig(mask_probability=1.0, debug_params=True, mask_grey_range=(0.55, 1.0), num_threads=1, **SMALL,
                       **NO_COLOUR)
    loader = ViewLoader(object_shards, 16, views, backend=backend, device=device, seed=3)
    batch = next(iter(loader))
    params = batch["params"]
    offs = []
    for j, view in enumerate(batch["views"]):
        pixels = unnormalise(view)
        for i in range(len(pixels)):
            grey = float(params[i, j, COL["grey"]])
            off = off_segment_fraction(pixels[i], grey)
            if j < loader.config.large_views:  # every large view is masked (p_m = 1, coverage ~ 0.3)
                assert params[i, j, COL["masked"]] == 1
                # Only pixels at the object's edge may mix in the dark background (more of them
                # when a small crop magnifies the edge); a crop or flip of the mask that differed
                # from the image's would leave whole dark regions (see the control test below).
                assert off < 0.15, (backend, j, i, off, params[i, j])
                red = (np.linalg.norm(pixels[i] - RED, axis=-1) < 0.12).mean()
                grey_px = (np.abs(pixels[i] - grey).max(axis=-1) < 0.03).mean()
                assert red + grey_px > 0.8  # the rest is image inside, one grey level outside
                offs.append(off)
            else:  # small views are never masked: their dark background stays
                assert params[i, j, COL["masked"]] == 0
    assert len(offs) == 16 * loader.config.large_views
    assert np.mean(offs) < 0.05


@pytest.mark.parametrize("backend", ["dali", "reference"])
def test_unmasked_views_keep_the_background(object_shards, backend):
    """Control for the test above: without masking the same statistic flags the background."""
    views = ViewConfig(mask_probability=0.0, debug_params=True, num_threads=1, **SMALL, **NO_COLOUR)
    loader = ViewLoader(object_shards, 16, views, backend=backend, seed=3)
    batch = next(iter(loader))
    pixels = unnormalise(batch["views"][0])
    offs = [off_segment_fraction(p, float(batch["params"][i, 0, COL["grey"]])) for i, p in enumerate(pixels)]
    assert np.mean(offs) > 0.3
    assert batch["params"][:, :, COL["masked"]].sum() == 0


@pytest.mark.parametrize(("backend", "device"), BACKEND_DEVICES)
def test_only_the_views_drawn_for_masking_lose_their_background(object_shards, backend, device):
    """With p_m = 0.5 the masking applies to the views whose flag says so and to no other one (the
    torch colour stage selects those rows itself, from the pipeline's flags)."""
    views = ViewConfig(mask_probability=0.5, debug_params=True, num_threads=1, **SMALL, **NO_COLOUR)
    loader = ViewLoader(object_shards, 16, views, backend=backend, device=device, seed=5)
    batch = next(iter(loader))
    offs = {0.0: [], 1.0: []}
    for j in range(loader.config.large_views):
        pixels = unnormalise(batch["views"][j])
        for i, p in enumerate(pixels):
            params = batch["params"][i, j]
            offs[float(params[COL["masked"]])].append(off_segment_fraction(p, float(params[COL["grey"]])))
    assert len(offs[0.0]) >= 4 and len(offs[1.0]) >= 4
    assert np.mean(offs[1.0]) < 0.05 and max(offs[1.0]) < 0.15
    assert np.mean(offs[0.0]) > 0.3


def binomial_ok(flags: np.ndarray, p: float) -> bool:
    """Observed rate within 4.5 standard deviations of p (exactly p when p is 0 or 1)."""
    n = flags.size
    if p in (0.0, 1.0):
        return bool(np.all(flags == p))
    return abs(flags.mean() - p) <= 4.5 * np.sqrt(p * (1 - p) / n)


@pytest.fixture(scope="module")
def mixed_mask_shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    # 1/4 of samples have a mask under 5% coverage, 1/4 none (order 0,4,8,.. tiny; 2,6,.. none)
    samples = object_samples(192, 1, tiny_every=4)
    samples = [s if i % 4 != 2 else ShardSample(s.key, {"jpg": s.members["jpg"]}, s.label, s.meta)
               for i, s in enumerate(samples)]
    write_shard_set(samples, out, prefix="masked", max_count=50)
    return out


@pytest.mark.parametrize(("backend", "device"), BACKEND_DEVICES)
def test_frequencies_follow_the_paper_table(mixed_mask_shards, backend, device):
    p_m = 0.5
    views = ViewConfig(mask_probability=p_m, debug_params=True, large_size=32, small_size=16)
    loader = ViewLoader(mixed_mask_shards, 64, views, backend=backend, device=device, seed=5)
    params = torch.cat([b["params"] for b in loader]).numpy()  # N x 6 x P
    assert params.shape[:2] == (192, 6)
    specs = {"large_odd": [0, 2], "large_even": [1, 3], "small_odd": [4], "small_even": [5]}
    expected = {  # (blur, solarize, crop area range) per the table; flip/jitter/grey are the same for all
        "large_odd": (0.1, 0.2, (0.14, 1.0)),
        "large_even": (1.0, 0.0, (0.08, 1.0)),
        "small_odd": (0.1, 0.2, (0.05, 0.14)),
        "small_even": (1.0, 0.0, (0.08, 1.0)),
    }
    for name, views in specs.items():
        p = params[:, views].reshape(-1, params.shape[-1])
        blur, solarize, (lo, hi) = expected[name]
        assert binomial_ok(p[:, COL["blur"]], blur), name
        assert binomial_ok(p[:, COL["solarize"]], solarize), name
        assert binomial_ok(p[:, COL["grayscale"]], 0.2), name
        assert binomial_ok(p[:, COL["flip"]], 0.5), name
        assert binomial_ok(p[:, COL["jitter"]], 0.8), name
        area = p[:, COL["area"]]
        # Pixel rounding of the window moves the area a little past the range's ends.
        assert area.min() >= lo * 0.85 and area.max() <= min(1.0, hi * 1.15), (name, area.min(), area.max())
        # Area is drawn uniformly, then windows that do not fit the image are redrawn (which thins
        # out large areas on elongated images): the draws still spread over the whole range.
        q10, q90 = np.quantile(area, [0.1, 0.9])
        assert q10 < lo + 0.2 * (hi - lo) and q90 > lo + 0.6 * (hi - lo), (name, q10, q90)
        ratio = p[:, COL["ratio"]]
        assert np.all((ratio > 0.7) & (ratio < 1.45)), name
    sigma = params[:, :, COL["sigma"]]
    assert sigma.min() >= 0.1 - 1e-6 and sigma.max() <= 2.0 + 1e-6
    hue = params[:, :, COL["hue"]]
    assert hue.min() >= -0.1 - 1e-6 and hue.max() <= 0.1 + 1e-6 and hue.std() > 0.04
    orders = params[:, :, COL["order"]][params[:, :, COL["jitter"]] == 1]
    assert set(orders.astype(int)) == set(range(len(JITTER_ORDERS)))  # all 24 orders occur
    # Masking: large views of samples whose mask covers >= 5% only, with probability p_m.
    coverage = params[:, 0, COL["coverage"]]
    maskable = coverage >= 0.05
    assert 0.2 < maskable.mean() < 0.8 and np.all(coverage[~maskable] < 0.05)
    masked = params[:, :, COL["masked"]]
    assert binomial_ok(masked[maskable][:, :4], p_m)
    assert masked[~maskable].sum() == 0 and masked[:, 4:].sum() == 0


def texture_samples(count: int, seed: int) -> list[ShardSample]:
    """Smooth colour noise around a warm per-image colour (R > G > B), the same texture everywhere
    in an image, so random crops add little variance and statistics compare tightly."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(count):
        colour = rng.uniform([0.5, 0.3, 0.1], [0.8, 0.6, 0.4])
        noise = gaussian_filter(rng.normal(0, 1, (72, 72, 3)), (2, 2, 0))
        image = (np.clip(colour + 0.6 * noise, 0, 1) * 255).astype(np.uint8)
        samples.append(ShardSample(f"tex{i:04d}", {"jpg": encode(image, "JPEG")}, None, {}))
    return samples


def test_dali_and_reference_views_have_the_same_statistics(tmp_path):
    write_shard_set(texture_samples(256, 2), tmp_path, prefix="images", max_count=128)
    stats = {}
    for backend in ("dali", "reference"):
        loader = ViewLoader(tmp_path, 64, ViewConfig(large_size=32, small_size=16), backend=backend, seed=7)
        views = [torch.cat(vs) for vs in zip(*[b["views"] for b in loader], strict=True)]
        groups = [torch.cat([views[0], views[2]]), torch.cat([views[1], views[3]]), views[4], views[5]]
        # Per view group: per-channel pixel mean and std, and the spread of per-image means.
        stats[backend] = np.array(
            [[g.mean(dim=(0, 2, 3)).numpy(), g.std(dim=(0, 2, 3)).numpy(), g.mean(dim=(2, 3)).std(dim=0).numpy()]
             for g in groups]
        )
    diff = np.abs(stats["dali"] - stats["reference"])
    # The backends draw different random numbers: with 256 images the observed differences are
    # <= 0.09 (normalised units). Swapped channels, a 0..255 vs 0..1 scale slip, a missing
    # normalisation or colour jitter on every view move these by 0.3 or more.
    assert diff.max() < 0.15, np.round(diff, 3)
    means = stats["dali"][:, 0]
    assert np.all(means[:, 0] > means[:, 2] + 0.2)  # red stays above blue: channel order kept
    # Per-pixel agreement of each colour operation is checked in test_data_ops.py.


@pytest.mark.parametrize(("large_views", "small_views"), [(3, 1), (1, 0)])
def test_the_pipelines_outputs_are_read_by_name_whatever_the_view_list(tmp_path, large_views, small_views):
    """Each view's pixels, parameters, flag and crop of the mask come out under its own name, at its own
    size, for view lists of other lengths than the paper's (a positional layout shifted with them)."""
    from relicv2.pretrain.views.dali_pipeline import (
        build_view_pipeline,
        output_names,
        soft_mask_views,
        view_output,
    )
    from relicv2.shards.sample_set import load_sample_set

    write_shard_set(object_samples(8, 5, unmasked_every=4), tmp_path / "set", prefix="obj", max_count=8)
    sample_set = load_sample_set(tmp_path / "set")
    cfg = ViewConfig(large_views=large_views, small_views=small_views, large_size=40, small_size=24, num_threads=1,
                     mask_probability=0.5)
    pipe = build_view_pipeline(sample_set, cfg, batch_size=4, gpu=False, rank=0, world_size=1, seed=0)
    out = dict(zip(output_names(sample_set, cfg), pipe.run(), strict=True))
    assert soft_mask_views(sample_set, cfg) == list(range(large_views))  # the large views may be masked
    for j in range(large_views + small_views):
        size = 40 if j < large_views else 24
        assert np.array(out[view_output("view", j)].as_tensor()).shape == (4, size, size, 3)
        assert np.array(out[view_output("params", j)].as_tensor()).shape == (4, 4)
        assert set(np.array(out[view_output("masked", j)].as_tensor()).tolist()) <= {0.0, 1.0}
    for j in range(large_views):
        assert np.array(out[view_output("soft", j)].as_tensor()).shape == (4, 40, 40, 1)
    assert 0.0 < float(np.array(out["coverage"].as_tensor()).max()) <= 1.0
