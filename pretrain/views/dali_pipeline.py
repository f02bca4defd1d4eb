"""The DALI pipeline graph that turns shard samples into L large + S small augmented views.

One definition serves both devices: `gpu=True` decodes each image once with the `mixed` decoder
(the hardware JPEG decoder where there is one) and every per-view operator then runs on the GPU
because it consumes GPU data; `gpu=False` runs every operator on the CPU with `device_id=None`.
Random parameters come from DALI's own random operators (no Python callback per sample), drawn on
the CPU as argument inputs; masks are decoded (`mixed` on a GPU) and cropped with the same crop
window as their view. The pipeline is built once and lives across epochs.

The colour steps run where `ViewConfig.colour_stage` says: "torch" (default) leaves them to
`pretrain.views.colour`, which draws their parameters on the host from one draw of this pipeline per
sample and view (so a checkpoint of the pipeline restores them too) and applies them as batched torch
operations (DALI would need ~100 operators a view for them); "dali" draws and runs them here. There views stay 8-bit from the resize to
the normalisation, as in the PIL reference: the colour operators then run DALI's fast integer kernels
(with rounding between steps, like PIL).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types
from nvidia.dali import pipeline_def
from nvidia.dali.pipeline import DataNode, Pipeline

from pretrain.views.config import GRAYSCALE_WEIGHTS, JITTER_ORDERS, ViewConfig, ViewSpec, view_specs
from pretrain.views.sources import MASK_MEMBER, SampleSet
from shards.sample import IMAGE_MEMBERS, LABEL_MEMBER

READER_NAME = "shards"
# The `mixed` decoder's settings: nvJPEG buffers sized once for ImageNet's largest photos (NVIDIA's
# ResNet-50 DALI example) so that a large image never triggers a reallocation mid-run, and the
# chroma upsampling of the CPU decoder (libjpeg-turbo, as PIL), so both devices see the same pixels.
MIXED_DECODER = dict(
    device_memory_padding=211025920,
    host_memory_padding=140544512,
    preallocate_width_hint=5980,
    preallocate_height_hint=6430,
    jpeg_fancy_upsampling=True,
)
MAX = 255.0
HUE = 3  # index of the hue operation in JITTER_ORDERS entries
SOLARIZE_TABLE = [i if i < 128 else 255 - i for i in range(256)]  # x >= 0.5 -> 1 - x on 8 bits


@dataclass(frozen=True)
class CropWindow:
    """One view's random-resized crop as a relative ROI (flip: x start > x end) and its drawn values."""

    start: DataNode  # (y, x) relative
    end: DataNode
    area: DataNode  # crop area / image area (0 unless cfg.debug_params)
    ratio: DataNode  # crop width / height (0 unless cfg.debug_params)
    flip: DataNode  # 0.0 or 1.0


@dataclass(frozen=True)
class SampleMask:
    """A sample's saliency mask as the views use it (`image` None when masking is off)."""

    image: DataNode | None  # HW1 uint8, on the GPU when `on_gpu`
    coverage: DataNode  # fraction of mask pixels >= 128
    maskable: DataNode  # coverage >= mask_min_coverage
    grey: DataNode  # the sample's background grey level, 0..255 (CPU)
    has_mask: DataNode  # the sample has a mask member (CPU)
    on_gpu: bool


def _uniform(lo: float, hi: float) -> DataNode:
    """U[lo, hi) per sample; a constant when the range is empty (DALI rejects zero-width ranges)."""
    return fn.random.uniform(range=[lo, hi]) if hi > lo else fn.constant(fdata=float(lo), shape=[])


def _coin(probability: float, dtype) -> DataNode:
    """1 with `probability`, else 0, per sample, as a bool or (coin_flip has no float output) a float."""
    if dtype == types.FLOAT:
        return fn.random.choice(np.array([0.0, 1.0], np.float32), p=[1.0 - probability, probability])
    return fn.random.coin_flip(probability=probability, dtype=dtype)


def _to_uint8(x: DataNode) -> DataNode:
    return fn.cast(dmath.clamp(x, 0.0, MAX), dtype=types.UINT8)  # DALI's cast rounds to nearest


def _on_device(x: DataNode, gpu: bool) -> DataNode:
    """A per-sample CPU value moved to where the views live (arithmetic inputs share one device)."""
    return x.gpu() if gpu else x


def _jitter_op(view: DataNode, op: int, factors, hue_model: str, gpu: bool) -> DataNode:
    """One colour-jitter operation with torchvision's semantics on an 8-bit view."""
    brightness, contrast, saturation, hue = factors
    if op == 0:
        return fn.brightness(view, brightness=brightness)
    if op == 1:  # around the image's mean grey level (mean of the luma = luma of the channel means)
        channel_means = fn.reductions.mean(view, axes=[0, 1])
        centre = sum(channel_means[c] * w for c, w in enumerate(GRAYSCALE_WEIGHTS))
        # Arithmetic, not fn.contrast: its contrast_center must be a CPU value, the mean is not on GPU.
        return _to_uint8(centre + (view - centre) * _on_device(contrast, gpu))
    if op == 2:  # DALI scales chroma around the luma: torchvision's blend with the grey image
        return fn.saturation(view, saturation=saturation)
    if hue_model == "yiq":  # DALI's fast linear approximation (rotation about the grey axis in YIQ)
        return fn.hue(view, hue=hue * 360.0)
    return _shift_hue(view, _on_device(hue, gpu))


def _shift_hue(view: DataNode, shift: DataNode) -> DataNode:
    """torchvision's adjust_hue on an 8-bit view: H (HSV) rotated by `shift` of the circle, S and V kept.

    Written with DALI arithmetic because `fn.hue`/`fn.hsv` rotate in YIQ, a linear approximation
    that keeps luma instead of V and differs visibly from torchvision on saturated colours. It costs
    a few times `fn.hue` on the CPU (~35 element-wise passes); `hue_model="yiq"` is the fast option.
    Output channel n of (r, g, b) = (5, 3, 1): V - C * clamp(min(k, 4 - k), 0, 1), k = (n + H) mod 6,
    with H in sixths of the circle and C = max - min.
    """
    view = fn.cast(view, dtype=types.FLOAT)  # 8-bit differences would wrap around
    r, g, b = view[:, :, 0:1], view[:, :, 1:2], view[:, :, 2:3]
    value = dmath.max(r, dmath.max(g, b))
    chroma = value - dmath.min(r, dmath.min(g, b))
    inv = 1.0 / dmath.max(chroma, 1e-6)
    is_r = value == r
    is_g = (value == g) & (value != r)
    is_b = (value != r) & (value != g)
    hue = is_r * ((g - b) * inv) + is_g * ((b - r) * inv + 2.0) + is_b * ((r - g) * inv + 4.0) + shift * 6.0
    hue = hue - 6.0 * dmath.floor(hue / 6.0)  # [0, 6)

    def channel(n: float) -> DataNode:
        k = hue + n  # [n, n + 6): one wrap at most
        k = k - 6.0 * (k >= 6.0)
        return value - chroma * dmath.clamp(dmath.min(k, 4.0 - k), 0.0, 1.0)

    return _to_uint8(fn.cat(channel(5.0), channel(3.0), channel(1.0), axis=2))


def _one_of(view: DataNode, op: DataNode, ops: list[int], exhaustive: bool, factors, hue_model: str, gpu: bool) -> DataNode:
    """Apply jitter operation `op` (per sample) if it is in `ops`; nested ifs, one split each.

    `exhaustive`: every sample's `op` is in `ops`, so the last one needs no test. Operations of
    zero strength are left out by the caller (they are the identity).
    """
    if len(ops) == 1 and exhaustive:
        return _jitter_op(view, ops[0], factors, hue_model, gpu)
    if op == ops[0]:
        view = _jitter_op(view, ops[0], factors, hue_model, gpu)
    elif len(ops) > 1:
        view = _one_of(view, op, ops[1:], exhaustive, factors, hue_model, gpu)
    return view


def _crop_window(shape: DataNode, image_hw: DataNode, spec: ViewSpec, cfg: ViewConfig) -> CropWindow:
    """The relative ROI of one random-resized crop, flip included, drawn by DALI's own random ops.

    Drawn once per view and applied to both image and mask; a flip is an ROI whose x start is
    greater than its end (DALI's resize then mirrors), so crop and flip stay identical for both.
    `image_hw`: the image's (height, width) as floats. Written as (y, x) vector arithmetic: every
    operator here runs once per sample per view, so each one saved counts.
    """
    anchor, size = fn.random_crop_generator(shape, random_area=list(spec.crop_scale), random_aspect_ratio=list(cfg.crop_ratio))
    flip = _coin(cfg.flip_probability, types.FLOAT)
    start, extent = anchor / image_hw, size / image_hw  # relative (y, x)
    mirror = fn.stack(flip * 0.0, flip) * extent  # a flip moves x start to x end and back
    if cfg.debug_params:
        area, ratio = extent[0] * extent[1], size[1] / size[0]
    else:  # only reported, never used: no operators for them
        area = ratio = flip * 0.0
    return CropWindow(start=start + mirror, end=start + extent - mirror, area=area, ratio=ratio, flip=flip)


def _resize_args(window: CropWindow, spec: ViewSpec) -> dict:
    return dict(size=[spec.size, spec.size], roi_start=window.start, roi_end=window.end, roi_relative=True, antialias=True)


def _apply_mask(view: DataNode, mask: SampleMask, window: CropWindow, spec: ViewSpec, cfg: ViewConfig,
                gpu: bool) -> tuple[DataNode, DataNode, DataNode | None]:
    """Replace the background of a large view by the sample's grey level with probability p_m.

    The mask gets the view's crop window (and so its flip). Returns (view, masked flag as float,
    the view's crop of the mask or None). With the torch colour stage the view comes back as it was
    and the crop of the mask (HW1 uint8, on the views' device) goes out with it: the blend is a few
    element-wise operations there, against ~9 DALI operators a view here. Otherwise, with masks on
    the GPU (`mask.on_gpu`) the blend is arithmetic with a 0/1 weight, because the maskable flag is
    GPU data and cannot drive a conditional; on the CPU only masked views pay for the mask crop and
    the blend.
    """
    draw = fn.random.coin_flip(probability=spec.mask_probability, dtype=types.BOOL)
    if mask.image is None or spec.mask_probability == 0:
        return view, fn.cast(draw, dtype=types.FLOAT) * 0.0, None
    if cfg.colour_stage == "torch":
        masked = (draw.gpu() if mask.on_gpu else draw) & mask.maskable
        soft = fn.resize(mask.image, interp_type=types.INTERP_LINEAR, **_resize_args(window, spec))  # uint8
        return view, fn.cast(masked, dtype=types.FLOAT), soft if mask.on_gpu else _on_device(soft, gpu)
    if mask.on_gpu:
        masked = fn.cast(draw.gpu() & mask.maskable, dtype=types.FLOAT)
        soft = fn.resize(mask.image, interp_type=types.INTERP_LINEAR, dtype=types.FLOAT, **_resize_args(window, spec)) / MAX
        keep = 1.0 - masked + masked * soft  # 1 everywhere when the view is not masked
        grey = mask.grey.gpu()
        return _to_uint8(grey + (view - grey) * keep), masked, None
    masked = draw & mask.maskable
    if masked:
        soft = fn.resize(mask.image, interp_type=types.INTERP_LINEAR, dtype=types.FLOAT, **_resize_args(window, spec)) / MAX
        grey = _on_device(mask.grey, gpu)
        view = _to_uint8(grey + (view - grey) * _on_device(soft, gpu))
    return view, fn.cast(masked, dtype=types.FLOAT), None


@dataclass(frozen=True)
class ColourNodes:
    """One view's colour parameters, drawn by DALI's random operators (CPU, per sample)."""

    jitter: DataNode
    order: DataNode  # index into JITTER_ORDERS
    factors: tuple[DataNode, DataNode, DataNode, DataNode]  # brightness, contrast, saturation, hue
    gray: DataNode
    sigma: DataNode
    blur: DataNode
    solarize: DataNode


def _colour_draws(spec: ViewSpec, cfg: ViewConfig) -> ColourNodes:
    """Every colour parameter of a view for the DALI colour stage, which branches on the flags (booleans)
    and looks the order up (an integer). The torch stage draws the same on the host (`colour_params`)."""
    jitter = _coin(cfg.jitter_probability, types.BOOL)
    order = fn.random.uniform(values=list(range(len(JITTER_ORDERS))), dtype=types.INT32)
    factors = (
        _uniform(max(0.0, 1 - cfg.brightness), 1 + cfg.brightness),
        _uniform(max(0.0, 1 - cfg.contrast), 1 + cfg.contrast),
        _uniform(max(0.0, 1 - cfg.saturation), 1 + cfg.saturation),
        _uniform(-cfg.hue, cfg.hue),
    )
    gray = _coin(cfg.grayscale_probability, types.BOOL)
    sigma = _uniform(*cfg.blur_sigma)
    blur = _coin(spec.blur_probability, types.BOOL)
    solarize = _coin(spec.solarize_probability, types.BOOL)
    return ColourNodes(jitter, order, factors, gray, sigma, blur, solarize)


def _colour_jitter(view: DataNode, draws: ColourNodes, cfg: ViewConfig, gpu: bool) -> DataNode:
    """Brightness, contrast, saturation and hue in the sample's random order, with probability p_jitter."""
    active = [op for op, strength in enumerate((cfg.brightness, cfg.contrast, cfg.saturation, cfg.hue)) if strength > 0]
    if active and cfg.jitter_probability > 0:
        if draws.jitter:
            view = _jitter_in_order(view, draws.order, draws.factors, active, cfg.hue_model, gpu)
    return view


def _order_lookup(order: DataNode, values: list[int]) -> DataNode:
    """values[order] per sample (an int per entry of JITTER_ORDERS)."""
    return fn.lookup_table(order, keys=list(range(len(JITTER_ORDERS))), values=values, dtype=types.INT32)


def _jitter_in_order(view: DataNode, order: DataNode, factors, active: list[int], hue_model: str, gpu: bool) -> DataNode:
    """The active jitter operations in the sample's order JITTER_ORDERS[order].

    The order is the three linear operations (brightness, contrast, saturation) in their relative
    order with hue inserted at one position. Hue, by far the costliest (exact HSV is ~35 element-wise
    passes), is therefore built once per view, unconditionally, between the linear operations that
    precede it and those that follow, instead of once per slot; every sample still sees exactly its
    order.
    """
    positions = range(len(JITTER_ORDERS[0]) - 1)  # of the linear operations, relative to each other
    linear = [op for op in active if op != HUE]
    linear_at = [_order_lookup(order, [[op for op in o if op != HUE][k] for o in JITTER_ORDERS]) for k in positions]
    exhaustive = len(linear) == len(positions)  # every sample's linear op at a position is active

    def linear_step(view: DataNode, k: int) -> DataNode:
        return _one_of(view, linear_at[k], linear, exhaustive, factors, hue_model, gpu) if linear else view

    if HUE not in active:
        for k in positions:
            view = linear_step(view, k)
        return view
    hue_at = _order_lookup(order, [o.index(HUE) for o in JITTER_ORDERS])
    for k in positions:
        if hue_at > k:  # linear position k comes before the hue
            view = linear_step(view, k)
    view = _jitter_op(view, HUE, factors, hue_model, gpu)
    for k in positions:
        if hue_at <= k:
            view = linear_step(view, k)
    return view


def _grayscale(view: DataNode, draws: ColourNodes, cfg: ViewConfig) -> DataNode:
    if cfg.grayscale_probability > 0:  # static skips: an operation of probability 0 costs nothing
        if draws.gray:
            # DALI's RGB->GRAY uses the same ITU-R 601 weights; GRAY->RGB replicates the channel.
            grey_view = fn.color_space_conversion(view, image_type=types.RGB, output_type=types.GRAY)
            view = fn.color_space_conversion(grey_view, image_type=types.GRAY, output_type=types.RGB)
    return view


def _blur(view: DataNode, draws: ColourNodes, spec: ViewSpec, cfg: ViewConfig) -> DataNode:
    if spec.blur_probability > 0:
        if draws.blur:
            # The configured kernel (the paper's 23x23), truncated at 4 sigma: the dropped tails
            # hold < 2e-4 of the weight, under 0.05 of an 8-bit level, and the blur, the costliest
            # step on a CPU, gets ~2x cheaper on average.
            window = dmath.min(2.0 * dmath.ceil(4.0 * draws.sigma) + 1.0, float(cfg.blur_kernel))
            view = fn.gaussian_blur(view, window_size=fn.cast(window, dtype=types.INT32), sigma=draws.sigma)
    return view


def _solarize(view: DataNode, draws: ColourNodes, spec: ViewSpec) -> DataNode:
    if spec.solarize_probability > 0:
        if draws.solarize:
            view = fn.lookup_table(view, keys=list(range(256)), values=SOLARIZE_TABLE, dtype=types.UINT8)
    return view


def _view(image: DataNode, mask: SampleMask, shape: DataNode, image_hw: DataNode, spec: ViewSpec, cfg: ViewConfig,
          gpu: bool):
    """One view, its drawn parameters, its masked flag and its crop of the mask.

    The parameters: DRAWN_PARAM_NAMES with the DALI colour stage; with the torch stage the geometry's
    (area, ratio, flip) and a uniform draw the host's colour draws are seeded from (`colour_params`).

    The paper's order: crop and flip, mask, jitter, grayscale, blur, solarize. With the DALI colour
    stage the view comes out masked, coloured and normalised (CHW float); with the torch stage it
    comes out as cropped (HWC uint8), with its crop of the mask when masks are in play, and
    `pretrain.views.colour` applies the mask and the drawn colour steps.
    """
    window = _crop_window(shape, image_hw, spec, cfg)
    view = fn.resize(image, interp_type=types.INTERP_CUBIC, **_resize_args(window, spec))  # uint8: rounded, clamped
    view, masked, soft = _apply_mask(view, mask, window, spec, cfg, gpu)
    if cfg.colour_stage == "torch":
        # The colour parameters are drawn on the host (`pretrain.views.colour.colour_params`) from this
        # one draw per sample: ~10 DALI random operators a view cost more CPU per batch than the rest of
        # the graph's scalar work, numpy's vectorised draws a fraction of a millisecond.
        return view, fn.stack(window.area, window.ratio, window.flip, fn.random.uniform(range=[0.0, 1.0])), masked, soft
    draws = _colour_draws(spec, cfg)
    view = _colour_jitter(view, draws, cfg, gpu)
    view = _grayscale(view, draws, cfg)
    view = _blur(view, draws, spec, cfg)
    view = _solarize(view, draws, spec)
    view = fn.crop_mirror_normalize(
        view, mean=[m * MAX for m in cfg.mean], std=[s * MAX for s in cfg.std], output_layout="CHW",
        dtype=types.FLOAT,
    )
    f = lambda x: fn.cast(x, dtype=types.FLOAT)  # noqa: E731
    params = fn.stack(window.area, window.ratio, window.flip, f(draws.jitter), f(draws.order), *draws.factors,
                      f(draws.gray), f(draws.blur), draws.sigma, f(draws.solarize))
    return view, params, masked, soft


def _sample_mask(mask_bytes: DataNode, sample_set: SampleSet, cfg: ViewConfig, gpu: bool) -> SampleMask:
    """The sample's decoded mask, its coverage, whether it may be masked, and its grey level.

    On a GPU, when every sample has a mask (what `saliency build-masks` writes), masks go through
    the `mixed` decoder and stay on the GPU with coverage and the maskable flag; with some samples
    lacking one, the CPU decoder runs under a conditional (an empty member cannot be decoded) and
    the crops are moved to the GPU.
    """
    # A whole 8-bit grey level, as the reference's grey image: the masking blend then never lands on a
    # rounding boundary, so every way of computing it rounds alike (colour.fused_steps).
    grey = dmath.floor(_uniform(*[g * MAX for g in cfg.mask_grey_range]) + 0.5)
    has_mask = mask_bytes.shape()[0] > 0
    zero = fn.cast(mask_bytes.shape()[0], dtype=types.FLOAT) * 0.0
    if not masks_in_play(sample_set, cfg):
        return SampleMask(None, zero, zero >= 1.0, grey, has_mask, on_gpu=False)
    if gpu and sample_set.without_mask == 0:
        image = fn.decoders.image(mask_bytes, device="mixed", output_type=types.GRAY)
        coverage = fn.reductions.mean(fn.cast(image >= 128, dtype=types.FLOAT))
        return SampleMask(image, coverage, coverage >= cfg.mask_min_coverage, grey, has_mask, on_gpu=True)
    if has_mask:
        image = fn.decoders.image(mask_bytes, device="cpu", output_type=types.GRAY)
        coverage = fn.reductions.mean(fn.cast(image >= 128, dtype=types.FLOAT))
    else:  # no mask member: a 1x1 placeholder, never used since coverage 0 is never masked
        image = fn.reshape(fn.pad(mask_bytes, shape=[1], fill_value=0), shape=[1, 1, 1], layout="HWC")
        coverage = zero
    return SampleMask(image, coverage, coverage >= cfg.mask_min_coverage, grey, has_mask, on_gpu=False)


@pipeline_def(enable_conditionals=True, enable_checkpointing=True)
def _views_pipeline(sample_set: SampleSet, cfg: ViewConfig, gpu: bool, rank: int, world_size: int, reader_seed: int):
    image_bytes, mask_bytes, cls = fn.readers.webdataset(
        paths=[str(p) for p in sample_set.tars],
        index_paths=[str(p) for p in sample_set.index_files],
        ext=[";".join(IMAGE_MEMBERS), MASK_MEMBER, LABEL_MEMBER],
        missing_component_behavior="empty",
        name=READER_NAME,
        shard_id=rank,
        num_shards=world_size,
        random_shuffle=True,
        initial_fill=cfg.shuffle_buffer,
        shuffle_after_epoch=True,
        shuffle_after_epoch_seed=reader_seed,  # shared by all ranks: one global shard order per epoch
        seed=reader_seed,
        pad_last_batch=True,
    )
    # Decoded once per image (the hardware JPEG decoder on a GPU); every view is cut from it.
    decoder = dict(device="mixed", hw_decoder_load=cfg.hw_decoder_load, **MIXED_DECODER) if gpu else dict(device="cpu")
    image = fn.decoders.image(image_bytes, output_type=types.RGB, **decoder)
    shape = fn.peek_image_shape(image_bytes)
    image_hw = fn.cast(shape[0:2], dtype=types.FLOAT)
    mask = _sample_mask(mask_bytes, sample_set, cfg, gpu)
    views, params, masked, softs = [], [], [], []
    for spec in view_specs(cfg):
        v, p, m, soft = _view(image, mask, shape, image_hw, spec, cfg, gpu)
        views.append(v)
        params.append(p)
        masked.append(m)
        softs += [soft] if soft is not None else []
    # The image's first byte carries the reader's source info (tar:offset:member), i.e. the key, to
    # the batch (sets without a json member have keys too).
    key_carrier = image_bytes[0:1]
    outputs = [*views, key_carrier, cls, mask.has_mask, mask.coverage, mask.grey / MAX, *masked]
    if returns_params(cfg):
        outputs += params
    assert len(softs) == len(soft_mask_views(sample_set, cfg))  # the backend reads them by this layout
    return tuple(outputs + softs)


def masks_in_play(sample_set: SampleSet, cfg: ViewConfig) -> bool:
    """Whether any view of this set can be masked (the pipeline decodes masks only then)."""
    return sample_set.has_masks and cfg.mask_probability > 0 and cfg.large_views > 0


def soft_mask_views(sample_set: SampleSet, cfg: ViewConfig) -> list[int]:
    """The views whose crop of the mask the pipeline outputs (last, in view order): with the torch
    colour stage, which applies the mask, every view that may be masked."""
    if cfg.colour_stage != "torch" or not masks_in_play(sample_set, cfg):
        return []
    return [j for j, spec in enumerate(view_specs(cfg)) if spec.mask_probability > 0]


def returns_params(cfg: ViewConfig) -> bool:
    """Whether the pipeline outputs each view's drawn parameters: for debugging, or for the torch
    colour stage, which applies them."""
    return cfg.debug_params or cfg.colour_stage == "torch"


def build_view_pipeline(
    sample_set: SampleSet,
    cfg: ViewConfig,
    *,
    batch_size: int,
    gpu: bool,
    rank: int,
    world_size: int,
    seed: int,
    device_id: int = 0,
    checkpoint: str | None = None,
) -> Pipeline:
    """A built view pipeline; restores the reader and random state from `checkpoint` when given."""
    pipe = _views_pipeline(
        sample_set, cfg, gpu, rank, world_size, seed,
        batch_size=batch_size,
        num_threads=cfg.num_threads,
        device_id=device_id if gpu else None,
        seed=seed * 7919 + rank + 1,  # augmentations differ per rank, reproducible per seed
        prefetch_queue_depth=cfg.prefetch,
        checkpoint=checkpoint,
    )
    pipe.build()
    return pipe
