"""The DALI pipeline that turns shard samples into L large + S small augmented views.

One definition serves both devices: `gpu=True` decodes images with the `mixed` decoder (the ops
that follow run on the GPU because they consume GPU data), `gpu=False` runs every operator on the
CPU with `device_id=None`. Masks (small PNGs) are decoded and cropped on the CPU in both modes, so
coverage and the masking decision are CPU values that can drive conditionals.

Views stay 8-bit from the resize to the normalisation, as in the PIL reference: the colour
operators then run DALI's fast integer kernels (with rounding between steps, like PIL).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import nvidia.dali.fn as fn
import nvidia.dali.math as dmath
import nvidia.dali.types as types
import torch
from nvidia.dali import pipeline_def
from nvidia.dali.pipeline import DataNode, Pipeline
from nvidia.dali.plugin.pytorch import feed_ndarray
from nvidia.dali.tensors import TensorListGPU

from pretrain.views.config import GRAYSCALE_WEIGHTS, JITTER_ORDERS, ViewConfig, ViewSpec, view_specs
from pretrain.views.loader import assemble_params, labels_tensor
from pretrain.views.sources import SampleRef, SampleSet

READER_NAME = "shards"
MAX = 255.0
SOLARIZE_TABLE = [i if i < 128 else 255 - i for i in range(256)]  # x >= 0.5 -> 1 - x on 8 bits


def _uniform(lo: float, hi: float) -> DataNode:
    """U[lo, hi) per sample; a constant when the range is empty (DALI rejects zero-width ranges)."""
    return fn.random.uniform(range=[lo, hi]) if hi > lo else fn.constant(fdata=float(lo), shape=[])


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


def _crop_window(shape: DataNode, spec: ViewSpec, cfg: ViewConfig) -> tuple[DataNode, ...]:
    """Relative ROI (start, end, area, ratio, flip) of one random-resized crop, flip included.

    Drawn once per view and applied to both image and mask; a flip is an ROI whose x start is
    greater than its end (DALI's resize then mirrors), so crop and flip stay identical for both.
    """
    anchor, size = fn.random_crop_generator(shape, random_area=list(spec.crop_scale), random_aspect_ratio=list(cfg.crop_ratio))
    flip = fn.cast(fn.random.coin_flip(probability=cfg.flip_probability), dtype=types.FLOAT)
    height, width = fn.cast(shape[0], dtype=types.FLOAT), fn.cast(shape[1], dtype=types.FLOAT)
    y0, x0 = fn.cast(anchor[0], dtype=types.FLOAT) / height, fn.cast(anchor[1], dtype=types.FLOAT) / width
    h, w = fn.cast(size[0], dtype=types.FLOAT) / height, fn.cast(size[1], dtype=types.FLOAT) / width
    start = fn.stack(y0, x0 + flip * w)
    end = fn.stack(y0 + h, x0 + w - flip * w)
    ratio = (w * width) / (h * height)
    return start, end, h * w, ratio, flip


def _view(image, mask, maskable, grey, shape, spec: ViewSpec, cfg: ViewConfig, gpu: bool):
    """One augmented view (CHW float) and its drawn parameters (see view_config.PARAM_NAMES)."""
    start, end, area, ratio, flip = _crop_window(shape, spec, cfg)
    crop = dict(size=[spec.size, spec.size], roi_start=start, roi_end=end, roi_relative=True, antialias=True)
    view = fn.resize(image, interp_type=types.INTERP_CUBIC, **crop)  # uint8: rounded and clamped
    masked = fn.random.coin_flip(probability=spec.mask_probability, dtype=types.BOOL) & maskable
    if mask is not None and spec.mask_probability > 0:
        if masked:  # only the masked views pay for the mask crop and the blend
            soft = fn.resize(mask, interp_type=types.INTERP_LINEAR, dtype=types.FLOAT, **crop) / MAX
            grey_level = _on_device(grey, gpu)
            view = _to_uint8(grey_level + (view - grey_level) * _on_device(soft, gpu))

    jitter = fn.random.coin_flip(probability=cfg.jitter_probability, dtype=types.BOOL)
    order = fn.random.uniform(values=list(range(len(JITTER_ORDERS))), dtype=types.INT32)
    factors = (
        _uniform(max(0.0, 1 - cfg.brightness), 1 + cfg.brightness),
        _uniform(max(0.0, 1 - cfg.contrast), 1 + cfg.contrast),
        _uniform(max(0.0, 1 - cfg.saturation), 1 + cfg.saturation),
        _uniform(-cfg.hue, cfg.hue),
    )
    active = [op for op, strength in enumerate((cfg.brightness, cfg.contrast, cfg.saturation, cfg.hue)) if strength > 0]
    if active and cfg.jitter_probability > 0:
        if jitter:
            for slot in range(4):
                op = fn.lookup_table(order, keys=list(range(24)), values=[o[slot] for o in JITTER_ORDERS], dtype=types.INT32)
                view = _one_of(view, op, active, len(active) == 4, factors, cfg.hue_model, gpu)

    gray = fn.random.coin_flip(probability=cfg.grayscale_probability, dtype=types.BOOL)
    if cfg.grayscale_probability > 0:  # static skips: an operation of probability 0 costs nothing
        if gray:
            # DALI's RGB->GRAY uses the same ITU-R 601 weights; GRAY->RGB replicates the channel.
            grey_view = fn.color_space_conversion(view, image_type=types.RGB, output_type=types.GRAY)
            view = fn.color_space_conversion(grey_view, image_type=types.GRAY, output_type=types.RGB)

    sigma = _uniform(*cfg.blur_sigma)
    blur = fn.random.coin_flip(probability=spec.blur_probability, dtype=types.BOOL)
    if spec.blur_probability > 0:
        if blur:
            # The paper's 23x23 kernel, truncated at 4 sigma (2 * ceil(4 sigma) + 1 <= 23 taps):
            # the dropped tails hold < 2e-4 of the weight, under 0.05 of an 8-bit level, and the
            # blur, the costliest step on a CPU, gets ~2x cheaper on average.
            window = dmath.min(2.0 * dmath.ceil(4.0 * sigma) + 1.0, float(cfg.blur_kernel))
            view = fn.gaussian_blur(view, window_size=fn.cast(window, dtype=types.INT32), sigma=sigma)

    solarize = fn.random.coin_flip(probability=spec.solarize_probability, dtype=types.BOOL)
    if spec.solarize_probability > 0:
        if solarize:
            view = fn.lookup_table(view, keys=list(range(256)), values=SOLARIZE_TABLE, dtype=types.UINT8)

    view = fn.crop_mirror_normalize(
        view, mean=[m * MAX for m in cfg.mean], std=[s * MAX for s in cfg.std], output_layout="CHW", dtype=types.FLOAT,
    )
    f = lambda x: fn.cast(x, dtype=types.FLOAT)  # noqa: E731
    params = fn.stack(
        f(area), f(ratio), f(flip), f(jitter), f(order), *[f(x) for x in factors], f(gray), f(blur), f(sigma), f(solarize)
    )
    return view, params, f(masked)


@pipeline_def(enable_conditionals=True, enable_checkpointing=True)
def _views_pipeline(sample_set: SampleSet, cfg: ViewConfig, gpu: bool, rank: int, world_size: int, reader_seed: int):
    image_bytes, mask_bytes, cls, meta = fn.readers.webdataset(
        paths=[str(p) for p in sample_set.tars],
        index_paths=[str(p) for p in sample_set.index_files],
        ext=["jpg", "mask.png", "cls", "json"],
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
    decoder = dict(device="mixed", hw_decoder_load=cfg.hw_decoder_load) if gpu else dict(device="cpu")
    image = fn.decoders.image(image_bytes, output_type=types.RGB, **decoder)
    shape = fn.peek_image_shape(image_bytes)
    grey = _uniform(*[g * MAX for g in cfg.mask_grey_range])
    has_mask = mask_bytes.shape()[0] > 0
    mask = None
    coverage = fn.cast(mask_bytes.shape()[0], dtype=types.FLOAT) * 0.0
    use_masks = sample_set.has_masks and cfg.mask_probability > 0 and cfg.large_views > 0
    if use_masks:
        if has_mask:
            mask = fn.decoders.image(mask_bytes, device="cpu", output_type=types.GRAY)
            coverage = fn.reductions.mean(fn.cast(mask >= 128, dtype=types.FLOAT))
        else:  # no mask member: a 1x1 placeholder, never used since coverage 0 is never masked
            mask = fn.reshape(fn.pad(mask_bytes, shape=[1], fill_value=0), shape=[1, 1, 1], layout="HWC")
            coverage = fn.cast(mask_bytes.shape()[0], dtype=types.FLOAT) * 0.0
    maskable = coverage >= cfg.mask_min_coverage
    views, params, masked = [], [], []
    for spec in view_specs(cfg):
        v, p, m = _view(image, mask, maskable, grey, shape, spec, cfg, gpu)
        views.append(v)
        params.append(p)
        masked.append(m)
    outputs = [*views, meta, cls, has_mask, coverage, grey / MAX, *masked]
    if cfg.debug_params:
        outputs += params
    return tuple(outputs)


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


def find_undecodable(samples: Sequence[SampleRef], batch_size: int = 64) -> dict[str, str]:
    """Keys of samples whose image or mask DALI's CPU decoder rejects, with a reason code.

    A failing batch is bisected (a failed pipeline is unusable, so each try builds a new one).
    """
    bad: dict[str, str] = {}
    for start in range(0, len(samples), batch_size):
        _bisect_decode(list(samples[start : start + batch_size]), bad)
    return bad


def _decodes(chunk: list[SampleRef], ext: str) -> bool:
    data = [s.read(ext) for s in chunk]
    data = [d for d in data if d]
    if not data:
        return True
    @pipeline_def(batch_size=len(data), num_threads=1, device_id=None)
    def check():
        raw = fn.external_source(source=lambda: [np.frombuffer(d, np.uint8) for d in data], batch=True)
        return fn.decoders.image(raw, device="cpu", output_type=types.ANY_DATA)

    try:
        pipe = check()
        pipe.build()
        pipe.run()
        return True
    except RuntimeError:
        return False


def _bisect_decode(chunk: list[SampleRef], bad: dict[str, str]) -> None:
    for ext, reason in (("jpg", "undecodable_jpeg"), ("mask.png", "bad_mask")):
        if _decodes(chunk, ext):
            continue
        if len(chunk) == 1:
            bad[chunk[0].key] = reason
            return
        half = len(chunk) // 2
        _bisect_decode(chunk[:half], bad)
        _bisect_decode(chunk[half:], bad)
        return


def _to_torch(batch) -> torch.Tensor:
    """A DALI batch of equal-shape samples as a torch tensor that owns its memory."""
    if isinstance(batch, TensorListGPU):
        dense = batch.as_tensor()
        out = torch.empty(dense.shape(), dtype=torch.float32, device="cuda")
        feed_ndarray(dense, out, cuda_stream=torch.cuda.current_stream())
        return out
    return torch.from_numpy(np.array(batch.as_tensor()))


def _scalars(batch) -> np.ndarray:
    batch = batch.as_cpu() if isinstance(batch, TensorListGPU) else batch
    return np.array([np.asarray(batch[i]).reshape(()) for i in range(len(batch))], np.float32)


def sample_key(source_info: str) -> str:
    """`shard.tar:offset:key.json` (DALI's source info of a webdataset member) -> key."""
    member = source_info.rsplit(":", 1)[-1].rsplit("/", 1)[-1]
    return member.split(".", 1)[0]


class DaliBackend:
    """Runs the view pipeline for a ViewLoader and keeps its epochs aligned with the reader's."""

    def __init__(self, loader, restore: dict | None):
        self.loader = loader
        self.num_views = len(view_specs(loader.config))
        self.debug = loader.config.debug_params
        self.recoveries = 0
        self._build(restore["checkpoint"] if restore else None)

    def _build(self, checkpoint: str | None) -> None:
        ld = self.loader
        gpu = ld.device != "cpu"
        device_id = 0
        if gpu:
            device_id = int(ld.device.split(":")[1]) if ":" in ld.device else torch.cuda.current_device()
        self.pipe = build_view_pipeline(
            ld.samples, ld.config, batch_size=ld.batch_size, gpu=gpu, rank=ld.rank, world_size=ld.world_size,
            seed=ld.seed, device_id=device_id, checkpoint=checkpoint,
        )
        meta = self.pipe.reader_meta(READER_NAME)
        # With pad_last_batch every rank reads ceil(N / ranks) samples per epoch.
        self.reader_epoch = meta["epoch_size_padded"] // meta["number_of_shards"]
        if self.reader_epoch != ld.epoch_size:
            raise RuntimeError(f"DALI reads {self.reader_epoch} samples per rank, expected {ld.epoch_size}")

    def _recover(self, error: RuntimeError) -> None:
        """After a decode failure: find and leave out the undecodable samples, rebuild, and replay
        the current epoch up to the same batch. Costs one decode pass over the shard set plus the
        replayed batches; rare by construction (shards are verified when built). With several
        ranks, only the failing rank's epoch shrinks: keep verified shards for multi-rank runs."""
        bad = find_undecodable(self.loader.samples.samples)
        if not bad:
            raise RuntimeError(f"the DALI pipeline failed and no undecodable sample was found: {error}") from error
        warnings.warn(f"{self.loader.samples.directory}: DALI could not decode {sorted(bad)}; left out, "
                      "replaying the epoch up to the current batch", stacklevel=3)
        self.loader.exclude(bad)
        self.recoveries += 1
        self._build(None)
        for _ in range(self.loader.batch_in_epoch):
            self.pipe.run()

    def next_batch(self) -> dict:
        try:
            out = self.pipe.run()
        except RuntimeError as error:
            self._recover(error)
            out = self.pipe.run()
        v = self.num_views
        views = [_to_torch(out[i]) for i in range(v)]
        meta, cls, has_mask, coverage, grey = out[v : v + 5]
        masked = out[v + 5 : 2 * v + 5]
        keys = [sample_key(meta[i].source_info()) for i in range(len(meta))]
        labels = []
        for i in range(len(cls)):
            raw = np.asarray(cls[i]).tobytes()
            labels.append(int(raw) if raw.strip() else None)
        batch = {"views": views, "keys": keys, "labels": labels_tensor(labels)}
        if self.debug:
            params = [np.array(out[2 * v + 5 + j].as_tensor()) for j in range(v)]
            batch["params"] = assemble_params(
                params, [_scalars(m) for m in masked], _scalars(coverage), _scalars(grey)
            )
        return batch

    def end_epoch(self) -> None:
        # The reader's last batch of an epoch is incomplete (padded): run it and drop it, so the
        # next epoch starts on a fresh reader epoch.
        if self.reader_epoch % self.loader.batch_size:
            self.pipe.run()

    def state(self) -> dict:
        return {"checkpoint": self.pipe.checkpoint()}
