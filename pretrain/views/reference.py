"""The view augmentations with PIL/torchvision on a torch DataLoader.

The independent check of the DALI pipeline (tests compare their statistics) and the fallback when
DALI is not installed (`backend="reference"`). Every random draw comes from a generator seeded by
(seed, epoch, sample position), so batches do not depend on worker scheduling and a resumed run
continues with the same batches.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torchvision.transforms.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from relicv2.pretrain.seeding import SeedPurpose, derive_seed
from relicv2.pretrain.views.backend import (
    BackendBatch,
    BackendSetup,
    assemble_params,
    labels_tensor,
)
from relicv2.pretrain.views.config import JITTER_ORDERS, ViewConfig, ViewSpec, view_specs
from relicv2.shards.images import load_gray, load_image
from relicv2.shards.reader import SampleRef
from relicv2.shards.sample import MASK_FOREGROUND_LEVEL, MASK_MEMBER

# The jitter operations in JITTER_ORDERS' numbering, each taking its own factor.
JITTER_STEPS = (F.adjust_brightness, F.adjust_contrast, F.adjust_saturation, F.adjust_hue)


def random_resized_crop(width: int, height: int, scale, ratio, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """(left, top, w, h) of a random crop, torchvision's algorithm on a seeded numpy generator.

    Re-implemented (10 tries of area/log-ratio, then a centre crop of clamped ratio) because
    torchvision's `get_params` draws from torch's global generator, not one seeded per sample.
    """
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1)), w, h
    in_ratio = width / height
    if in_ratio < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif in_ratio > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def crop_view(image: Image.Image, box: tuple[int, int, int, int], size: int, flip: bool) -> Image.Image:
    """The crop `box` (left, top, right, bottom) resized to size x size (bicubic), mirrored if `flip`."""
    view = image.resize((size, size), Image.BICUBIC, box=box)
    return view.transpose(Image.FLIP_LEFT_RIGHT) if flip else view


def mask_view(view: Image.Image, image: Image.Image, mask: Image.Image, box, flip: bool, grey: int) -> Image.Image:
    """The view's background replaced by `grey`: the mask gets the view's crop `box` (scaled when
    the mask is stored downscaled) and flip, bilinear, and weighs image against grey."""
    sx, sy = mask.width / image.width, mask.height / image.height
    soft = mask.resize(view.size, Image.BILINEAR, box=(box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy))
    if flip:
        soft = soft.transpose(Image.FLIP_LEFT_RIGHT)
    return Image.composite(view, Image.new("RGB", view.size, (grey,) * 3), soft)


def colour_steps(
    view: Image.Image, cfg: ViewConfig, *, jitter: bool, order: int, factors: tuple[float, float, float, float],
    gray: bool, blur: bool, sigma: float, solarize: bool,
) -> Image.Image:
    """Colour jitter (in JITTER_ORDERS[order]), grayscale, blur and solarize with the given draws."""
    if jitter:
        for op in JITTER_ORDERS[order]:
            view = JITTER_STEPS[op](view, factors[op])
    if gray:
        view = F.rgb_to_grayscale(view, num_output_channels=3)
    if blur:
        # torchvision pads by reflection, which needs the half-kernel under the view size: views
        # smaller than the kernel get the largest kernel that fits (DALI mirrors at the border too).
        kernel = min(cfg.blur_kernel, 2 * min(view.size) - 1)
        view = F.gaussian_blur(view, [kernel] * 2, [sigma, sigma])
    if solarize:
        view = F.solarize(view, 128)  # x >= 0.5 -> 1 - x on 8-bit values
    return view


def augment_view(
    image: Image.Image, mask: Image.Image | None, maskable: bool, grey: int, spec: ViewSpec, cfg: ViewConfig,
    rng: np.random.Generator,
) -> tuple[torch.Tensor, np.ndarray, bool]:
    """One view (CHW float, normalised), its drawn parameters (PARAM_NAMES minus masked/coverage/grey)
    and whether it was masked. Draws come from `rng` in a fixed order, so a seeded rng replays them."""
    left, top, w, h = random_resized_crop(image.width, image.height, spec.crop_scale, cfg.crop_ratio, rng)
    flip = rng.random() < cfg.flip_probability
    box = (left, top, left + w, top + h)
    view = crop_view(image, box, spec.size, flip)
    masked = bool(rng.random() < spec.mask_probability) and maskable
    if masked:
        view = mask_view(view, image, mask, box, flip, grey)
    jitter = rng.random() < cfg.jitter_probability
    order = int(rng.integers(0, len(JITTER_ORDERS)))
    factors = tuple(rng.uniform(lo, hi) for lo, hi in cfg.jitter_ranges)
    gray = rng.random() < cfg.grayscale_probability
    sigma = rng.uniform(*cfg.blur_sigma)
    blur = rng.random() < spec.blur_probability
    solarize = rng.random() < spec.solarize_probability
    view = colour_steps(view, cfg, jitter=jitter, order=order, factors=factors, gray=gray, blur=blur, sigma=sigma,
                        solarize=solarize)
    tensor = F.normalize(F.to_tensor(view), cfg.mean, cfg.std)
    params = np.array([w * h / (image.width * image.height), w / h, flip, jitter, order, *factors, gray, blur,
                       sigma, solarize], np.float32)
    return tensor, params, masked


def augment_sample(encoded: bytes, mask_png: bytes | None, cfg: ViewConfig, rng: np.random.Generator) -> dict:
    """All views of one sample (image bytes in any format PIL reads), with coverage, grey level and
    per-view parameters. Image and mask are read as displayed (EXIF orientation applied, as DALI's
    decoder does) through the one image loader; a bad one raises ImageLoadError (a ValueError)."""
    image = load_image(encoded, "image")
    mask, coverage = None, 0.0
    if mask_png:
        gray = load_gray(mask_png, "mask")
        mask = Image.fromarray(gray)
        coverage = float((gray >= MASK_FOREGROUND_LEVEL).mean())
    grey = int(round(rng.uniform(*cfg.mask_grey_range) * 255))
    maskable = mask is not None and coverage >= cfg.mask_min_coverage
    drawn = [augment_view(image, mask, maskable, grey, spec, cfg, rng) for spec in view_specs(cfg)]
    views, params, masked = (list(column) for column in zip(*drawn, strict=True))
    return {"views": views, "params": params, "masked": masked, "coverage": coverage, "grey": grey / 255}


class ViewDataset(Dataset):
    """Samples of a shard set addressed by (epoch, position); returns None for an unreadable one.

    A sample's draws are seeded by (seed, epoch, sample position) only, so its views do not depend
    on which rank reads it."""

    def __init__(self, samples: Sequence[SampleRef], cfg: ViewConfig, seed: int):
        self.samples, self.cfg, self.seed = samples, cfg, seed

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]) -> dict | None:
        epoch, position = item
        ref = self.samples[position]
        rng = np.random.default_rng(derive_seed(self.seed, SeedPurpose.VIEW_PARAMETERS, epoch, position))
        try:
            out = augment_sample(ref.read_image(), ref.read(MASK_MEMBER), self.cfg, rng)
        except (OSError, ValueError, SyntaxError):  # what PIL raises for corrupt image data
            return None
        out["key"], out["label"] = ref.key, ref.label
        return out


def rank_batches(st: BackendSetup) -> Iterator[list[tuple[int, int]]]:
    """This rank's batches of (epoch, sample position) pairs from (`st.epoch`, `st.batch_in_epoch`) on,
    epoch after epoch.

    One permutation per epoch shared by all ranks; global batch i is its slice
    [i * G, (i + 1) * G) with G = batch_size * world_size, and rank r takes the r-th `batch_size`
    of it. The ranks' batches put together are therefore the same global batches whatever the
    number of ranks, which is what lets a run resume on another number of ranks and continue the
    same stream. (DALI's reader instead gives each rank a contiguous share; the loader's epoch
    length, `batches_per_epoch` = samples // G, is the same for both.) Endless, so one DataLoader and
    its workers live across epochs and prefetch the next epoch's first batches."""
    count, num_batches, global_batch = len(st.samples), st.batches_per_epoch, st.batch_size * st.world_size
    if num_batches * global_batch > count:
        raise ValueError(f"{count} samples hold fewer than {num_batches} global batches of {global_batch}")
    epoch, start, offset = st.epoch, st.batch_in_epoch, st.rank * st.batch_size
    while True:
        rng = np.random.default_rng(derive_seed(st.seed, SeedPurpose.EPOCH_ORDER, epoch))
        order = rng.permutation(count)
        for i in range(start, num_batches):
            yield [(epoch, int(p)) for p in order[i * global_batch + offset:][: st.batch_size]]
        epoch, start = epoch + 1, 0


def collate(items: list[dict | None]) -> BackendBatch:
    """Stack views; unreadable samples (None) are dropped from the batch and counted."""
    good = [it for it in items if it is not None]
    v = len(good[0]["views"]) if good else 0
    per_view = [np.stack([it["params"][j] for it in good]) for j in range(v)]
    masked = [np.array([it["masked"][j] for it in good], np.float32) for j in range(v)]
    return BackendBatch(
        views=[torch.stack([it["views"][j] for it in good]) for j in range(v)],
        keys=[it["key"] for it in good],
        labels=labels_tensor([it["label"] for it in good]),
        params=assemble_params(per_view, masked, np.array([it["coverage"] for it in good], np.float32),
                               np.array([it["grey"] for it in good], np.float32)),
        unreadable=len(items) - len(good),
        masked_views=sum(int(flag) for it in good for flag in it["masked"]),
    )


def dataloader_workers(config: ViewConfig) -> int:
    """The reference DataLoader's worker processes: one per thread, none (in this process) for one thread."""
    return config.num_threads if config.num_threads > 1 else 0


class ReferenceBackend:
    """Feeds a ViewLoader from one torch DataLoader that runs across epochs; every draw is seeded by
    (seed, epoch, sample position), so the position (epoch, batch) is the whole state."""

    def __init__(self, setup: BackendSetup) -> None:
        self.setup = setup
        self.dataset = ViewDataset(setup.samples.samples, setup.config, setup.seed)
        self.iterator = None

    def next_batch(self) -> BackendBatch:
        if self.iterator is None:
            st = self.setup
            workers = dataloader_workers(st.config)
            loader = DataLoader(self.dataset, batch_sampler=rank_batches(st), collate_fn=collate,
                                num_workers=workers, prefetch_factor=st.config.prefetch if workers else None)
            self.iterator = iter(loader)
        return next(self.iterator)

    def end_epoch(self) -> None:
        pass  # the sampler runs on into the next epoch: nothing to skip, no workers to restart

    def state(self) -> dict:
        return {}
