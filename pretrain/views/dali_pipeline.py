"""The DALI pipeline graph that turns shard samples into L large + S small views, cropped and flipped.

One definition serves both devices: `gpu=True` decodes each image once with the `mixed` decoder
(the hardware JPEG decoder where there is one) and every per-view operator then runs on the GPU
because it consumes GPU data; `gpu=False` runs every operator on the CPU with `device_id=None`.
Random parameters come from DALI's own random operators (no Python callback per sample), drawn on
the CPU as argument inputs; masks are decoded (`mixed` on a GPU) and cropped with the same crop
window as their view. The pipeline is built once and lives across epochs. The masking and the colour
steps are `pretrain.views.colour`'s, seeded by one draw of this pipeline per sample and view.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types
from nvidia.dali import pipeline_def
from nvidia.dali.pipeline import DataNode, Pipeline

from relicv2.pretrain.views.config import ViewConfig, ViewSpec, view_specs
from relicv2.shards.sample import IMAGE_MEMBERS, LABEL_MEMBER, MASK_FOREGROUND_LEVEL, MASK_MEMBER
from relicv2.shards.sample_set import SampleSet

READER_NAME = "shards"
# The `mixed` decoder's settings: nvJPEG buffers sized once for ImageNet's largest photos (NVIDIA's
# ResNet-50 DALI example) so that a large image never triggers a reallocation mid-run, and the
# chroma upsampling of the CPU decoder (libjpeg-turbo, as PIL), so both devices see the same pixels.
MIXED_DECODER = dict(device_memory_padding=211025920, host_memory_padding=140544512,
                     preallocate_width_hint=5980, preallocate_height_hint=6430, jpeg_fancy_upsampling=True)
MAX = 255.0


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
    coverage: DataNode  # fraction of mask pixels >= MASK_FOREGROUND_LEVEL
    maskable: DataNode  # coverage >= mask_min_coverage
    grey: DataNode  # the sample's background grey level, 0..255 (CPU)
    on_gpu: bool


def _uniform(lo: float, hi: float) -> DataNode:
    """U[lo, hi) per sample; a constant when the range is empty (DALI rejects zero-width ranges)."""
    return fn.random.uniform(range=[lo, hi]) if hi > lo else fn.constant(fdata=float(lo), shape=[])


def _coin(probability: float) -> DataNode:
    """1.0 with `probability`, else 0.0, per sample (coin_flip has no float output)."""
    return fn.random.choice(np.array([0.0, 1.0], np.float32), p=[1.0 - probability, probability])


def _crop_window(shape: DataNode, image_hw: DataNode, spec: ViewSpec, cfg: ViewConfig) -> CropWindow:
    """The relative ROI of one random-resized crop, flip included, drawn by DALI's own random ops.

    Drawn once per view and applied to both image and mask; a flip is an ROI whose x start is
    greater than its end (DALI's resize then mirrors), so crop and flip stay identical for both.
    `image_hw`: the image's (height, width) as floats. Written as (y, x) vector arithmetic: every
    operator here runs once per sample per view, so each one saved counts.
    """
    anchor, size = fn.random_crop_generator(shape, random_area=list(spec.crop_scale), random_aspect_ratio=list(cfg.crop_ratio))
    flip = _coin(cfg.flip_probability)
    start, extent = anchor / image_hw, size / image_hw  # relative (y, x)
    mirror = fn.stack(flip * 0.0, flip) * extent  # a flip moves x start to x end and back
    if cfg.debug_params:
        area, ratio = extent[0] * extent[1], size[1] / size[0]
    else:  # only reported, never used: no operators for them
        area = ratio = flip * 0.0
    return CropWindow(start=start + mirror, end=start + extent - mirror, area=area, ratio=ratio, flip=flip)


def _resize_args(window: CropWindow, spec: ViewSpec) -> dict:
    return dict(size=[spec.size, spec.size], roi_start=window.start, roi_end=window.end, roi_relative=True, antialias=True)


def _mask_crop(mask: SampleMask, window: CropWindow, spec: ViewSpec, gpu: bool) -> tuple[DataNode, DataNode | None]:
    """Whether a large view is masked (with probability p_m, when its sample may be) and its crop of the mask.

    The mask gets the view's crop window (and so its flip). Returns (masked flag as float, the view's
    crop of the mask, HW1 uint8 on the views' device, or None): the colour stage replaces the
    background, a few element-wise operations there against ~9 DALI operators a view here.
    """
    draw = fn.random.coin_flip(probability=spec.mask_probability, dtype=types.BOOL)
    if mask.image is None or spec.mask_probability == 0:
        return fn.cast(draw, dtype=types.FLOAT) * 0.0, None
    masked = (draw.gpu() if mask.on_gpu else draw) & mask.maskable
    soft = fn.resize(mask.image, interp_type=types.INTERP_LINEAR, **_resize_args(window, spec))  # uint8
    return fn.cast(masked, dtype=types.FLOAT), soft.gpu() if gpu and not mask.on_gpu else soft


def _view(image: DataNode, mask: SampleMask, shape: DataNode, image_hw: DataNode, spec: ViewSpec, cfg: ViewConfig,
          gpu: bool):
    """One view (HWC uint8, as cropped), its parameters, its masked flag and its crop of the mask.

    The parameters: the geometry's (area, ratio, flip) and a uniform draw the host's colour draws are
    seeded from (`pretrain.views.colour.colour_params`).
    """
    window = _crop_window(shape, image_hw, spec, cfg)
    view = fn.resize(image, interp_type=types.INTERP_CUBIC, **_resize_args(window, spec))  # uint8: rounded, clamped
    masked, soft = _mask_crop(mask, window, spec, gpu)
    # The colour parameters are drawn on the host from this one draw per sample: ~10 DALI random
    # operators a view cost more CPU per batch than the rest of the graph's scalar work, numpy's
    # vectorised draws a fraction of a millisecond.
    return view, fn.stack(window.area, window.ratio, window.flip, fn.random.uniform(range=[0.0, 1.0])), masked, soft


def _sample_mask(mask_bytes: DataNode, sample_set: SampleSet, cfg: ViewConfig, gpu: bool) -> SampleMask:
    """The sample's decoded mask, its coverage, whether it may be masked, and its grey level.

    On a GPU, when every sample has a mask (what `saliency build-masks` writes), masks go through
    the `mixed` decoder and stay on the GPU with coverage and the maskable flag; with some samples
    lacking one, the CPU decoder runs under a conditional (an empty member cannot be decoded) and
    the crops are moved to the GPU.
    """
    # A whole 8-bit grey level, as the reference's grey image: the masking blend then never lands on a
    # rounding boundary, so every way of computing it rounds alike (both ways of `colour._colour`).
    grey = dmath.floor(_uniform(*[g * MAX for g in cfg.mask_grey_range]) + 0.5)
    zero = fn.cast(mask_bytes.shape()[0], dtype=types.FLOAT) * 0.0
    if not masks_in_play(sample_set, cfg):
        return SampleMask(None, zero, zero >= 1.0, grey, on_gpu=False)
    if gpu and sample_set.without_mask == 0:
        image = fn.decoders.image(mask_bytes, device="mixed", output_type=types.GRAY)
        coverage = fn.reductions.mean(fn.cast(image >= MASK_FOREGROUND_LEVEL, dtype=types.FLOAT))
        return SampleMask(image, coverage, coverage >= cfg.mask_min_coverage, grey, on_gpu=True)
    if mask_bytes.shape()[0] > 0:  # a mask member
        image = fn.decoders.image(mask_bytes, device="cpu", output_type=types.GRAY)
        coverage = fn.reductions.mean(fn.cast(image >= MASK_FOREGROUND_LEVEL, dtype=types.FLOAT))
    else:  # no mask member: a 1x1 placeholder, never used since coverage 0 is never masked
        image = fn.reshape(fn.pad(mask_bytes, shape=[1], fill_value=0), shape=[1, 1, 1], layout="HWC")
        coverage = zero
    return SampleMask(image, coverage, coverage >= cfg.mask_min_coverage, grey, on_gpu=False)


@pipeline_def(enable_conditionals=True, enable_checkpointing=True)
def _views_pipeline(sample_set: SampleSet, cfg: ViewConfig, gpu: bool, rank: int, world_size: int, reader_seed: int):
    image_bytes, mask_bytes, cls = fn.readers.webdataset(
        paths=[str(p) for p in sample_set.tars], index_paths=[str(p) for p in sample_set.index_files],
        ext=[";".join(IMAGE_MEMBERS), MASK_MEMBER, LABEL_MEMBER], missing_component_behavior="empty",
        name=READER_NAME, shard_id=rank, num_shards=world_size, pad_last_batch=True, seed=reader_seed,
        random_shuffle=True, initial_fill=cfg.shuffle_buffer, shuffle_after_epoch=True,
        shuffle_after_epoch_seed=reader_seed,  # shared by all ranks: one global shard order per epoch
    )
    # Decoded once per image (the hardware JPEG decoder on a GPU); every view is cut from it.
    decoder = dict(device="mixed", hw_decoder_load=cfg.hw_decoder_load, **MIXED_DECODER) if gpu else dict(device="cpu")
    image = fn.decoders.image(image_bytes, output_type=types.RGB, **decoder)
    shape = fn.peek_image_shape(image_bytes)
    image_hw = fn.cast(shape[0:2], dtype=types.FLOAT)
    mask = _sample_mask(mask_bytes, sample_set, cfg, gpu)
    nodes = {}
    for j, spec in enumerate(view_specs(cfg)):
        view, params, masked, soft = _view(image, mask, shape, image_hw, spec, cfg, gpu)
        nodes |= {view_output("view", j): view, view_output("params", j): params, view_output("masked", j): masked}
        if soft is not None:
            nodes[view_output("soft", j)] = soft
    # The image's first byte carries the reader's source info (tar:offset:member), i.e. the key, to
    # the batch (sets without a json member have keys too).
    nodes |= {"key": image_bytes[0:1], "cls": cls, "coverage": mask.coverage,
              "grey": mask.grey / MAX}
    return tuple(nodes[name] for name in output_names(sample_set, cfg))


# The outputs of a sample (the carrier of its key, its `cls` member, the mask's coverage and the background
# grey level in [0, 1]), and those of each view (`view_output`).
SAMPLE_OUTPUTS = ("key", "cls", "coverage", "grey")


def view_output(what: str, view: int) -> str:
    """The name of an output of view `view` (from 0): "view" (its pixels, HWC uint8), "params" (its geometry
    and the draw that seeds its colour parameters), "masked" (its masked flag) or "soft" (its crop of the mask)."""
    return f"{what}{view}"


def output_names(sample_set: SampleSet, cfg: ViewConfig) -> tuple[str, ...]:
    """The pipeline's outputs by name, in the order it returns them (DALI returns a tuple): its producer and
    its consumer both read them through these names, so the view list alone decides the layout."""
    views = range(len(view_specs(cfg)))
    return (*(view_output("view", j) for j in views), *SAMPLE_OUTPUTS, *(view_output("masked", j) for j in views),
            *(view_output("params", j) for j in views),
            *(view_output("soft", j) for j in soft_mask_views(sample_set, cfg)))


def masks_in_play(sample_set: SampleSet, cfg: ViewConfig) -> bool:
    """Whether any view of this set can be masked (the pipeline decodes masks only then)."""
    return sample_set.has_masks and cfg.mask_probability > 0 and cfg.large_views > 0


def soft_mask_views(sample_set: SampleSet, cfg: ViewConfig) -> list[int]:
    """The views whose crop of the mask the pipeline outputs: every view that may be masked, for the
    colour stage, which applies the mask."""
    if not masks_in_play(sample_set, cfg):
        return []
    return [j for j, spec in enumerate(view_specs(cfg)) if spec.mask_probability > 0]


def build_view_pipeline(sample_set: SampleSet, cfg: ViewConfig, *, batch_size: int, gpu: bool, rank: int,
                        world_size: int, seed: int, device_id: int = 0,
                        checkpoint: str | None = None) -> Pipeline:
    """A built view pipeline; restores the reader and random state from `checkpoint` when given."""
    pipe = _views_pipeline(
        sample_set, cfg, gpu, rank, world_size, seed, batch_size=batch_size, num_threads=cfg.num_threads,
        device_id=device_id if gpu else None, prefetch_queue_depth=cfg.prefetch, checkpoint=checkpoint,
        seed=seed * 7919 + rank + 1,  # augmentations differ per rank, reproducible per seed
    )
    pipe.build()
    return pipe
