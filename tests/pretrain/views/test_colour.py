"""The torch colour stage against torchvision's functional ops, sample by sample, on float images.

Both compute in float32 with a clamp after each step, so they agree to float rounding; a wrong
factor, order, formula or sample mix-up is orders of magnitude above the tolerances.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torchvision.transforms.functional as F
from PIL import Image

from relicv2.pretrain.views.colour import (
    Background,
    ColourDraws,
    adjust_brightness,
    adjust_contrast,
    adjust_hue,
    adjust_saturation,
    colour_view,
    colour_views,
    gaussian_blur,
)
from relicv2.pretrain.views.config import (
    DRAWN_PARAM_NAMES,
    IMAGENET_MEAN,
    IMAGENET_STD,
    JITTER_ORDERS,
    ViewConfig,
    view_specs,
)

TOL = 2e-5


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    """Eight 3 x 24 x 20 images in [0, 1]: smooth colours, saturated primaries, greys and exact ties
    between channels (the cases where the hue's choice of sextant matters)."""
    rng = np.random.default_rng(3)
    x = rng.uniform(0, 1, (8, 3, 24, 20)).astype(np.float32)
    x[1] = np.round(x[1] * 4) / 4  # many ties between channels
    x[2, :, :12] = np.array([1.0, 0.0, 0.0], np.float32)[:, None, None]  # pure red, then pure blue
    x[2, :, 12:] = np.array([0.0, 0.0, 1.0], np.float32)[:, None, None]
    x[3] = x[3, :1]  # grey: no hue at all
    x[4, 1] = x[4, 0]  # r == g everywhere
    x[5] = (np.round(rng.uniform(0, 255, (3, 24, 20))) / 255).astype(np.float32)  # 8-bit levels, as decoded
    return torch.from_numpy(x)


FACTORS = torch.tensor([0.6, 0.8, 1.0, 1.2, 1.4, 0.0, 1.37, 0.93])
HUES = torch.tensor([-0.1, -0.05, 0.0, 0.03, 0.1, 0.5, -0.5, 0.071])


@pytest.mark.parametrize(
    ("ours", "theirs", "values"),
    [
        (adjust_brightness, F.adjust_brightness, FACTORS),
        (adjust_contrast, F.adjust_contrast, FACTORS),
        (adjust_saturation, F.adjust_saturation, FACTORS),
        (adjust_hue, F.adjust_hue, HUES),
    ],
    ids=["brightness", "contrast", "saturation", "hue"],
)
def test_each_jitter_step_matches_torchvision_per_sample(images, ours, theirs, values):
    out = ours(images.clone(), values.view(-1, 1, 1, 1))
    for i in range(len(images)):
        expected = theirs(images[i], float(values[i]))
        assert (out[i] - expected).abs().max() < TOL, (ours.__name__, i, float(values[i]))
    assert (out - images).abs().mean() > 0.01  # the steps really changed the images


def test_blur_matches_torchvision_per_sample_sigma(images):
    sigma = np.array([0.1, 0.5, 1.0, 1.5, 2.0, 0.7, 1.2, 1.9])
    out = gaussian_blur(images, sigma, kernel=23)  # 23 > 20 px: clamped to the largest that fits (19)
    for i in range(len(images)):
        expected = F.gaussian_blur(images[i], [19, 19], [float(sigma[i])] * 2)
        assert (out[i] - expected).abs().max() < 1e-5, (i, sigma[i])
    sharp = gaussian_blur(images[:1], np.array([2.0]), kernel=5)
    assert (sharp - F.gaussian_blur(images[0], [5, 5], [2.0, 2.0])).abs().max() < 1e-5


def draws_for(batch: int, rng: np.random.Generator, **fixed) -> ColourDraws:
    params = {
        "jitter": rng.uniform(size=batch) < 0.8, "order": rng.integers(0, len(JITTER_ORDERS), batch),
        "brightness": rng.uniform(0.6, 1.4, batch), "contrast": rng.uniform(0.6, 1.4, batch),
        "saturation": rng.uniform(0.8, 1.2, batch), "hue": rng.uniform(-0.1, 0.1, batch),
        "grayscale": rng.uniform(size=batch) < 0.3, "blur": rng.uniform(size=batch) < 0.5,
        "sigma": rng.uniform(0.1, 2.0, batch), "solarize": rng.uniform(size=batch) < 0.5, **fixed,
    }
    table = np.zeros((batch, len(DRAWN_PARAM_NAMES)), np.float32)
    for name, values in params.items():
        table[:, DRAWN_PARAM_NAMES.index(name)] = values
    return ColourDraws.from_params(table)


def torchvision_view(image: torch.Tensor, d: ColourDraws, i: int, kernel: int) -> torch.Tensor:
    """torchvision's functional ops in the paper's order with sample i's draws, normalised."""
    steps = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)
    if d.jitter[i]:
        for op in JITTER_ORDERS[d.order[i]]:
            image = steps[op](image, float(d.factors[i, op]))
    if d.grayscale[i]:
        image = F.rgb_to_grayscale(image, num_output_channels=3)
    if d.blur[i]:
        image = F.gaussian_blur(image, [kernel, kernel], [float(d.sigma[i])] * 2)
    if d.solarize[i]:
        image = F.solarize(image, 0.5)
    return F.normalize(image, IMAGENET_MEAN, IMAGENET_STD)


def test_colour_view_replays_torchvision_in_each_samples_order():
    rng = np.random.default_rng(8)
    batch = 48
    images = torch.from_numpy(rng.integers(0, 256, (batch, 20, 22, 3), dtype=np.uint8))  # B x H x W x 3, as DALI
    draws = draws_for(batch, rng)
    spec = view_specs(ViewConfig(large_views=1, small_views=0, blur_probability_even=1.0, solarize_probability_odd=1.0))[0]
    out = colour_view(images, draws, spec, ViewConfig())
    assert out.shape == (batch, 3, 20, 22) and out.dtype == torch.float32
    untouched = 0
    for i in range(batch):
        expected = torchvision_view(images[i].permute(2, 0, 1).float() / 255, draws, i, kernel=min(23, 2 * 20 - 1))
        assert (out[i] - expected).abs().max() < 1e-4, (i, draws.order[i], draws.jitter[i])
        untouched += not (draws.jitter[i] or draws.grayscale[i] or draws.blur[i] or draws.solarize[i])
    assert len(set(draws.order[draws.jitter].tolist())) > 12  # many orders exercised
    assert untouched > 0  # and samples that take no step at all


def test_steps_of_probability_zero_leave_the_view_alone():
    rng = np.random.default_rng(1)
    images = torch.from_numpy(rng.integers(0, 256, (6, 16, 16, 3), dtype=np.uint8))
    draws = draws_for(6, rng, jitter=np.zeros(6), grayscale=np.zeros(6), blur=np.ones(6), solarize=np.ones(6))
    cfg = ViewConfig(blur_probability_even=0.0, blur_probability_odd=0.0, solarize_probability_odd=0.0)
    spec = view_specs(cfg)[0]  # the spec says no blur and no solarize: drawn flags are not applied
    out = colour_view(images, draws, spec, cfg)
    expected = F.normalize(images.permute(0, 3, 1, 2).float() / 255, IMAGENET_MEAN, IMAGENET_STD)
    assert torch.allclose(out, expected, atol=1e-6)


def test_the_background_is_replaced_on_the_masked_rows_only_before_the_colour_steps():
    """The saliency masking as the PIL reference does it (`Image.composite` of view and grey by the
    crop of the mask, 8 bits), applied to the rows the pipeline flagged, before the colour steps."""
    rng = np.random.default_rng(4)
    batch = 12
    images = torch.from_numpy(rng.integers(0, 256, (batch, 18, 16, 3), dtype=np.uint8))
    soft = torch.from_numpy(rng.integers(0, 256, (batch, 18, 16, 1), dtype=np.uint8))
    soft[:, :6] = 0  # all background
    soft[:, 12:] = 255  # all object
    masked = rng.uniform(size=batch) < 0.5
    masked[:2] = [True, False]
    grey = rng.integers(0, 256, batch) / 255
    draws = draws_for(batch, rng)
    spec = view_specs(ViewConfig(large_views=1, small_views=0, blur_probability_even=1.0))[0]
    out = colour_view(images, draws, spec, ViewConfig(), Background(masked=masked, grey=grey, soft=soft))
    plain = colour_view(images, draws, spec, ViewConfig())
    worst = 0.0
    for i in range(batch):
        if not masked[i]:
            assert torch.equal(out[i], plain[i])
            continue
        assert (out[i] - plain[i]).abs().max() > 0.5  # the background did change
        view = Image.fromarray(images[i].numpy())
        level = Image.new("RGB", view.size, (int(round(grey[i] * 255)),) * 3)
        view = Image.composite(view, level, Image.fromarray(soft[i, ..., 0].numpy()))
        expected = torchvision_view(torch.from_numpy(np.array(view)).permute(2, 0, 1).float() / 255, draws, i,
                                    kernel=min(23, 2 * 16 - 1))
        worst = max(worst, float((out[i] - expected).abs().max()))
    # The same 8-bit values as PIL's composite (float rounding after the colour steps); a weight
    # off by one level of the mask, or an unrounded blend, is ~1e-2 here.
    assert worst < 1e-4, worst


def batch_of_views(specs, batch: int, rng: np.random.Generator, **fixed):
    """Random B x H x W x 3 uint8 views for `specs`, their draws and, for the views that may be
    masked, half their samples masked by a random mask."""
    views = [torch.from_numpy(rng.integers(0, 256, (batch, s.size, s.size, 3), dtype=np.uint8)) for s in specs]
    draws = [draws_for(batch, rng, **fixed) for _ in specs]
    backgrounds = {
        j: Background(masked=rng.uniform(size=batch) < 0.5, grey=rng.integers(0, 256, batch) / 255,  # whole levels, as drawn
                      soft=torch.from_numpy(rng.integers(0, 256, (batch, s.size, s.size, 1), dtype=np.uint8)))
        for j, s in enumerate(specs) if s.mask_probability > 0
    }
    return views, draws, backgrounds


@pytest.mark.parametrize("small_size", [12, 16], ids=["two-sizes", "one-size-some-unmasked"])
def test_views_coloured_together_are_each_view_coloured_alone(small_size):
    """The loader colours the views of one size as one batch: every view must come out as it does
    alone, with its own draws, its own spec (the large odd view never solarizes, whatever was drawn)
    and its own mask; with one size for all, masked and unmasked views share a batch."""
    batch = 10
    cfg = ViewConfig(large_size=16, small_size=small_size, blur_probability_even=0.5, solarize_probability_odd=0.0)
    specs = view_specs(cfg)
    # Every step drawn for every sample: the spec alone decides what a view applies.
    views, draws, backgrounds = batch_of_views(specs, batch, np.random.default_rng(12), blur=np.ones(batch),
                                               solarize=np.ones(batch))
    together = colour_views(views, draws, specs, cfg, backgrounds, stack=True)  # the default on a GPU
    assert len(together) == len(specs)
    for j, spec in enumerate(specs):
        alone = colour_view(views[j], draws[j], spec, cfg, backgrounds.get(j))
        assert together[j].shape == alone.shape == (batch, 3, spec.size, spec.size)
        assert (together[j] - alone).abs().max() < 1e-5, j  # a row or draw mixed up is > 1e-2
    odd_large = specs[0]
    assert odd_large.solarize_probability == 0 and not torch.equal(
        together[0], colour_view(views[0], draws[0], dataclasses.replace(odd_large, solarize_probability=1.0), cfg,
                                 backgrounds.get(0)))


def test_colour_params_follow_the_config_and_replay_from_the_pipelines_draw():
    """The torch stage's colour draws, made on the host from one pipeline draw per sample: each column
    where DRAWN_PARAM_NAMES puts it, each in its configured range or at its probability, the same draws
    for the same pipeline output (a resumed pipeline replays them) and others for another."""
    from relicv2.pretrain.views.colour import colour_params

    rows = 4000
    cfg = ViewConfig(jitter_probability=0.8, grayscale_probability=0.0, blur_sigma=(0.5, 1.5))
    spec = view_specs(cfg)[1]  # even large view: blur 1.0, solarize 0.0
    rng = np.random.default_rng(0)
    pipeline = np.column_stack([rng.uniform(0.08, 1, rows), rng.uniform(0.75, 1.33, rows),
                                rng.integers(0, 2, rows), rng.uniform(0, 1, rows)]).astype(np.float32)
    params = colour_params(pipeline, spec, cfg)
    col = {name: params[:, i] for i, name in enumerate(DRAWN_PARAM_NAMES)}
    assert params.shape == (rows, len(DRAWN_PARAM_NAMES))
    assert np.array_equal(params[:, :3], pipeline[:, :3])  # area, ratio, flip kept
    assert abs(col["jitter"].mean() - 0.8) < 0.03 and set(np.unique(col["jitter"])) == {0.0, 1.0}
    assert set(np.unique(col["order"])) == set(range(len(JITTER_ORDERS)))
    for name, (lo, hi) in {"brightness": (0.6, 1.4), "contrast": (0.6, 1.4), "saturation": (0.8, 1.2),
                           "hue": (-0.1, 0.1), "sigma": (0.5, 1.5)}.items():
        assert lo <= col[name].min() < lo + 0.01 and hi - 0.01 < col[name].max() <= hi, name
    assert col["grayscale"].sum() == 0 and col["blur"].all() and col["solarize"].sum() == 0
    assert np.array_equal(colour_params(pipeline.copy(), spec, cfg), params)
    other = pipeline.copy()
    other[:, 3] = np.random.default_rng(1).uniform(0, 1, rows)
    assert not np.array_equal(colour_params(other, spec, cfg)[:, 3:], params[:, 3:])


@pytest.mark.parametrize("stack", [False, True], ids=["alone", "stacked"])
def test_fused_kernels_give_each_row_its_selected_steps(stack):
    """The GPU's way (every row through every step, the drawn result kept) against the CPU's (each step
    on the rows that drew it): the same views, row by row, with masking, all four jitter steps in each
    row's order, grayscale, blur and solarize drawn for some rows and not others."""
    batch = 12
    cfg = ViewConfig(large_size=16, small_size=12, blur_probability_even=0.5, solarize_probability_odd=0.5)
    specs = view_specs(cfg)
    rng = np.random.default_rng(5)
    views, draws, backgrounds = batch_of_views(specs, batch, rng, blur=rng.uniform(size=batch) < 0.5,
                                               solarize=rng.uniform(size=batch) < 0.5)
    selected = colour_views(views, draws, specs, cfg, backgrounds, stack=stack, fused=False)
    fused = colour_views(views, draws, specs, cfg, backgrounds, stack=stack, fused=True)
    for j, (got, want) in enumerate(zip(fused, selected, strict=True)):
        assert got.shape == want.shape == (batch, 3, specs[j].size, specs[j].size)
        assert (got - want).abs().max() < 1e-5, j  # a row given another's step is > 1e-2
    assert all(d.jitter.any() and not d.jitter.all() for d in draws)  # both kinds of row were there
