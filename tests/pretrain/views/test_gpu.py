"""The DALI pipeline on a GPU (`mixed` decoding, every per-view operator and the masks on the GPU).

Tests marked `gpu` are skipped with a reason without CUDA and run with `pytest -m gpu` on a GPU
machine; the first test only traces the GPU graph and runs everywhere. The GPU variants of the
mask-alignment, frequency and reference-agreement tests live beside their CPU versions
(test_augment.py, test_backends_agree.py).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from relicv2.models.normalization import IMAGENET_STD
from relicv2.pretrain.views.config import PARAM_NAMES, ViewConfig
from relicv2.pretrain.views.dali_pipeline import (
    _views_pipeline,
    output_names,
    soft_mask_views,
    view_output,
)
from relicv2.pretrain.views.loader import ViewLoader
from relicv2.shards import ShardSample, write_shard_set
from relicv2.shards.sample_set import load_sample_set
from tests.pretrain.views.test_augment import object_samples
from tests.pretrain.views.test_backends_agree import FIXED_GEOMETRY, masked_squares  # noqa: F401 (fixture)

COL = {name: i for i, name in enumerate(PARAM_NAMES)}
STD = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
# Every draw degenerate: the whole square image, mirrored, masked with grey 0.5, grayscale, blur of
# sigma 1, solarize. Only the decoders and the operator implementations differ between devices.
FIXED = ViewConfig(**{**FIXED_GEOMETRY, "mask_grey_range": (0.5, 0.5), "jitter_probability": 0.0,
                      "grayscale_probability": 1.0, "blur_probability_even": 1.0, "blur_probability_odd": 1.0,
                      "blur_sigma": (1.0, 1.0), "solarize_probability_even": 1.0, "solarize_probability_odd": 1.0})


@pytest.mark.parametrize("every_sample_masked", [True, False], ids=["masks-on-gpu", "some-without-mask"])
@pytest.mark.parametrize(
    "settings",
    [{}, {"debug_params": True}],
    ids=["training", "debug"],
)
def test_the_gpu_graph_traces_with_views_and_masks_on_the_gpu(tmp_path, every_sample_masked, settings):
    """Defining the GPU pipeline (no GPU needed until it is built) catches device mix-ups in the graph:
    a GPU value used as a condition, CPU and GPU inputs to one operator, a view left on the CPU; with
    and without the debug outputs."""
    shards = mask_set(tmp_path, every_sample_masked=every_sample_masked)
    sample_set = load_sample_set(shards)
    views = ViewConfig(large_size=64, small_size=32, mask_probability=0.5, **settings)
    pipe = _views_pipeline(sample_set, views, True, 0, 1, 0, batch_size=8, num_threads=1, device_id=0, seed=1)
    devices = {name: node.device for name, node in zip(output_names(sample_set, views), pipe._graph_out, strict=True)}
    count = views.large_views + views.small_views
    assert [devices[view_output("view", j)] for j in range(count)] == ["gpu"] * count  # every view is made on the GPU
    assert devices["coverage"] == ("gpu" if every_sample_masked else "cpu")  # masks decoded by `mixed` when all have one
    crops = soft_mask_views(sample_set, views)  # the large views' crops of the mask, for the colour stage's blend
    assert len(crops) == views.large_views
    assert [devices[view_output("soft", j)] for j in crops] == ["gpu"] * len(crops)


@pytest.mark.gpu
def test_mixed_matches_the_cpu_operators_on_fixed_parameters(masked_squares):  # noqa: F811
    cpu = next(iter(ViewLoader(masked_squares, 16, FIXED, device="cpu", seed=1)))
    gpu = next(iter(ViewLoader(masked_squares, 16, FIXED, device="cuda", seed=1)))
    assert gpu["views"][0].is_cuda
    order = [gpu["keys"].index(k) for k in cpu["keys"]]  # the same reader order, checked anyway
    for name in ("masked", "flip", "grayscale", "blur", "solarize"):
        assert cpu["params"][:, :, COL[name]].all() and gpu["params"][order][:, :, COL[name]].all(), name
    coverage_gap = (cpu["params"][:, :, COL["coverage"]] - gpu["params"][order][:, :, COL["coverage"]]).abs()
    assert coverage_gap.max() < 1e-6  # the same mask pixels: decoded identically on both devices
    for j in range(len(cpu["views"])):
        diff = (cpu["views"][j] - gpu["views"][j][order].cpu()).abs() * STD  # in [0, 1] pixel units
        # nvJPEG and libjpeg-turbo round their IDCTs differently (about one 8-bit level), and a pixel
        # one level from 128 may then solarize the other way: a handful of pixels differ a lot.
        assert diff.mean() < 2.0 / 255, j
        assert (diff > 4.0 / 255).float().mean() < 0.01, j


def mask_set(directory, *, every_sample_masked: bool):
    samples = object_samples(40, 3)
    if not every_sample_masked:  # a quarter without a mask member: the masks take the CPU decoder
        samples = [s if i % 4 else ShardSample(s.key, {"jpg": s.members["jpg"]}, s.label, s.meta)
                   for i, s in enumerate(samples)]
    write_shard_set(samples, directory, prefix="masked", max_count=16)
    return directory


@pytest.mark.gpu
@pytest.mark.parametrize("every_sample_masked", [True, False], ids=["masks-on-gpu", "some-without-mask"])
def test_a_masked_shard_set_through_the_whole_gpu_pipeline(tmp_path, every_sample_masked):
    shards = mask_set(tmp_path, every_sample_masked=every_sample_masked)
    views = ViewConfig(large_size=64, small_size=32, mask_probability=0.5, output_dtype="bfloat16",
                       debug_params=True, num_threads=2)
    loader = ViewLoader(shards, 8, views, device="cuda", seed=2)
    assert len(loader) == 5
    first = list(loader)
    state = loader.state_dict()
    second = [next(iter(loader))]  # first batch of epoch 2
    for batch in first + second:
        assert [tuple(v.shape) for v in batch["views"]] == [(8, 3, 64, 64)] * 4 + [(8, 3, 32, 32)] * 2
        assert all(v.is_cuda and v.dtype == torch.bfloat16 and torch.isfinite(v.float()).all() for v in batch["views"])
    keys = [k for b in first for k in b["keys"]]
    assert len(keys) == 40 and len(set(keys)) == 40  # one whole epoch, each sample once
    masked = torch.cat([b["params"] for b in first])[:, :4, COL["masked"]].numpy()
    assert 0.25 < masked.mean() < 0.75  # p_m = 0.5 (with coverage ~0.3 every sample with a mask qualifies)
    if not every_sample_masked:
        assert masked[[keys.index(f"obj{i:04d}") for i in range(0, 40, 4)]].sum() == 0
    resumed = ViewLoader(shards, 8, views, device="cuda", seed=2)
    resumed.load_state_dict(state)
    again = next(iter(resumed))
    assert again["keys"] == second[0]["keys"]
    assert all(torch.equal(a, b) for a, b in zip(again["views"], second[0]["views"], strict=True))


@pytest.mark.gpu
def test_bfloat16_output_is_the_float32_views_rounded(masked_squares):  # noqa: F811
    fp32 = next(iter(ViewLoader(masked_squares, 16, FIXED, device="cuda", seed=1)))
    bf16 = next(iter(ViewLoader(masked_squares, 16, dataclasses.replace(FIXED, output_dtype="bfloat16"),
                                device="cuda", seed=1)))
    for a, b in zip(fp32["views"], bf16["views"], strict=True):
        assert b.dtype == torch.bfloat16
        assert np.allclose(a.cpu().numpy(), b.float().cpu().numpy(), atol=0.02)


@pytest.mark.gpu
def test_batches_made_ahead_on_their_own_stream_are_the_batches_made_on_demand(tmp_path):
    """The background thread queues its GPU work on its own stream; the consumer's stream must wait for
    it (a missing wait shows as views still being written), and the views must stay valid while the
    consumer allocates and writes on its own stream (a missing record_stream lets memory be reused)."""
    shards = mask_set(tmp_path, every_sample_masked=True)
    views = ViewConfig(large_size=64, small_size=32, mask_probability=0.5, num_threads=2)
    on_demand = [b["views"] for b in ViewLoader(shards, 8, dataclasses.replace(views, ready_batches=0),
                                                device="cuda", seed=3)]
    ahead = ViewLoader(shards, 8, dataclasses.replace(views, ready_batches=3), device="cuda", seed=3)
    for want, batch in zip(on_demand, ahead, strict=True):
        scratch = [torch.full_like(v, float("nan")) for v in batch["views"]]  # the consumer's own work
        assert all(torch.equal(a, b) for a, b in zip(want, batch["views"], strict=True))
        del scratch


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["rows-selected", "fused-compiled"])
def test_the_colour_stage_never_waits_for_the_gpu(fused):
    """The loader's thread launches a batch's colour stage (every view, those of one size as one batch)
    without waiting for the GPU: a blocking copy (two a view before) stalls it until the stream's queued
    kernels have run, which during training share the GPU with the step. Any wait raises under sync
    debug mode "error"; each view is the one the CPU makes from the same draws, coloured alone.

    The blur is a convolution, which cuDNN runs in TF32 by default (`torch.backends.cudnn.allow_tf32`: a
    10-bit mantissa, ~5e-4 relative). With TF32 off the views are the CPU's to float rounding; with it on
    (what training runs) a blurred view may differ by up to ~3e-3 in normalised units (an emulation of
    TF32's rounding on the CPU gives 3.2e-3 on these draws), still far under one 8-bit grey level (0.017)."""
    from relicv2.pretrain.views.colour import colour_view, colour_views
    from relicv2.pretrain.views.config import view_specs
    from tests.pretrain.views.test_colour import batch_of_views

    cfg = ViewConfig(large_size=40, small_size=24, blur_probability_even=1.0, solarize_probability_odd=1.0)
    specs = view_specs(cfg)
    views, draws, backgrounds = batch_of_views(specs, 32, np.random.default_rng(3))
    on_cpu = [colour_view(view, d, spec, cfg, backgrounds.get(j))
              for j, (view, d, spec) in enumerate(zip(views, draws, specs, strict=True))]
    on_device = [v.cuda() for v in views]
    backgrounds_on_device = {j: dataclasses.replace(b, soft=b.soft.cuda()) for j, b in backgrounds.items()}
    colour_views(on_device, draws, specs, cfg, backgrounds_on_device, fused=fused)  # compiles the fused kernels
    for tf32, tolerance in ((False, 1e-3), (True, 5e-3)):
        torch.cuda.synchronize()
        with torch.backends.cudnn.flags(enabled=True, allow_tf32=tf32):
            torch.cuda.set_sync_debug_mode("error")
            try:
                on_gpu = colour_views(on_device, draws, specs, cfg, backgrounds_on_device, fused=fused)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for out, want, spec in zip(on_gpu, on_cpu, specs, strict=True):
            # A wrong factor or row is orders of magnitude above; an 8-bit rounding flip is 0.017.
            assert (out.cpu() - want).abs().max() < tolerance, (spec, f"TF32 {tf32}")


@pytest.mark.gpu
def test_the_fused_colour_stage_gives_the_rows_selected_views_on_a_batch_of_256():
    """The two ways of the torch stage on the GPU, at the paper's probabilities and a training batch: every
    row through compiled kernels against each step on the rows that drew it. With whole 8-bit grey levels
    (as the pipeline draws them) the masking blend's 8-bit rounding agrees, so they differ by float
    rounding alone; TF32 off, since cuDNN may pick another convolution for another shape."""
    from relicv2.pretrain.views.colour import Background, colour_views
    from relicv2.pretrain.views.config import view_specs
    from tests.pretrain.views.test_colour import batch_of_views

    cfg = ViewConfig(large_size=64, small_size=32, mask_probability=0.5)
    specs = view_specs(cfg)
    views, draws, backgrounds = batch_of_views(specs, 256, np.random.default_rng(11))
    on_device = [v.cuda() for v in views]
    backgrounds_on_device = {j: Background(b.masked, b.grey, b.soft.cuda()) for j, b in backgrounds.items()}
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        selected = colour_views(on_device, draws, specs, cfg, backgrounds_on_device, fused=False)
        fused = colour_views(on_device, draws, specs, cfg, backgrounds_on_device, fused=True)
    for j, (got, want) in enumerate(zip(fused, selected, strict=True)):
        assert (got - want).abs().max().item() < 1e-4, j  # one 8-bit level is 0.017 normalised
